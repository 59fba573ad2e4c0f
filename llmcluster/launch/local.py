"""local: `torchrun --standalone` on this machine (the embedded default), per-rank logs under logs/<run>/ranks.

The launch runs in the foreground: its exit code is the job's, and `jobs status` reads it from job.json.
"""

from __future__ import annotations

import os
import subprocess

from llmcluster.launch.spec import LaunchSpec, sh_join


def argv(spec: LaunchSpec) -> list[str]:
    # --standalone: a c10d store on a free local port, so --max-restarts would work too (static can't)
    return spec.torchrun(spec.python, ["--standalone"], str(spec.logs / "ranks"))


def env(spec: LaunchSpec) -> dict[str, str]:
    extra = {**spec.job.environment(), "LLMCLUSTER_STORAGE": str(spec.root)}
    if spec.job.gpus_per_node == 0:
        extra.setdefault("OMP_NUM_THREADS", os.environ.get("OMP_NUM_THREADS", "1"))
    return extra


def render(spec: LaunchSpec) -> str:
    """The command as a shell script (what --dry-run prints and launch.sh holds)."""
    lines = ["#!/bin/bash", f"# llmcluster launch: run {spec.run} on this machine, {spec.job.procs} process(es)",
             "set -euo pipefail"]
    lines += [f"export {k}={sh_join([v])}" for k, v in env(spec).items()]
    lines.append("exec " + sh_join(argv(spec)))
    return "\n".join(lines) + "\n"


def run(spec: LaunchSpec, on_start) -> int:
    """Run to completion; `on_start(pid)` records the job before we block."""
    (spec.logs / "ranks").mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen(argv(spec), env={**os.environ, **env(spec)}, start_new_session=True)
    on_start(proc.pid)
    try:
        return proc.wait()
    except KeyboardInterrupt:
        # Ctrl-C: torchrun forwards SIGINT to the ranks; give them their checkpoint grace period
        proc.send_signal(2)
        return proc.wait()
