"""Scale-out training on CPU with real processes: torchrun + gloo, fp32, a 2-layer Llama, 10 steps.

Every mesh must train the *same* model as one process with the same global batch (4 sequences of 32
tokens): FSDP2, TP alone, FSDP×TP, DDP, with and without activation checkpointing, and across a
checkpoint saved at one mesh and resumed at another. One single-process run is the reference for all of
them (module-scoped fixture); runs are chained so each one checks several things (the 2-rank ones in one
torchrun launch):

    fsdp      2 ranks FSDP2 + selective AC, steps 1-10, checkpoint at step 5
    one       1 rank + full AC, resumes fsdp/step_5            (FSDP -> 1 rank)
    ddp       2 ranks DDP, resumes fsdp/step_5, stops at 7       (FSDP -> DDP)
    tp        2 ranks TP(+SP), resumes ddp/step_7                (DDP -> TP)
    fsdp_tp   4 ranks FSDP×TP (2×2), steps 1-10
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, assert_one_line_error, cli_env, repo_source_dataset, run_cli, train_runs

pytestmark = pytest.mark.slow

TOL = 1e-4
GLOBAL_BATCH = 4
TINY = ["--config", "llm_tiny", "--set", "data.dataset=src", "--set", "model.vocab_size=320",
        "--set", "model.n_layers=2", "--set", "model.d_model=64", "--set", "model.n_heads=4",
        "--set", "model.n_kv_heads=2", "--set", "model.ffn_hidden=128", "--set", "data.seq_len=32",
        "--set", "train.precision=fp32", "--set", "train.warmup_steps=2", "--set", "train.steps=10",
        "--set", "train.threads=1", "--set", "log.interval=1", "--set", "log.eval_interval=1000",
        "--set", "log.progress=false", "--set", "checkpoint.interval_steps=1000"]


def mesh(dp_replicate: int, dp_shard: int, tp: int = 1) -> list[str]:
    micro = GLOBAL_BATCH // (dp_replicate * dp_shard)
    return ["--set", f"parallel.dp_replicate={dp_replicate}", "--set", f"parallel.dp_shard={dp_shard}",
            "--set", f"parallel.tp={tp}", "--set", f"train.micro_batch={micro}"]


def train(root: Path, run: str, nproc: int, *extra: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """`env`: extra environment (test hooks)."""
    args = ["train", "--root", str(root), *TINY, "--set", f"run.name={run}", *extra]
    if nproc == 1:
        return run_cli(*args, check=True, timeout=300, env=cli_env(**(env or {})))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           "-m", "llmcluster", *args]
    proc = subprocess.run(cmd, cwd=REPO, env=cli_env(**(env or {})), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{run}: exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


def losses(root: Path, run: str) -> dict[int, float]:
    lines = (root / "logs" / run / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r["loss"] for r in map(json.loads, lines)}


def assert_matches(ref: dict[int, float], got: dict[int, float], steps: range, tol: float = TOL) -> None:
    assert sorted(got) == list(steps), sorted(got)
    diffs = {s: abs(got[s] - ref[s]) for s in steps}
    assert max(diffs.values()) < tol, diffs


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    """Storage with a byte-level dataset made from this repo's own source files."""
    return repo_source_dataset(tmp_path_factory.mktemp("par") / "s", 30)


@pytest.fixture(scope="module")
def reference(root) -> dict[int, float]:
    train(root, "single", 1, *mesh(1, 1))
    ref = losses(root, "single")
    assert sorted(ref) == list(range(1, 11)) and ref[10] < ref[1] - 0.3, ref  # it does learn
    return ref


def run_args(root: Path, run: str, *extra: str) -> list[str]:
    return ["train", "--root", str(root), *TINY, "--set", f"run.name={run}", *extra]


@pytest.fixture(scope="module")
def two_rank_runs(root, reference) -> dict[str, str]:
    """The chain's 2-rank runs (fsdp -> ddp -> tp), one after the other in one torchrun launch
    (train_runs_worker.py: torch and the trainer start once); each run's output on rank 0."""
    outputs = train_runs(2, [
        run_args(root, "fsdp", *mesh(1, 2), "--set", "parallel.activation_checkpoint=selective",
                 "--set", "parallel.ac_every=1", "--set", "checkpoint.interval_steps=5"),
        run_args(root, "ddp", *mesh(2, 1), "--set", "train.stop_at=7",
                 "--resume", str(root / "checkpoints" / "fsdp" / "step_5"), "--init-from-checkpoint"),
        run_args(root, "tp", *mesh(1, 1, tp=2), "--resume", str(root / "checkpoints" / "ddp" / "step_7"),
                 "--init-from-checkpoint")])
    return dict(zip(("fsdp", "ddp", "tp"), outputs))


@pytest.fixture(scope="module")
def fsdp_run(two_rank_runs) -> str:
    assert "FSDP dp_replicate=1 dp_shard=2" in two_rank_runs["fsdp"], two_rank_runs["fsdp"]
    return "fsdp"


@pytest.fixture(scope="module")
def ddp_run(two_rank_runs) -> str:
    out = two_rank_runs["ddp"]
    assert "DDP dp_replicate=2" in out and "(step 5)" in out, out
    return "ddp"


def test_fsdp_two_ranks_with_selective_ac_matches_one_process(root, reference, fsdp_run):
    assert_matches(reference, losses(root, fsdp_run), range(1, 11))


def test_resume_fsdp_checkpoint_on_one_rank_with_full_ac(root, reference, fsdp_run):
    proc = train(root, "one", 1, *mesh(1, 1), "--set", "parallel.activation_checkpoint=full",
                 "--resume", str(root / "checkpoints" / fsdp_run / "step_5"), "--init-from-checkpoint")
    assert "(step 5)" in proc.stdout
    assert_matches(reference, losses(root, "one"), range(6, 11))


def test_resume_fsdp_checkpoint_as_ddp(root, reference, ddp_run):
    assert_matches(reference, losses(root, ddp_run), range(6, 8))


def test_resume_ddp_checkpoint_as_tensor_parallel(root, reference, ddp_run, two_rank_runs):
    out = two_rank_runs["tp"]
    assert "× TP 2" in out and "(step 7)" in out, out
    got = losses(root, "tp")
    # The first step after the reshard sees exactly the saved weights: a wrong reshard shows here at once.
    assert abs(got[8] - reference[8]) < 1e-5, (got[8], reference[8])
    # Then TP's other reduction order drifts through AdamW (on torch 2.6 ~1.3e-4 by step 10, 4e-5 on 2.13).
    assert_matches(reference, got, range(8, 11), tol=3e-4)


def test_fsdp_times_tp_on_four_ranks_matches_one_process(root, reference):
    proc = train(root, "fsdp_tp", 4, *mesh(1, 2, tp=2))
    assert "FSDP dp_replicate=1 dp_shard=2 × TP 2" in proc.stdout, proc.stdout
    # FSDP2's "returned a view tensor ... wrong gradients" warning does not apply to our modules (parallelize.py
    # says why) and is filtered where we call fully_shard; it reached the README's FSDP x TP example (issue 34)
    assert "returned a view tensor" not in proc.stderr + proc.stdout, proc.stderr[-3000:]
    assert_matches(reference, losses(root, "fsdp_tp"), range(1, 11))


def test_compile_matches_eager(root, reference):
    # One process: a cold inductor compile costs 20-30 s per process on 2 cores (minutes under load).
    train(root, "compiled", 1, *mesh(1, 1), "--set", "train.compile=true", "--set", "train.stop_at=4")
    assert_matches(reference, losses(root, "compiled"), range(1, 5))


def test_degrees_that_do_not_match_the_world_size_are_one_line_errors(root):
    proc = run_cli("train", "--root", root, *TINY, *mesh(1, 2, tp=2))
    assert_one_line_error(proc, "parallel.dp_shard=2", "parallel.tp=2", "world size 1")
    proc = run_cli("train", "--root", root, *TINY, "--set", "parallel.dp_replicate=2",
                   "--set", "parallel.dp_shard=1", "--set", "parallel.tp=2")
    assert_one_line_error(proc, "world size 1")
