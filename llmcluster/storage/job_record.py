"""A job's record, logs/<name>/job.json: written by the launcher and `serve start`, read by `jobs`, monitor, tracking
and storage status. One reader and one writer, here in storage (docs/architecture.md): reading a record never means
importing the launcher. logs/ is shared, so the reader checks the record's shape (storage/records.py).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from llmcluster.errors import UserError
from llmcluster.storage import records

RECORD = "job.json"


def write_record(logs: Path, record: dict) -> None:
    tmp = logs / f".{RECORD}.tmp"
    tmp.write_text(json.dumps(record, indent=2) + "\n")
    os.replace(tmp, logs / RECORD)        # readers never see half a record


# job.json's shape (storage/records.py). logs/ is shared and the record user-writable: a record without its run and
# scheduler is no record; a known field of the wrong type is dropped (read as absent) with one note, so that
# `jobs status|cancel` never trips over it (a pid that is a string, a port that is a list).
RECORD_REQUIRED = {"run": records.TEXT, "scheduler": records.TEXT}
RECORD_OPTIONAL = {"job_id": records.of_type(str, int, what="a string or an integer"), "launch": records.integer(1),
                   "nodes": records.integer(1), "procs_per_node": records.integer(1),
                   "world_size": records.integer(1), "pid": records.integer(2), "port": records.integer(1, 65535),
                   "exit_code": records.integer(), "state": records.TEXT, "kind": records.TEXT,
                   "artifact": records.TEXT, "submitted_at": records.TEXT, "code_version": records.TEXT,
                   "cluster": records.TEXT, "endpoint": records.TEXT, "previous_job_ids": records.LIST,
                   "k8s": records.OBJECT, "ft": records.OBJECT, "slo_ttft_p99_ms": records.number(0)}


def read_record(logs: Path) -> dict | None:
    """logs/<run>/job.json if it is a record of ours (see RECORD_REQUIRED), its ill-typed fields left out."""
    path = logs / RECORD
    try:
        rec = records.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError, RecursionError) as e:
        records.note(f"{path}: ignored: {e.strerror if isinstance(e, OSError) else 'not JSON'}")
        return None
    why = records.problem(rec, RECORD_REQUIRED)
    if why:
        records.note(f"{path}: ignored: {why}")
        return None
    bad = records.bad_fields(rec, RECORD_OPTIONAL)
    if bad:
        records.note(f"{path}: ignored field(s) {', '.join(bad)}: not of their type")
    return {k: v for k, v in rec.items() if k not in bad}


def write_once(path: Path, text: str, mode: int) -> None:
    with open(path, "x") as f:            # "x": a launch directory is never written twice
        f.write(text)
    path.chmod(mode)


def make_launch_dir(path: Path, what: str) -> None:
    """logs/<name>/launches/<n>/, made once: of two launches that raced for the same number, the second is told."""
    try:
        path.mkdir(parents=True)
    except FileExistsError:
        raise UserError(f"{path} exists: another {what} is under way; try again") from None
    except OSError as e:
        raise UserError(f"cannot create {path}: {e.strerror or e}") from None
