"""`llmcluster launch`: render the spec for its scheduler, print it (--dry-run) or submit it, and record it.

Every launch gets its own directory, logs/<run>/launches/<n>/, holding the rendered artifact (launch.sh /
job.sbatch / job.yaml, 0400) and the resolved config the ranks read (0440), both read-only: a later launch
never changes what an already queued (or requeued) job reads. logs/<run>/job.json records the latest launch;
`llmcluster jobs` works from it. Run directories are 0750 and files 0640: a shared cluster's other users
do not read a run's config, logs or checkpoints.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from llmcluster.errors import UserError
from llmcluster.launch.scheduler import ACTIVE_STATES, get
from llmcluster.launch.spec import LaunchSpec
from llmcluster.storage.job_record import make_launch_dir, read_record, write_once, write_record
from llmcluster.storage.owned import check_own_dir

UMASK = 0o027


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


def launch(spec: LaunchSpec, *, dry_run: bool, apply: bool = False, force: bool = False) -> int:
    sched = get(spec.scheduler)
    text = sched.render(spec)
    if dry_run:
        sys.stdout.write(text)            # exactly what would be submitted, and only that
        return 0
    logs = spec.logs
    for d in (logs, spec.root / "checkpoints" / spec.run):   # the caller's own, or refused before anything is written
        check_own_dir(d, "run folder")
    old = read_record(logs, own=True)
    if not force:
        refuse_if_active(spec, old)
    os.umask(UMASK)                       # this process and what it starts: 0750 directories, 0640 files
    made = [d for d in (spec.launch_dir.parent.parent, spec.launch_dir.parent) if not d.exists()]
    make_launch_dir(spec.launch_dir, f"launch of {spec.run}")
    written: list[dict] = []
    try:
        return _submit(spec, sched, text, old, lambda r: (written.append(r), write_record(logs, r)), apply)
    except BaseException:
        if not written:   # refused before anything was submitted (no sbatch, a missing secret): leave nothing
            _remove_launch_dir(spec.launch_dir, made)
        raise


def _remove_launch_dir(launch_dir: Path, made: list[Path]) -> None:
    import shutil

    shutil.rmtree(launch_dir, ignore_errors=True)
    for d in reversed(made):              # logs/<run>/launches, then logs/<run>, when this launch made them
        try:
            d.rmdir()
        except OSError:
            pass                          # not empty: something else lives there


def _submit(spec: LaunchSpec, sched, text: str, old: dict | None, write_record, apply: bool) -> int:
    artifact = spec.launch_dir / sched.artifact
    write_once(artifact, text, 0o400)            # the submitter's own: no one else has a reason to read it
    write_once(spec.config_path, spec.config_yaml, 0o440)
    record = {"run": spec.run, "scheduler": spec.scheduler, "launch": spec.launch_id, "artifact": str(artifact),
              "submitted_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "nodes": spec.job.nodes,
              "procs_per_node": spec.job.procs, "world_size": spec.job.world_size,
              "code_version": code_version(), "cluster": spec.cluster, "config_sha256": spec.config_sha256}
    if old and old.get("job_id"):
        record["previous_job_ids"] = old.get("previous_job_ids", []) + [old["job_id"]]
    return sched.submit(spec, artifact, record, write_record, apply=apply)
