"""Preemption: SIGTERM / SIGUSR2 mid-run -> every rank agrees at the step boundary, checkpoints within the
grace period (or keeps the previous checkpoint) and exits 75 (requeue); starting again finishes the run with
weights bitwise equal to an uninterrupted run's.

The single-process case runs the real CLI entry point in this process (a real signal sent to this process
by a watcher thread) to skip a 20 s torch import per run; the torchrun case runs real worker processes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading

import pytest

from faultkit import (REPO, assert_same_weights, make_dataset, sets, torchrun_cmd, train_env, wait_for)
from llmcluster.cli import main
from llmcluster.errors import EXIT_PREEMPTED
from llmcluster.checkpoint.checkpointer import verify_checkpoint


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return make_dataset(tmp_path_factory.mktemp("preempt") / "storage")


def logged_step(metrics) -> int:
    try:
        lines = metrics.read_text().splitlines()
        return json.loads(lines[-1])["step"] if lines else 0
    except (OSError, ValueError):
        return 0


def signal_self_after(metrics, step: int, sig: int) -> threading.Thread:
    """Send `sig` to this process once the run has logged `step` (or later)."""
    start = len(metrics.read_text().splitlines()) if metrics.exists() else 0

    def watch():
        def past():
            lines = metrics.read_text().splitlines() if metrics.exists() else []
            return len(lines) > start and json.loads(lines[-1])["step"] >= step
        if wait_for(past, 120):
            os.kill(os.getpid(), sig)
    t = threading.Thread(target=watch, daemon=True)
    t.start()
    return t


def test_signals_checkpoint_and_exit_75_then_resume_is_bitwise_identical(capsys, root):
    common = ["train", "-c", "llm_tiny", "--root", str(root)]
    over = dict(train__steps=120, checkpoint__interval_steps=10, checkpoint__keep_last=5)
    assert main([*common, *sets(**over, run__name="ref")]) == 0
    capsys.readouterr()
    ckpt = root / "checkpoints" / "pre"
    metrics = root / "logs" / "pre" / "metrics.jsonl"

    # 1. SIGUSR2 with a grace period no checkpoint can meet: the partial save is discarded, the previous
    #    checkpoint stays the newest, and the exit code still asks for a requeue.
    t = signal_self_after(metrics, 15, signal.SIGUSR2)
    code = main([*common, *sets(**over, run__name="pre", checkpoint__grace_period_s=1e-6)])
    t.join()
    out = capsys.readouterr().out
    assert code == EXIT_PREEMPTED, out
    stopped = int(out.split("preempted at step ")[1].split(":")[0])
    assert "no checkpoint within checkpoint.grace_period_s=1e-06" in out
    assert "did not finish within checkpoint.grace_period_s: discarded" in out
    if stopped % 10:
        assert not (ckpt / f"step_{stopped}").exists() and not list(ckpt.glob(".tmp-*"))
    newest = max(int(d.name[5:]) for d in ckpt.glob("step_*"))
    assert newest == stopped // 10 * 10 and verify_checkpoint(ckpt / f"step_{newest}") is None

    # 2. SIGTERM later on: the checkpoint of the stop step is written, exit 75.
    t = signal_self_after(metrics, newest + 20, signal.SIGTERM)
    code = main([*common, *sets(**over, run__name="pre")])
    t.join()
    out = capsys.readouterr().out
    assert code == EXIT_PREEMPTED, out
    assert f"resumed from {ckpt / f'step_{newest}'}" in out
    stopped = int(out.split("preempted at step ")[1].split(":")[0])
    assert f"preempted at step {stopped}: checkpoint written, exiting 75 (requeue)" in out
    assert verify_checkpoint(ckpt / f"step_{stopped}") is None

    # 3. Requeued: it finishes; weights bitwise equal to the uninterrupted run's.
    assert main([*common, *sets(**over, run__name="pre")]) == 0
    assert f"resumed from {ckpt / f'step_{stopped}'}" in capsys.readouterr().out
    assert_same_weights(root / "checkpoints" / "ref" / "step_120", ckpt / "step_120")
    # 4. A restart of a finished run exits 0 at once.
    assert main([*common, *sets(**over, run__name="pre")]) == 0
    assert "already at step 120 of 120; nothing to do" in capsys.readouterr().out


def test_sigterm_to_torchrun_checkpoints_on_every_rank_and_exits_75(root):
    metrics = root / "logs" / "tr" / "metrics.jsonl"
    cmd = torchrun_cmd(2, "train", "-c", "llm_tiny", "--root", root,
                       *sets(run__name="tr", train__steps=2000, checkpoint__interval_steps=1000))
    proc = subprocess.Popen(cmd, cwd=REPO, env=train_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        assert wait_for(lambda: logged_step(metrics) >= 10, 120, proc), proc.communicate()[0]
        proc.send_signal(signal.SIGTERM)   # what Slurm / Kubernetes send; torchrun forwards it to the ranks
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    # torchrun reports its own code for a worker's 75; the workers' checkpoint and log line are the contract
    assert proc.returncode != 0
    line = next(ln for ln in out.splitlines() if "preempted at step" in ln)
    step = int(line.split("preempted at step ")[1].split(":")[0])
    assert f"checkpoint written, exiting {EXIT_PREEMPTED} (requeue)" in line
    step_dir = root / "checkpoints" / "tr" / f"step_{step}"
    assert verify_checkpoint(step_dir) is None
    assert len(list(step_dir.glob("rng/rank_*.json"))) == 2
