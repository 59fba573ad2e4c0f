"""Records we read back from storage are data with a shape (issue 32): events.jsonl, a checkpoint's
COMPLETE.json, a run's job.json. Anyone who can write to the shared logs/ or checkpoints/ can write these files,
and a crash can cut a line, so each is checked on read against its shape (types, finite numbers, ranges):
a bad line of a JSON-lines file is skipped with ONE note per file naming it and its first bad line; a bad
single-object record is refused (or its bad field dropped) by its one reader. JSON we print never holds NaN or
Infinity (not JSON: `dumps` turns a non-finite number into null). No torch here: the head node reads these.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Callable
from pathlib import Path

# A field's check: (predicate, what it must be). None always passes for an optional field.
Check = tuple[Callable[[object], bool], str]


def integer(lo: int | None = None, hi: int | None = None) -> Check:
    def ok(v):
        return isinstance(v, int) and not isinstance(v, bool) and (lo is None or v >= lo) and (hi is None or v <= hi)
    rng = f" in {lo}..{hi}" if lo is not None and hi is not None else f" ≥ {lo}" if lo is not None else ""
    return ok, f"an integer{rng}"


def number(lo: float | None = None) -> Check:
    def ok(v):
        return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) \
            and (lo is None or v >= lo)
    return ok, "a finite number" + (f" ≥ {lo:g}" if lo is not None else "")


def of_type(*types: type, what: str) -> Check:
    # bool is an int to isinstance: a `true` passes only where bool is asked for
    return (lambda v: isinstance(v, types) and (bool in types or not isinstance(v, bool))), what


TEXT = of_type(str, what="a string")
BOOL = of_type(bool, what="true or false")
OBJECT = of_type(dict, what="an object")
LIST = of_type(list, what="a list")


def problem(rec: object, required: dict[str, Check], optional: dict[str, Check] | None = None) -> str | None:
    """What is wrong with `rec` against its shape (the first thing), or None. Other keys pass unchecked."""
    if not isinstance(rec, dict):
        return f"not a JSON object (a {type(rec).__name__})"
    for key, (ok, what) in required.items():
        if key not in rec:
            return f"no {key!r}"
        if not ok(rec[key]):
            return f"{key!r} is not {what} ({_short(rec[key])})"
    for key, (ok, what) in (optional or {}).items():
        if rec.get(key) is not None and not ok(rec[key]):
            return f"{key!r} is not {what} ({_short(rec[key])})"
    return None


def bad_fields(rec: dict, optional: dict[str, Check]) -> list[str]:
    """The optional fields of `rec` (present, not null) that are not of their shape."""
    return [k for k, (ok, _) in optional.items() if rec.get(k) is not None and not ok(rec[k])]


def _short(v: object) -> str:
    r = repr(v)
    return r if len(r) <= 40 else r[:37] + "..."


def _no_constant(name: str):
    raise ValueError(f"{name} is not JSON")


def loads(text: str):
    """json.loads that refuses the NaN / Infinity / -Infinity literals Python's json would accept."""
    return json.loads(text, parse_constant=_no_constant)


def note(text: str) -> None:
    print(f"note: {text}", file=sys.stderr, flush=True)


def read_jsonl(path: Path, required: dict[str, Check], optional: dict[str, Check] | None = None,
               warn: Callable[[str], None] | None = note) -> list[dict]:
    """The records of a JSON-lines file that have their shape, in file order. The others (a line cut by a
    crash, a hand edit, a hostile write) are skipped, with one note through `warn` for the whole file naming
    the first bad line and why. An unreadable file has no records."""
    out, bad = [], []
    try:
        text = Path(path).read_text(errors="replace")
    except OSError:
        return out
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = loads(line)
        except ValueError as e:   # json.JSONDecodeError, a NaN/Infinity literal, a number too deep
            why = "not JSON" if isinstance(e, json.JSONDecodeError) else str(e)
        except RecursionError:
            why = "nested too deep"
        else:
            why = problem(rec, required, optional)
            if why is None:
                out.append(rec)
                continue
        bad.append((n, why))
    if bad and warn:
        n, why = bad[0]
        more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
        warn(f"{path}: skipped malformed line {n}: {why}{more}")
    return out


def json_safe(obj):
    """`obj` with every non-finite float replaced by None (null), recursively through dicts, lists, tuples."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    return obj


def dumps(obj, **kw) -> str:
    """JSON for output: never NaN or Infinity (a non-finite number is null)."""
    return json.dumps(json_safe(obj), allow_nan=False, **kw)
