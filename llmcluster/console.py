"""The rich Console every table goes through: the terminal's width on a terminal; piped or redirected (a log, a
CI job, `| less`), wide enough that no table is squeezed into cut headers and wrapped cells, and no colour codes."""

from __future__ import annotations

PIPED_WIDTH = 400   # a table's natural width stays its own: rich only fills the width it is asked to


def console():
    from rich.console import Console

    term = Console()
    return term if term.is_terminal else Console(width=PIPED_WIDTH, no_color=True, highlight=False)
