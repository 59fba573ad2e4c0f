"""A run's evaluations, logs/<run>/eval.jsonl: one line per evaluation, appended by `llmcluster eval`, read by
`eval --compare` and by the trainer's downstream evaluations (which steps have results). One writer and one reader,
here in storage beside the run's other records (docs/architecture.md). logs/ is shared: every line is checked for
shape on read.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

EVAL_LOG = "eval.jsonl"


def append(logs: Path, record: dict) -> None:
    with open(logs / EVAL_LOG, "a") as f:
        f.write(json.dumps(record, allow_nan=False) + "\n")


def steps(logs: Path) -> set[int]:
    """The steps with a result line (a pending downstream evaluation is done when its step is here)."""
    return {r["step"] for r in read(logs, quiet=True) if isinstance(r.get("step"), int)}


def _finite(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _scores(d) -> bool:
    return isinstance(d, dict) and all(isinstance(k, str) and _finite(v) for k, v in d.items())


def _why_bad(rec) -> str | None:
    """What makes a line of eval.jsonl not an evaluation record we can show (None: it is one)."""
    if not isinstance(rec, dict):
        return "not an object"
    for key, ok in (("run", lambda v: isinstance(v, str)),
                    ("step", lambda v: v is None or (isinstance(v, int) and not isinstance(v, bool) and v >= 0)),
                    ("tokens", lambda v: v is None or (isinstance(v, int) and not isinstance(v, bool) and v >= 0)),
                    ("endpoint", lambda v: v is None or isinstance(v, str)),
                    ("backend", lambda v: v is None or isinstance(v, str)),
                    ("tasks", lambda v: isinstance(v, dict))):
        if key not in rec and key in ("run", "tasks"):
            return f"no {key!r}"
        if not ok(rec.get(key)):
            return f"{key!r} has the wrong type"
    for task, t in rec["tasks"].items():
        if not isinstance(t, dict) or not _scores(t.get("metrics", {})) or not _scores(t.get("stderr", {})):
            return f"task {str(task)[:60]!r}: scores that are not finite numbers"
    return None


def _not_json(constant: str):
    raise ValueError(f"{constant} is not JSON")


def read(logs: Path, quiet: bool = False) -> list[dict]:
    """The records of logs/<run>/eval.jsonl; a line that is not one (not JSON, NaN or Infinity, a wrong type, a
    missing key) is skipped with one note naming the file and line (none when `quiet`: the trainer reads it at
    every checkpoint)."""
    path = logs / EVAL_LOG
    if not path.is_file():
        return []
    out = []
    for i, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        try:   # NaN/Infinity literals are not JSON; 1e400 parses to inf and is caught by _why_bad
            rec = json.loads(line, parse_constant=_not_json)
            why = _why_bad(rec)
        except (ValueError, RecursionError):
            why = "not a JSON line"
        if why:
            if not quiet:
                print(f"note: {path}:{i}: skipped ({why})", file=sys.stderr)
            continue
        rec.setdefault("step", None)
        out.append(rec)
    return out
