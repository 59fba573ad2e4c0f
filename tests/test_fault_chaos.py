"""Acceptance chaos test: real torchrun, 2 ranks, the tiny model in fp32. A seeded driver SIGKILLs a random
rank at random steps, several times during one run, once while a checkpoint is being written; torchrun
(--standalone --max-restarts) brings the group back, and the trainer resumes from the newest complete
checkpoint by itself. The run must finish with weights bitwise equal to an uninterrupted run's, and the
sample log must show every sample of the run used exactly once, in the uninterrupted run's order."""

from __future__ import annotations

import os
import random
import signal
import subprocess
from pathlib import Path

import pytest

from faultkit import REPO, assert_same_weights, make_dataset, run, sets, torchrun_cmd, train_env, wait_for
from llmcluster.train.health import read_sample_log

SEED = 5
STEPS = 40
GLOBAL_BATCH = 4   # micro_batch 2 × 2 ranks


def workers(torchrun_pid: int) -> dict[int, int]:
    """rank -> pid of torchrun's live worker processes (read from /proc: their parent and RANK)."""
    out = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            if ppid != torchrun_pid:
                continue
            env = dict(kv.split("=", 1) for kv in (d / "environ").read_text().split("\0") if "=" in kv)
            out[int(env["RANK"])] = int(d.name)
        except (OSError, ValueError, KeyError, IndexError):
            continue
    return out


def records_since(path: Path, offset: int) -> list[str]:
    try:
        with open(path) as f:
            f.seek(offset)
            return [ln for ln in f.read().splitlines() if ln.endswith("}")]
    except OSError:
        return []


def size(path: Path) -> int:
    return path.stat().st_size if path.exists() else 0


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return make_dataset(tmp_path_factory.mktemp("chaos") / "storage")


def test_chaos_random_sigkills_finish_bitwise_identical_without_repeating_a_sample(root):
    args = ["train", "-c", "llm_tiny", "--root", root]
    over = dict(train__steps=STEPS, checkpoint__interval_steps=4, checkpoint__keep_last=2, log__sample_log=True,
                # a survivor blocked on a killed peer fails within seconds instead of 10 minutes
                dist__timeout_s=20)
    ref = run(torchrun_cmd(2, *args, *sets(**over, run__name="ref")), timeout=180)
    assert ref.returncode == 0, ref.stdout[-3000:] + ref.stderr[-3000:]

    rng = random.Random(SEED)
    # (kind, steps of progress after the previous kill): "step" kills mid-training, "ckpt" kills while a
    # .tmp-step_N directory (a checkpoint being written) exists.
    plan = [("step", rng.randint(2, 8)), ("ckpt", rng.randint(1, 4)), ("step", rng.randint(2, 8))]
    log0 = root / "logs" / "chaos" / "samples-rank0.jsonl"
    ckpt = root / "checkpoints" / "chaos"
    proc = subprocess.Popen(torchrun_cmd(2, *args, *sets(**over, run__name="chaos"), max_restarts=len(plan) + 1),
                            cwd=REPO, env=train_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    killed = []
    out = ""
    try:
        previous: set[int] = set()
        for kind, progress in plan:
            # Count progress of the current worker group only: once the group that lost a rank is gone,
            # both ranks are new processes, and records appended after that are theirs.
            group = wait_for(lambda: (w := workers(proc.pid)) and len(w) == 2 and not set(w.values()) & previous
                             and w, 120, proc)
            assert group, "the group did not come back"
            offset = size(log0)
            assert wait_for(lambda: len(records_since(log0, offset)) >= progress, 120, proc), "no progress"
            if kind == "ckpt":
                before = {p.name for p in ckpt.glob(".tmp-step_*")}
                assert wait_for(lambda: {p.name for p in ckpt.glob(".tmp-step_*")} - before, 60, proc, poll=0.002)
            rank = rng.randrange(2)
            os.kill(group[rank], signal.SIGKILL)
            previous = set(group.values())
            killed.append((kind, rank, len(records_since(log0, 0))))
        out, _ = proc.communicate(timeout=150)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        if not out:
            out = proc.communicate()[0]
            print(killed, out[-8000:])
    assert proc.returncode == 0, out[-4000:]
    assert len(killed) == len(plan) and out.count("resumed from") >= len(plan), (killed, out[-4000:])

    assert_same_weights(root / "checkpoints" / "ref" / f"step_{STEPS}", ckpt / f"step_{STEPS}")

    # Every sample exactly once, in the same steps as the uninterrupted run (last record of each step).
    for rank in range(2):
        got = read_sample_log(root / "logs" / "chaos" / f"samples-rank{rank}.jsonl")
        want = read_sample_log(root / "logs" / "ref" / f"samples-rank{rank}.jsonl")
        assert sorted(got) == list(range(1, STEPS + 1))
        assert got == want
    ids = [i for r in range(2) for ids in read_sample_log(root / "logs" / "chaos" / f"samples-rank{r}.jsonl").values()
           for i in ids]
    assert sorted(ids) == list(range(STEPS * GLOBAL_BATCH))
