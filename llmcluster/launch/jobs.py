"""`llmcluster jobs list|status|logs|cancel`: the launched runs, from their job.json records.

JOB is a run name (logs/<run>/job.json says which scheduler and which job id it has there). The record's
run name is always the directory's, whatever the file says.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from llmcluster.console import terminal_text
from llmcluster.errors import EXIT_DISK_FULL, UserError
from llmcluster.storage.job_record import read_record
from llmcluster.launch.scheduler import ACTIVE_STATES, get
from llmcluster.storage.layout import Storage


def _record(root: Path, run: str) -> tuple[Path, dict]:
    logs = Storage(root).run_logs(run)
    rec = read_record(logs, own=True, refuse=True)   # what status, logs and cancel act on: the caller's own only
    if rec is None:
        raise UserError(f"no launched job named {run!r} under {root / 'logs'} (see `llmcluster jobs list`)")
    return logs, {**rec, "run": run}


def state(logs: Path, rec: dict) -> dict:
    return get(rec.get("scheduler", "?")).state(logs, rec)


def list_jobs(root: Path, query: bool = True) -> int:
    from rich.table import Table

    from llmcluster.console import cell, console

    logs = root / "logs"
    runs = sorted(p for p in logs.iterdir() if (p / "job.json").is_file()) if logs.is_dir() else []
    table = Table(box=None, header_style="bold")
    for col in ("RUN", "SCHEDULER", "JOB ID", "NODES", "WORLD", "STATE", "SUBMITTED"):
        table.add_column(col)
    for p in runs:
        rec = {**(read_record(p) or {}), "run": p.name}
        try:
            st = state(p, rec)["state"] if query else rec.get("state", "")
        except UserError:
            st = "?"
        table.add_row(*map(cell, (p.name, rec.get("scheduler", "?"), rec.get("job_id") or "-", rec.get("nodes"),
                                  rec.get("world_size"), st, rec.get("submitted_at", ""))))
    console().print(table) if runs else print(f"no launched jobs under {logs}")
    return 0


def ft_groups(ft: dict) -> dict:
    """group<i>=STATE(pids …, restarts r[, dropped d]) from a supervisor's record (job.json is user-writable: shapes
    checked)."""
    out = {}
    for g in ft.get("groups") if isinstance(ft.get("groups"), list) else []:
        if isinstance(g, dict) and isinstance(g.get("group"), int):
            pids = [p for p in g.get("pids") or [] if isinstance(p, int)] if isinstance(g.get("pids"), list) else []
            dropped = g.get("dropped")   # times it left the quorum as a straggler (ft.straggler_steps)
            out[f"group{g['group']}"] = (f"{g.get('state') if isinstance(g.get('state'), str) else '?'}"
                                         f"(pids {','.join(map(str, pids)) or '-'}, restarts {g.get('restarts')}"
                                         + (f", dropped {dropped}" if isinstance(dropped, int) and dropped else "") + ")")
    return out


def status(root: Path, run: str, as_json: bool = False) -> int:
    import json

    logs, rec = _record(root, run)
    info = {"run": run, "scheduler": rec["scheduler"], "job_id": rec.get("job_id"), **state(logs, rec)}
    if isinstance(rec.get("ft"), dict):   # ft: each replica group's state and processes, as its supervisor saw them
        info.update(ft_groups(rec["ft"]))
    # a full disk is not retried: say why it stopped (its code: 74, or Slurm's "74:0")
    if str(info.get("exit_code")).split(":")[0] == str(EXIT_DISK_FULL) and not info.get("detail"):
        info["detail"] = "disk full: free space, then run it again (it resumes from its last checkpoint)"
    if as_json:
        print(json.dumps(info))
    else:
        print("  ".join(f"{k}={terminal_text(v)}" for k, v in info.items() if v is not None))
    return 0


def logs(root: Path, run: str, follow: bool = False) -> int:
    logdir, rec = _record(root, run)
    sched = get(rec["scheduler"])
    printed = sched.logs(logdir, rec, follow)
    if printed is not None:
        return printed
    files = sched.log_files(logdir, rec)
    existing = [f for f in files if f.is_file()]
    if not existing and not follow:
        raise UserError(f"no log yet for {run} (expected {files[0] if files else logdir})")
    offsets = {f: 0 for f in files}
    while True:
        for f in files:
            if f.is_file():
                with f.open("rb") as fh:
                    fh.seek(offsets[f])
                    chunk = fh.read()
                offsets[f] += len(chunk)
                sys.stdout.write(chunk.decode(errors="replace"))
        sys.stdout.flush()
        if not follow or state(logdir, rec)["state"] not in ACTIVE_STATES:
            # one last read after the job ended, so -f never drops the tail
            if follow:
                follow = False
                continue
            return 0
        time.sleep(1.0)
        files = sched.log_files(logdir, rec)      # torchrun adds attempt directories as it restarts
        offsets.update({f: 0 for f in files if f not in offsets})


def cancel(root: Path, run: str) -> int:
    logdir, rec = _record(root, run)
    still = get(rec["scheduler"]).cancel(logdir, rec)    # a line when the job is still stopping
    print(terminal_text(still or f"cancelled {run} ({rec['scheduler']} job {rec.get('job_id')})"))
    return 0
