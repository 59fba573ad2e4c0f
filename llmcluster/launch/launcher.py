"""`llmcluster launch`: render the spec for its scheduler, print it (--dry-run) or submit it, and record it.

Every launch gets its own directory, logs/<run>/launches/<n>/, holding the rendered artifact (launch.sh /
job.sbatch / job.yaml, 0400) and the resolved config the ranks read (0440), both read-only: a later launch
never changes what an already queued (or requeued) job reads. logs/<run>/job.json records the latest launch;
`llmcluster jobs` works from it. Run directories are 0750 and files 0640: a shared cluster's other users
do not read a run's config, logs or checkpoints.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from llmcluster import records
from llmcluster.errors import UserError
from llmcluster.launch.scheduler import ACTIVE_STATES, get
from llmcluster.launch.spec import LaunchSpec

RECORD = "job.json"
UMASK = 0o027


def write_record(logs: Path, record: dict) -> None:
    tmp = logs / f".{RECORD}.tmp"
    tmp.write_text(json.dumps(record, indent=2) + "\n")
    os.replace(tmp, logs / RECORD)        # readers never see half a record


# job.json's shape (records.py). logs/ is shared and the record user-writable: a record without its run and
# scheduler is no record; a known field of the wrong type is dropped (read as absent) with one note, so that
# `jobs status|cancel` never trips over it (a pid that is a string, a port that is a list).
RECORD_REQUIRED = {"run": records.TEXT, "scheduler": records.TEXT}
RECORD_OPTIONAL = {"job_id": records.of_type(str, int, what="a string or an integer"), "launch": records.integer(1),
                   "nodes": records.integer(1), "procs_per_node": records.integer(1),
                   "world_size": records.integer(1), "pid": records.integer(2), "port": records.integer(1, 65535),
                   "exit_code": records.integer(), "state": records.TEXT, "kind": records.TEXT,
                   "artifact": records.TEXT, "submitted_at": records.TEXT, "code_version": records.TEXT,
                   "cluster": records.TEXT, "endpoint": records.TEXT, "previous_job_ids": records.LIST,
                   "k8s": records.OBJECT, "slo_ttft_p99_ms": records.number(0)}


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


def refuse_if_active(spec: LaunchSpec, old: dict | None) -> None:
    """A second launch of a run whose job is still queued or running would race it for the same
    checkpoints: refused (`--force` launches anyway)."""
    if not old or not old.get("job_id"):
        return
    try:
        st = get(old["scheduler"]).state(spec.logs, {**old, "run": spec.run})["state"]
    except UserError:
        return              # the old job's scheduler can't be asked (e.g. no credentials): not active here
    if st in ACTIVE_STATES:
        raise UserError(f"run {spec.run} is already {st} as {old['scheduler']} job {old['job_id']}: "
                        "`llmcluster jobs cancel` it first, or pass --force to launch a second one")


def code_version() -> str | None:
    """`git describe --always --dirty` of the checkout this package runs from, or None (an installed
    wheel, no git): what the launch record and each run's run.json name as the code that ran."""
    src = Path(__file__).resolve().parents[2]
    try:
        p = subprocess.run(["git", "-C", str(src), "describe", "--always", "--dirty", "--tags"],
                           capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return (p.stdout.strip() or None) if p.returncode == 0 else None


def _write_once(path: Path, text: str, mode: int) -> None:
    with open(path, "x") as f:            # "x": a launch directory is never written twice
        f.write(text)
    path.chmod(mode)


def launch(spec: LaunchSpec, *, dry_run: bool, apply: bool = False, force: bool = False) -> int:
    sched = get(spec.scheduler)
    text = sched.render(spec)
    if dry_run:
        sys.stdout.write(text)            # exactly what would be submitted, and only that
        return 0
    logs = spec.logs
    old = read_record(logs)
    if not force:
        refuse_if_active(spec, old)
    os.umask(UMASK)                       # this process and what it starts: 0750 directories, 0640 files
    try:
        spec.launch_dir.mkdir(parents=True)
    except FileExistsError:
        raise UserError(f"{spec.launch_dir} exists: another launch of {spec.run} is starting; try again") from None
    except OSError as e:
        raise UserError(f"cannot create {spec.launch_dir}: {e.strerror or e}") from None
    artifact = spec.launch_dir / sched.artifact
    _write_once(artifact, text, 0o400)            # the submitter's own: no one else has a reason to read it
    _write_once(spec.config_path, spec.config_yaml, 0o440)
    record = {"run": spec.run, "scheduler": spec.scheduler, "launch": spec.launch_id, "artifact": str(artifact),
              "submitted_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "nodes": spec.job.nodes,
              "procs_per_node": spec.job.procs, "world_size": spec.job.world_size,
              "code_version": code_version(), "cluster": spec.cluster}
    if old and old.get("job_id"):
        record["previous_job_ids"] = old.get("previous_job_ids", []) + [old["job_id"]]
    return sched.submit(spec, artifact, record, lambda r: write_record(logs, r), apply=apply)
