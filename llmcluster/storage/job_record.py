"""A job's record, logs/<name>/job.json: written by the launcher and `serve start`, read by `jobs`, monitor, tracking
and storage status. One reader and one writer, here in storage (docs/architecture.md): reading a record never means
importing the launcher. logs/ is shared, so the reader checks the record's shape (storage/records.py), and every
file here is opened as the caller's own (storage/owned.py: no link followed, O_EXCL for what is created).
"""

from __future__ import annotations

import json
from pathlib import Path

from llmcluster.errors import UserError
from llmcluster.storage import records
from llmcluster.storage.owned import check_own_dir, create_exclusive, read_text, replace_atomically

RECORD = "job.json"


def write_record(logs: Path, record: dict) -> None:
    """logs/<run>/job.json, in a folder of the caller's, replaced atomically (readers never see half a record)
    through a temp file created with O_EXCL: a planted `.job.json.tmp` or link redirects nothing."""
    check_own_dir(logs, "run folder")
    try:
        replace_atomically(logs / RECORD, json.dumps(record, indent=2) + "\n")
    except OSError as e:
        raise UserError(f"cannot write {logs / RECORD}: {e.strerror or e}") from None


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
                   "k8s": records.OBJECT, "ft": records.OBJECT, "slo_ttft_p99_ms": records.number(0),
                   "config_sha256": records.TEXT, "lineage_sha256": records.TEXT, "lineage_verified": records.BOOL}


def read_record(logs: Path, own: bool = False, refuse: bool = False) -> dict | None:
    """logs/<run>/job.json if it is a record of ours (see RECORD_REQUIRED), its ill-typed fields left out. A link
    is never followed; `own`: only the caller's own file (what a command acts on: the pid it signals, the job it
    cancels), else any reader's view (`jobs list`, `storage status`, monitor). `refuse`: a file that is there but
    cannot be used (a link, someone else's) is one line (UserError), not a note."""
    path = logs / RECORD
    text, why = read_text(path, own)
    if text is None:
        if why and refuse:
            raise UserError(f"{path} {why}: not acted on")
        if why:
            records.note(f"{path} {why}: ignored")
        return None
    try:
        rec = records.loads(text)
    except (ValueError, RecursionError):
        records.note(f"{path}: ignored: not JSON")
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
    """A launch file (launches/<n>/...): created with O_EXCL and no link followed (a launch directory is never
    written twice), `mode` set on the open file."""
    try:
        create_exclusive(path, text, mode)
    except OSError as e:
        raise UserError(f"cannot create {path}: {e.strerror or e}") from None


def make_launch_dir(path: Path, what: str) -> None:
    """logs/<name>/launches/<n>/, made once: of two launches that raced for the same number, the second is told.
    logs/<name>/ and launches/ must be the caller's (checked before, and again after: one made in between by
    someone else is refused too)."""
    run_dir = path.parent.parent
    for d in (run_dir, path.parent):
        check_own_dir(d, "run folder")
    try:
        path.mkdir(parents=True)
    except FileExistsError:
        raise UserError(f"{path} exists: another {what} is under way; try again") from None
    except OSError as e:
        raise UserError(f"cannot create {path}: {e.strerror or e}") from None
    for d in (run_dir, path.parent, path):
        check_own_dir(d, "run folder")
