"""The rich Console every table goes through: the terminal's width on a terminal; piped or redirected (a log, a
CI job, `| less`), wide enough that no table is squeezed into cut headers and wrapped cells, and no colour codes."""

from __future__ import annotations

PIPED_WIDTH = 400   # a table's natural width stays its own: rich only fills the width it is asked to


def console():
    from rich.console import Console

    term = Console()
    return term if term.is_terminal else Console(width=PIPED_WIDTH, no_color=True, highlight=False)


# Bidi overrides and isolates: they reorder what follows on the line (a spoofed state or path), like an escape would.
_BIDI = frozenset("\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069")


def terminal_text(value: object) -> str:
    """`value` as one line for the terminal: control characters removed (C0 and C1, DEL: ESC, BEL, CSI, so an OSC-52
    clipboard write or a screen clear in a record's field is plain text) and the bidi overrides. Every record field
    `jobs` and `storage status` print goes through here: job.json, run and owner records live in shared folders."""
    import unicodedata

    return "".join(c for c in str(value) if unicodedata.category(c) != "Cc" and c not in _BIDI)


def cell(value: object):
    """A table cell holding `value` as plain text (terminal_text; never read as rich markup)."""
    from rich.text import Text

    return Text(terminal_text(value))
