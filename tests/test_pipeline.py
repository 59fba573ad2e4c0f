"""Pipeline parallelism on CPU with real processes (torchrun + gloo, fp32): a 4-layer Llama, 8 steps, the same
global batch (4 sequences of 32 tokens) as one process with 4 micro-batches of 1 (gradient accumulation).

    single    1 rank, grad_accum 4                                 the reference
    pp        2 ranks PP 2 (1F1B) + selective AC, checkpoint at step 4
    pp_dp     4 ranks PP 2 x FSDP 2
    pp_tp     4 ranks PP 2 x TP 2 (+SP)
    pp_int    2 ranks PP 2 interleaved 1F1B, 2 stages per rank (4 stages of one block)
    pp->one   pp/step_4 resumed on 1 rank                          (PP -> no PP)
    pp->fsdp  pp/step_4 resumed on 2 ranks FSDP                    (PP -> FSDP)
    compiled  2 ranks PP 2, torch.compile per block, 2 steps
The 2-rank runs but the compiled one share one torchrun launch, as do the 4-rank ones (train_runs_worker.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import assert_one_line_error, cli_env, repo_source_dataset, run_cli, train_runs
from test_parallel import TINY, assert_matches, losses, run_args, train

pytestmark = pytest.mark.slow

STEPS = range(1, 9)
FOUR_LAYERS = ["--set", "model.n_layers=4", "--set", "train.steps=8"]


def pp_mesh(pp: int, dp_shard: int = 1, tp: int = 1, schedule: str = "1F1B") -> list[str]:
    """4 sequences a step: micro-batches of 1, accumulated over 4 / dp (>= pp: 1F1B fills the pipeline)."""
    return [*FOUR_LAYERS, "--set", f"parallel.pp={pp}", "--set", f"parallel.pp_schedule={schedule}",
            "--set", "parallel.dp_replicate=1", "--set", f"parallel.dp_shard={dp_shard}",
            "--set", f"parallel.tp={tp}", "--set", "train.micro_batch=1", "--set", f"train.grad_accum={4 // dp_shard}"]


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return repo_source_dataset(tmp_path_factory.mktemp("pp") / "s", 30)


@pytest.fixture(scope="module")
def reference(root) -> dict[int, float]:
    train(root, "single", 1, *pp_mesh(1))
    ref = losses(root, "single")
    assert sorted(ref) == list(STEPS) and ref[8] < ref[1] - 0.3, ref  # it does learn
    return ref


@pytest.fixture(scope="module")
def two_rank_runs(root, reference) -> dict[str, str]:
    """pp, pp_int and pp_fsdp (which resumes pp/step_4), one after the other in one torchrun launch
    (train_runs_worker.py: torch and the trainer start once); each run's output on rank 0."""
    outputs = train_runs(2, [
        run_args(root, "pp", *pp_mesh(2), "--set", "parallel.activation_checkpoint=selective",
                 "--set", "checkpoint.interval_steps=4"),
        run_args(root, "pp_int", *pp_mesh(2, schedule="interleaved_1F1B")),
        run_args(root, "pp_fsdp", *pp_mesh(1, dp_shard=2), "--resume", str(root / "checkpoints" / "pp" / "step_4"),
                 "--init-from-checkpoint")])
    return dict(zip(("pp", "pp_int", "pp_fsdp"), outputs))


@pytest.fixture(scope="module")
def four_rank_runs(root, reference) -> dict[str, str]:
    """pp_dp and pp_tp in one launch of 4 ranks."""
    outputs = train_runs(4, [run_args(root, "pp_dp", *pp_mesh(2, dp_shard=2)),
                             run_args(root, "pp_tp", *pp_mesh(2, tp=2))])
    return dict(zip(("pp_dp", "pp_tp"), outputs))


@pytest.fixture(scope="module")
def pp_run(two_rank_runs) -> str:
    assert "× PP 2 1F1B (world 2)" in two_rank_runs["pp"], two_rank_runs["pp"]
    return "pp"


def test_pp2_matches_one_process(root, reference, pp_run):
    assert_matches(reference, losses(root, pp_run), STEPS)


def test_pp2_times_fsdp2_matches_one_process(root, reference, four_rank_runs):
    out = four_rank_runs["pp_dp"]
    assert "FSDP dp_replicate=1 dp_shard=2 × PP 2 1F1B (world 4)" in out, out
    assert_matches(reference, losses(root, "pp_dp"), STEPS)


def test_pp2_times_tp2_matches_one_process(root, reference, four_rank_runs):
    out = four_rank_runs["pp_tp"]
    assert "× TP 2 × PP 2 1F1B (world 4)" in out, out
    assert_matches(reference, losses(root, "pp_tp"), STEPS)


def test_interleaved_matches_1f1b(root, reference, pp_run, two_rank_runs):
    out = two_rank_runs["pp_int"]
    assert "× PP 2 interleaved_1F1B (2 stages per rank)" in out, out
    assert_matches(losses(root, pp_run), losses(root, "pp_int"), STEPS)
    assert_matches(reference, losses(root, "pp_int"), STEPS)


def test_pp_checkpoint_resumes_on_one_rank(root, reference, pp_run):
    proc = train(root, "pp_one", 1, *pp_mesh(1), "--resume", str(root / "checkpoints" / pp_run / "step_4"),
                 "--init-from-checkpoint")
    assert "(step 4)" in proc.stdout, proc.stdout
    assert_matches(reference, losses(root, "pp_one"), range(5, 9))


def test_pp_checkpoint_resumes_as_fsdp(root, reference, pp_run, two_rank_runs):
    out = two_rank_runs["pp_fsdp"]
    assert "FSDP dp_replicate=1 dp_shard=2 (world 2)" in out and "(step 4)" in out, out
    assert_matches(reference, losses(root, "pp_fsdp"), range(5, 9))


@pytest.mark.parametrize("extra, needles", [
    (["--set", "train.grad_accum=1"], ["train.grad_accum (1)", "parallel.pp (2)"]),
    (["--set", "model.tie_embeddings=true"], ["model.tie_embeddings", "parallel.pp"]),
    (["--set", "parallel.pp_schedule=interleaved_1F1B", "--set", "parallel.pp_virtual_stages=3"],
     ["parallel.pp x virtual stages (6)", "model.n_layers (4)"]),
    (["--set", "parallel.pp_virtual_stages=2"], ["parallel.pp_virtual_stages", "interleaved_1F1B"]),
])
def test_bad_pipeline_settings_are_one_line_errors(root, extra, needles):
    proc = run_cli("train", "--root", root, *TINY, *pp_mesh(2), "--set", "parallel.dp_shard=-1", *extra,
                   env=cli_env(WORLD_SIZE="2"))
    assert_one_line_error(proc, *needles)


def test_compile_per_stage_matches_eager(root, reference):
    # Two steps: a cold inductor compile costs minutes per process on 2 shared cores.
    train(root, "pp_compiled", 2, *pp_mesh(2), "--set", "train.compile=true", "--set", "train.stop_at=2")
    assert_matches(reference, losses(root, "pp_compiled"), range(1, 3))
