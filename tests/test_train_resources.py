"""A micro-batch that cannot fit is refused before anything is allocated (issue 34, item 5): one line from the
planner's memory model, exit 2, no run folders, with one process and with two ranks (not a traceback per rank).

The storage holds no dataset: a check that ran after the data were opened would answer "dataset not found"."""

from __future__ import annotations

import pytest

from conftest import assert_one_line_error, overrides, run_cli
from llmcluster.config import load_job_config
from llmcluster.distributed.process_groups import ParallelDims
from llmcluster.train.resources import needed_bytes

HUGE = "train.micro_batch=1000000000"


@pytest.mark.parametrize("procs", [[], ["--procs-per-node", "2"]], ids=["1 process", "2 ranks"])
def test_a_micro_batch_that_cannot_fit_is_one_line_and_leaves_nothing(storage, procs):
    proc = run_cli("train", "--config", "llm_tiny", "--root", storage, *procs,
                   *overrides(HUGE, "run.name=huge-mb"), timeout=300)
    assert_one_line_error(proc, "train.micro_batch=1000000000", "planner's memory model", "GiB")
    assert not (storage / "checkpoints" / "huge-mb").exists()
    assert not (storage / "logs" / "huge-mb").exists()


def test_the_estimate_is_the_planners_and_grows_with_the_micro_batch():
    """What the check compares: the planner's per-rank bytes (activations scale with the micro-batch); the
    tiny presets' figure is far below any host, so the check never refuses what trains today."""
    def need(*sets):
        cfg = load_job_config("llm_tiny", list(sets))
        return needed_bytes(cfg, ParallelDims.from_config(cfg, 1))

    small, big = need("train.micro_batch=4"), need("train.micro_batch=8")
    assert small[0] < 1024**3 and big[1] == pytest.approx(2 * small[1])
    # a lower bound: what the job does not hold is not counted (chunked logits; LoRA's frozen base has no
    # gradients or optimizer states)
    assert need("train.micro_batch=4", "train.loss_chunks=4")[1] < small[1]
    assert need("train.micro_batch=4", "train.lora.rank=8")[0] < small[0]
