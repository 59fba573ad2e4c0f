"""`llmcluster jobs list|status|logs|cancel`: the launched runs, from their job.json records.

JOB is a run name (logs/<run>/job.json says which scheduler and which job id it has there).
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

from llmcluster.errors import UserError
from llmcluster.launch.launcher import read_record
from llmcluster.storage.layout import Storage


def _record(root: Path, run: str) -> tuple[Path, dict]:
    logs = Storage(root).run_logs(run)
    rec = read_record(logs)
    if rec is None:
        raise UserError(f"no launched job named {run!r} under {root / 'logs'} (see `llmcluster jobs list`)")
    return logs, rec


def _local_state(rec: dict) -> dict:
    if rec.get("state") == "RUNNING":
        try:
            os.kill(int(rec["pid"]), 0)
        except (ProcessLookupError, KeyError, ValueError):
            return {"state": "LOST", "detail": "the launcher is gone without recording an exit code"}
        except PermissionError:
            pass
        return {"state": "RUNNING"}
    return {"state": rec.get("state", "UNKNOWN"), "exit_code": rec.get("exit_code")}


def state(rec: dict) -> dict:
    sched = rec["scheduler"]
    if sched == "local":
        return _local_state(rec)
    if sched == "slurm":
        from llmcluster.launch import slurm
        return slurm.state(rec["job_id"])
    if not rec.get("job_id"):
        return {"state": "RENDERED"}
    from llmcluster.launch import k8s
    return k8s.state(rec)


def list_jobs(root: Path, query: bool = True) -> int:
    from rich.console import Console
    from rich.table import Table

    logs = root / "logs"
    runs = sorted(p for p in logs.iterdir() if (p / "job.json").is_file()) if logs.is_dir() else []
    table = Table(box=None, header_style="bold")
    for col in ("RUN", "SCHEDULER", "JOB ID", "NODES", "WORLD", "STATE", "SUBMITTED"):
        table.add_column(col)
    for p in runs:
        rec = read_record(p) or {}
        try:
            st = state(rec)["state"] if query else rec.get("state", "")
        except UserError:
            st = "?"
        table.add_row(p.name, rec.get("scheduler", "?"), str(rec.get("job_id") or "-"), str(rec.get("nodes")),
                      str(rec.get("world_size")), st, rec.get("submitted_at", ""))
    Console(width=200).print(table) if runs else print(f"no launched jobs under {logs}")
    return 0


def status(root: Path, run: str, as_json: bool = False) -> int:
    import json

    _, rec = _record(root, run)
    info = {"run": run, "scheduler": rec["scheduler"], "job_id": rec.get("job_id"), **state(rec)}
    if as_json:
        print(json.dumps(info))
    else:
        print("  ".join(f"{k}={v}" for k, v in info.items() if v is not None))
    return 0


def log_files(logs: Path, rec: dict) -> list[Path]:
    if rec["scheduler"] == "slurm":
        return [logs / f"slurm-{rec['job_id']}.out"]
    if rec["scheduler"] == "local":
        # torchrun --log-dir: ranks/<id>/attempt_<n>/<local rank>/{stdout,stderr}.log
        return sorted((logs / "ranks").glob("*/attempt_*/*/std*.log"))
    return []


def logs(root: Path, run: str, follow: bool = False) -> int:
    logdir, rec = _record(root, run)
    if rec["scheduler"] == "k8s":
        from llmcluster.launch import k8s
        return k8s.logs(rec, follow)
    files = log_files(logdir, rec)
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
        if not follow or state(rec)["state"] not in ("PENDING", "RUNNING", "CONFIGURING", "REQUEUED",
                                                     "COMPLETING", "SUSPENDED"):
            # one last read after the job ended, so -f never drops the tail
            if follow:
                follow = False
                continue
            return 0
        time.sleep(1.0)
        if rec["scheduler"] == "local":
            files = log_files(logdir, rec)
            offsets.update({f: 0 for f in files if f not in offsets})


def cancel(root: Path, run: str) -> int:
    logdir, rec = _record(root, run)
    sched = rec["scheduler"]
    if sched == "slurm":
        from llmcluster.launch import slurm
        slurm.cancel(rec["job_id"])
    elif sched == "local":
        if _local_state(rec)["state"] != "RUNNING":
            raise UserError(f"{run} is not running")
        os.killpg(int(rec["pid"]), signal.SIGTERM)  # torchrun forwards it; the ranks checkpoint and stop
    else:
        from llmcluster.launch import k8s
        k8s.cancel(rec)
    print(f"cancelled {run} ({sched} job {rec.get('job_id')})")
    return 0
