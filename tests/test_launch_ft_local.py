"""`llmcluster launch --scheduler local` of an ft run (issue 37): the launch runs the same supervisor as
`train --procs-per-node` (the Lighthouse and one torchrun world per replica group, real processes over gloo), and
job.json keeps both the launch's record and every group's pids."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import REPO, cli_env, overrides

pytest.importorskip("torchft")

FT = ("ft.enabled=true", "parallel.dp_replicate=2", "ft.min_replicas=2", "ft.join_timeout_s=2",
      "ft.quorum_timeout_s=30", "dist.timeout_s=30", "log.eval_interval=1000", "train.threads=1", "train.steps=4",
      "checkpoint.interval_steps=4")


def _launch(root, run: str, *flags: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "llmcluster", "launch", "-c", "llm_tiny", "--root", str(root),
                           "--scheduler", "local", "--procs-per-node", "1", *flags,
                           *overrides(f"run.name={run}", *FT)], cwd=REPO, env=cli_env(), capture_output=True,
                          text=True, timeout=300)


def test_launch_dry_run_renders_the_supervisor_not_a_bare_torchrun(tiny_root):
    proc = _launch(tiny_root, "ft-launch-dry", "--dry-run")
    assert proc.returncode == 0, proc.stderr
    exec_line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("exec "))
    assert "torch.distributed.run" not in exec_line
    assert " -m llmcluster train --config " in exec_line and exec_line.endswith("--procs-per-node 1")


@pytest.mark.slow   # real processes: ~30 s on a loaded 2-core machine
def test_launch_local_runs_every_group_to_the_same_weights_and_records_them(tiny_root):
    run = "ft-launch"
    proc = _launch(tiny_root, run)
    assert proc.returncode == 0, proc.stderr[-3000:]
    job = json.loads((tiny_root / "logs" / run / "job.json").read_text())
    assert job["state"] == "COMPLETED" and job["exit_code"] == 0
    assert job["launch"] == 1 and job["artifact"].endswith("launch.sh")     # the launch's own record, kept
    groups = job["ft"]["groups"]
    assert [g["state"] for g in groups] == ["COMPLETED", "COMPLETED"] and all(g["pids"] for g in groups)
    # each group's rank logs its weights' digest at the end: one model, two replicas
    text = proc.stdout + proc.stderr + (tiny_root / "logs" / run / "ft" / "group1.log").read_text()
    digests = {line.rsplit(" ", 1)[1] for line in text.splitlines() if "weights sha256" in line}
    finished = [line for line in text.splitlines() if "weights sha256" in line]
    assert len(finished) == 2 and len(digests) == 1, finished
    assert (tiny_root / "checkpoints" / run / "step_4" / "COMPLETE.json").is_file()
    status = subprocess.run([sys.executable, "-m", "llmcluster", "jobs", "status", run, "--root", str(tiny_root)],
                            cwd=REPO, env=cli_env(), capture_output=True, text=True, timeout=60)
    assert status.returncode == 0 and "group0=COMPLETED" in status.stdout and "group1=COMPLETED" in status.stdout, \
        status.stdout + status.stderr
