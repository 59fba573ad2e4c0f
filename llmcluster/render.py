"""The rendering boundary: every value Python puts into a shell script, an #SBATCH directive, a comment, a YAML
manifest, a Prometheus file or a subprocess argv goes through one of these renderers, each of which quotes or
refuses (issue 32). No other module builds such text by formatting a value into a string.

    shell_word / shell_join   a word of a bash script (single-quoted; ShellVar for the renderers' own "$vars")
    shell_export              an `export NAME=value` line (the name held to the environment-name grammar)
    directive_value           an #SBATCH (or other directive) value: a small ASCII grammar, else refused
    directive_path            a path in an #SBATCH filename pattern (--output): the grammar, '%' doubled
    list_item                 one item of a list a program splits itself (pyxis's --container-mounts)
    k8s_text                  a container's command/args/env value: '$' doubled against the kubelet's $(VAR)
    comment_text              free text in a `#` comment: printable ASCII, everything else escaped
    line_text                 a value that must stay on one line (an env value, a log field): breaks refused
    argv_element              one argument of a subprocess argv: NUL refused, a leading '-' refused where positional
    yaml_text                 YAML documents through a safe dumper (multi-line strings as literal blocks)

The hostile-string property test (tests/test_render_boundary.py) runs every artefact renderer listed there over
the same strings; a new renderer is covered by adding it to that list. Leaf module: imports nothing of ours but
errors.
"""

from __future__ import annotations

import re
import shlex

from llmcluster.errors import UserError

# Everything Python's str.splitlines() splits on (LF, CR, VT, FF, FS, GS, RS, NEL U+0085, LS U+2028, PS U+2029),
# plus NUL: a value holding one would start a new line in some reader (bash, sbatch, YAML, a log) or end a C string.
LINE_BREAKS = "\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029"
_BREAK = re.compile(f"[{re.escape(LINE_BREAKS)}\x00]")
# #SBATCH values and other directive values: no space, no quote, no shell or Slurm metacharacter; ASCII only.
DIRECTIVE_SAFE = re.compile(r"[A-Za-z0-9_./:@%+=,-]+", re.ASCII)
ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*", re.ASCII)
_PRINTABLE = re.compile(r"[ -~]*", re.ASCII)


class ShellVar(str):
    """A word the batch shell expands at run time ("$head:$port"); rendered in double quotes, unquoted
    otherwise. Only the renderers create these, from fixed text: user values are never ShellVars."""


class Program(str):
    """A program text of our own (a `python -c` source): may span lines, single-quoted like any word. Only
    module constants are Programs: user values never are."""


def has_line_break(value: str) -> bool:
    return bool(_BREAK.search(value))


def line_text(value, what: str) -> str:
    """A value that must stay one line (an argument, a path, an env value): a line break or NUL is refused (it
    would split an #SBATCH line or a log record, and no real path or argument needs one)."""
    value = str(value)
    if has_line_break(value):
        raise UserError(f"{what} {show_value(value)} contains a newline, another line break or NUL: refused")
    return value


def shell_word(word) -> str:
    """One word of a bash script: single-quoted (nothing inside expands), after the one-line check."""
    if isinstance(word, ShellVar):
        return f'"{word}"'
    if isinstance(word, Program):
        return shlex.quote(word)
    return shlex.quote(line_text(word, "a value for a shell script"))


def shell_join(words) -> str:
    return " ".join(shell_word(w) for w in words)


def shell_export(name: str, value) -> str:
    """`export NAME=value`: the name is an environment-variable name (a bash word, never quoted), the value a
    shell word."""
    if not ENV_NAME.fullmatch(name):
        raise UserError(f"{show_value(name)} is not an environment variable name (letters, digits, '_')")
    return f"export {name}={shell_word(value)}"


def directive_value(value, what: str) -> str:
    """A value of an `#SBATCH --key=value` line (sbatch reads these lines itself, with no shell quoting)."""
    value = str(value)
    if not DIRECTIVE_SAFE.fullmatch(value):
        raise UserError(f"{what} {show_value(value)} cannot go into an #SBATCH line "
                        "(letters, digits and ._/:@%+=,- only)")
    return value


def directive_path(value, what: str) -> str:
    """A path in an #SBATCH filename pattern (--output/--error): sbatch expands %j, %u, %x ... there and reads
    '%%' as one '%', so every '%' of the path is doubled and the file lands where the path says."""
    return directive_value(value, what).replace("%", "%%")


def list_item(value, what: str, separators: str) -> str:
    """One item of a list that a program splits itself (pyxis's --container-mounts SRC:DST[:ro],... on ',' and
    ':'): a value holding one of its separators would become two items, so it is refused."""
    value = line_text(value, what)
    if bad := [c for c in separators if c in value]:
        raise UserError(f"{what} {show_value(value)} contains {bad[0]!r}, which separates the items of the list it "
                        "goes into: refused")
    return value


class K8sRef(str):
    """A container value holding the kubelet's own $(VAR) references ("$(POD_NAME)", "$(MASTER_ADDR)"): only
    the renderers create these, from fixed text; k8s_text leaves them as they are."""


def k8s_text(value) -> str:
    """A value of a container's command, args or env: the kubelet expands $(VAR) there (to another env value,
    a secret's among them) and reads '$$' as '$', so every '$' is doubled and the container gets the value as
    written. The YAML around it is yaml_text's."""
    if isinstance(value, K8sRef):
        return str(value)
    return str(value).replace("$", "$$")


def comment_text(value) -> str:
    """Free text for a `# ...` comment line: printable ASCII stays, anything else (a line break, a control or
    non-ASCII character) is written as its escape, so the comment cannot end early."""
    value = str(value)
    if _PRINTABLE.fullmatch(value):
        return value
    return "".join(c if " " <= c <= "~" else c.encode("unicode_escape").decode("ascii") for c in value)


def argv_element(value, what: str, positional: bool = False) -> str:
    """One argv element for subprocess: NUL cannot be passed; a positional that starts with '-' would be read as
    an option by the program (refused: pass it as `--flag=value` or after `--`)."""
    value = str(value)
    if "\x00" in value:
        raise UserError(f"{what} {show_value(value)} contains NUL: refused")
    if positional and value.startswith("-"):
        raise UserError(f"{what} {show_value(value)} starts with '-' and would be read as an option: refused")
    return value


def yaml_text(docs: list, literal_blocks: bool = True) -> str:
    """YAML documents through a SafeDumper: every string a quoted or literal scalar as YAML requires, never a tag
    or an anchor from data. Multi-line strings (a ConfigMap's config.yaml) as literal blocks, readable."""
    import yaml

    # libyaml's emitter where PyYAML was built with it (4x faster: artefacts render on every launch and test);
    # the same safe representers either way, and the hostile-string suite round-trips both (test_render_boundary)
    class Dumper(getattr(yaml, "CSafeDumper", yaml.SafeDumper)):
        def ignore_aliases(self, data):   # a value repeated is written twice, never as an anchor
            return True

    def text(dumper, value: str):
        style = "|" if literal_blocks and "\n" in value and not _needs_plain_escape(value) else None
        return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)

    Dumper.add_representer(str, text)
    return yaml.dump_all(docs, Dumper=Dumper, sort_keys=False, allow_unicode=False)


def _needs_plain_escape(value: str) -> bool:
    """A literal block cannot hold trailing spaces on a line, CR or other breaks faithfully: those go quoted."""
    return any(c in value for c in LINE_BREAKS.replace("\n", "")) or "\x00" in value or " \n" in value \
        or value.endswith(" ") or not _PRINTABLE.fullmatch(value.replace("\n", "").replace("\t", ""))


def show_value(value: str, limit: int = 80) -> str:
    """A value as an error line shows it: repr (escapes visible), cut to `limit` characters."""
    r = repr(value)
    return r if len(r) <= limit else r[:limit] + f"...' ({len(value)} characters)"


# -- a batch script's checks at start: a queued job runs long after the launch, on files others may have touched --
def refuse_unless(condition: str, message: str) -> str:
    """One bash line: `condition`, else `message` (one line on stderr) and exit 2, before anything is run."""
    return f"{condition} || {{ echo {shell_word(message)} >&2; exit 2; }}"


def sha256_check(path, expected: str, message: str) -> str:
    """`path`'s sha256 is `expected` (a shell expression: a variable the script set from the launch's record)."""
    return refuse_unless(f"[ \"$(sha256sum < {shell_word(path)} 2>/dev/null | cut -d ' ' -f 1)\" = {expected} ]",
                         message)


def owned_check(path, message: str, kind: str = "-f") -> str:
    """`path` is the caller's own (the script's effective uid) and no link: a regular file (-f) or a directory
    (-d), as storage/owned.py's rule asks of what a job reads or writes in a shared area. One `[` (its -a joins
    the tests; `path` is absolute, never taken for an operator): the line's first command is the only one."""
    p = shell_word(path)
    return refuse_unless(f"[ {kind} {p} -a ! -L {p} -a -O {p} ]", message)
