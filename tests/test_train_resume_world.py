"""A resume at another world size keeps the global batch (issue 34, item 2): real ranks (torchrun, gloo) train to
a checkpoint, one process resumes it by accumulating two micro-batches where two ranks took one each, and the
losses follow an uninterrupted two-rank run; a layout that cannot keep the batch is refused and writes nothing.
The rule itself (train/batch.py) is checked case by case without processes."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import assert_one_line_error, overrides, read_metrics, run_cli, torchrun
from llmcluster.config.schema import TrainConfig
from llmcluster.errors import UserError
from llmcluster.train.batch import resume_batch, saved_global_batch

STEPS = ["train.steps=12", "checkpoint.interval_steps=6", "train.micro_batch=4"]


def _ok(proc):
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def _snapshot(root: Path, run: str) -> dict[str, bytes]:
    """Every file of the run (checkpoints and logs) with its bytes, but events.jsonl: each start, a refused one
    too, is an attempt there, recorded for `jobs goodput` (which tells refused starts apart)."""
    out = {}
    for area in ("checkpoints", "logs"):
        for f in sorted((root / area / run).rglob("*")):
            if f.is_file() and f.name != "events.jsonl":
                out[str(f.relative_to(root))] = f.read_bytes()
    return out


@pytest.mark.slow
def test_two_ranks_resumed_by_one_process_keep_the_global_batch(tiny_root):
    root = tiny_root
    _ok(torchrun(2, "train", "--config", "llm_tiny", "--root", root, *overrides(*STEPS, "run.name=w2-ref")))
    _ok(torchrun(2, "train", "--config", "llm_tiny", "--root", root,
                 *overrides(*STEPS, "run.name=w2-to-w1", "train.stop_at=6")))
    before = _snapshot(root, "w2-to-w1")

    # micro_batch 3 cannot make the saved global batch 8 in one process: refused, nothing written.
    refused = run_cli("train", "--config", "llm_tiny", "--root", root,
                      *overrides(*STEPS, "run.name=w2-to-w1", "train.micro_batch=3"))
    assert_one_line_error(refused, "at world 1 from world 2", "global batch 8 -> 3", "train.allow_batch_change=true")
    assert _snapshot(root, "w2-to-w1") == before

    resumed = _ok(run_cli("train", "--config", "llm_tiny", "--root", root,
                          *overrides(*STEPS, "run.name=w2-to-w1")))
    assert "resuming at world 1 from world 2: grad_accum 1 -> 2 keeps the global batch 8" in resumed.stdout
    assert "global batch 8 × 32 tokens" in resumed.stdout

    ref = {r["step"]: r for r in read_metrics(root, "w2-ref")}
    got = {r["step"]: r for r in read_metrics(root, "w2-to-w1")}
    for step in range(7, 13):
        # The same samples in the same weights; 2 accumulated micro-batches vs 2 ranks' all-reduce differ only
        # in the order of the gradient sums (float32), which drifts well below 1e-5 over six steps.
        assert abs(got[step]["loss"] - ref[step]["loss"]) < 1e-5, (step, got[step]["loss"], ref[step]["loss"])
        assert got[step]["tokens_seen"] == ref[step]["tokens_seen"] == step * 8 * 32   # samples, not steps x rank


# -- the rule, case by case ------------------------------------------------------------------------
def _state(global_batch: int | None, world: int, **train) -> dict:
    cfg = {"train": {"micro_batch": 8, "grad_accum": 1, **train}}
    state = {"world_size": world, "config": cfg, "parallel": f"DDP dp_replicate={world} dp_shard=1 (world {world})"}
    return {**state, "global_batch": global_batch} if global_batch else state


def test_same_world_same_batch_says_nothing():
    assert resume_batch(_state(16, 2), TrainConfig(micro_batch=8), dp=2, world=2) == (1, 16, None)


def test_fewer_ranks_accumulate():
    accum, batch, line = resume_batch(_state(16, 2), TrainConfig(micro_batch=8), dp=1, world=1)
    assert (accum, batch) == (2, 16)
    assert line == "resuming at world 1 from world 2: grad_accum 1 -> 2 keeps the global batch 16"


def test_more_ranks_lower_the_accumulation():
    accum, batch, _ = resume_batch(_state(32, 1), TrainConfig(micro_batch=8, grad_accum=4), dp=4, world=4)
    assert (accum, batch) == (1, 32)


def test_not_dividing_is_refused_naming_both_figures():
    with pytest.raises(UserError) as e:
        resume_batch(_state(16, 2), TrainConfig(micro_batch=8), dp=4, world=4)
    assert "global batch 16 -> 32" in str(e.value) and "train.allow_batch_change=true" in str(e.value)


def test_allow_batch_change_trains_on_at_the_new_batch():
    accum, batch, line = resume_batch(_state(16, 2), TrainConfig(micro_batch=8, allow_batch_change=True),
                                      dp=1, world=1)
    assert (accum, batch) == (1, 8) and "global batch 16 -> 8" in line


def test_an_explicit_other_global_batch_is_refused():
    with pytest.raises(UserError, match="train.global_batch=8 asks for another"):
        resume_batch(_state(16, 2), TrainConfig(micro_batch=8, global_batch=8), dp=1, world=1)


def test_checkpoints_before_the_figure_was_saved_derive_it():
    assert saved_global_batch(_state(None, 2, grad_accum=2)) == 8 * 2 * 2
    assert saved_global_batch({"world_size": 2}) is None
