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


def test_the_advice_says_when_no_micro_batch_can_make_the_job_fit(monkeypatch):
    """Issue 69: a 7B on a host smaller than its weights, gradients and optimizer states was told to lower the
    micro-batch or use more ranks (neither makes it fit); a job whose activations decide is told to lower it."""
    import torch

    from llmcluster.train import resources

    def problem(preset: str, have_gib: float) -> str:
        cfg = load_job_config(preset, ["train.micro_batch=1", "train.precision=fp32"])
        monkeypatch.setattr(resources, "host_available_bytes", lambda: have_gib * 1024**3)
        return resources.fit_problem(cfg, ParallelDims.from_config(cfg, 1), torch.device("cpu"), 1)

    weights = problem("llm_7b", 16)
    assert "a smaller micro-batch cannot fit it" in weights and "train.lora" in weights, weights
    cfg = load_job_config("llm_tiny", ["train.micro_batch=1000"])
    need, acts = needed_bytes(cfg, ParallelDims.from_config(cfg, 1))
    monkeypatch.setattr(resources, "host_available_bytes", lambda: need - acts / 2)   # the states fit, not the batch
    acts_only = resources.fit_problem(cfg, ParallelDims.from_config(cfg, 1), torch.device("cpu"), 1)
    assert acts_only and "lower train.micro_batch" in acts_only and "cannot fit it" not in acts_only, acts_only


# -- parallel.activation_checkpoint: auto (issue 36) ---------------------------------------------------------

def _ac_case(mode: str = "auto"):
    """llm_1b on one GPU at a micro-batch whose activations decide: the planner's figures per AC mode."""
    from llmcluster.plan.fit import job_plan
    from llmcluster.plan.memory import plan_memory

    sets = ["job.nodes=1", "job.gpus_per_node=1", "train.micro_batch=8"]
    cfg = load_job_config("llm_1b", sets + [f"parallel.activation_checkpoint={mode}"])
    totals = {m: plan_memory(job_plan(load_job_config("llm_1b", sets + [f"parallel.activation_checkpoint={m}"]),
                                      "h100")).total for m in ("none", "selective", "full")}
    return cfg, ParallelDims.from_config(cfg, 1), totals


@pytest.mark.parametrize("between, expected", [(("none", None), "none"), (("selective", "none"), "selective"),
                                               (("full", "selective"), "full")],
                         ids=["fits without", "needs selective", "needs full"])
def test_auto_checkpointing_takes_the_least_recompute_that_fits_by_the_planners_figures(between, expected):
    """The choice against the planner's per-GPU totals (its margin included: reserve and allocator slack):
    free memory just above one mode's figure and below the next lighter one's picks that mode."""
    from llmcluster.train.resources import choose_activation_checkpoint

    cfg, dims, totals = _ac_case()
    assert totals["none"] > totals["selective"] > totals["full"], totals
    enough, too_little = between
    free = totals[enough] + 1 if too_little is None else (totals[enough] + totals[too_little]) / 2
    mode, line = choose_activation_checkpoint(cfg, dims, free)
    assert mode == expected
    assert line.startswith(f"activation checkpointing auto -> {expected}: the step needs ")
    assert f"{totals['none'] / 1024**3:,.1f} GiB without" in line and f"{free / 1024**3:,.1f} GiB free" in line
    if expected != "none":
        assert f"{totals[expected] / 1024**3:,.1f} GiB with" in line
    assert "\n" not in line and "does not fit" not in line


def test_auto_checkpointing_is_full_when_nothing_fits_and_none_on_cpu():
    from llmcluster.train.resources import choose_activation_checkpoint

    cfg, dims, totals = _ac_case()
    mode, line = choose_activation_checkpoint(cfg, dims, totals["full"] / 2)
    assert mode == "full" and "does not fit even so" in line
    mode, line = choose_activation_checkpoint(cfg, dims, None)   # a CPU: no device memory to save
    assert mode == "none" and line.startswith("activation checkpointing auto -> none: ")


def test_auto_checkpointing_is_resolved_and_said_at_start_and_a_bad_mode_is_one_line(storage, capsys):
    """The config accepts auto and nothing else new; `bench` (the trainer's pieces) resolves it before the
    model is built and says so in one line (on this CPU: none), the record carrying the mode that ran."""
    from conftest import cli_inprocess

    bad = cli_inprocess(capsys, "bench", "--config", "llm_tiny", "--root", storage, "--steps", "1", "--warmup",
                        "0", *overrides("parallel.activation_checkpoint=sometimes"))
    assert_one_line_error(bad, "parallel.activation_checkpoint", "auto")
    ok = cli_inprocess(capsys, "bench", "--config", "llm_tiny", "--root", storage, "--steps", "1", "--warmup", "0",
                       *overrides("parallel.activation_checkpoint=auto", "model.n_layers=1", "data.seq_len=32",
                                  "train.micro_batch=1", "run.name=ac-auto"))
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.count("activation checkpointing auto -> none: ") == 1, ok.stdout
    assert "AC none" in ok.stdout


def test_the_trainer_says_its_auto_checkpointing_choice_once_at_start(tiny_root):
    proc = run_cli("train", "--config", "llm_tiny", "--root", tiny_root,
                   *overrides("parallel.activation_checkpoint=auto", "train.steps=1", "run.name=ac-auto-train"),
                   timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout + proc.stderr
    assert out.count("activation checkpointing auto -> none: on a CPU") == 1, out
    assert out.index("activation checkpointing auto") < out.index("run ac-auto-train:")
