"""What the parallel layouts communicate, on CPU with real processes (torchrun + gloo, fp32), beside the numbers
they compute: the TP loss on vocabulary-sharded logits (`loss_parallel`, also on a pipeline's last stage), and
FSDP under PP keeping each stage's blocks gathered for the whole step. Each worker prints one JSON line per rank."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from conftest import REPO, cli_env

pytestmark = pytest.mark.slow

SHAPE = ["model.d_model=64", "model.n_heads=4", "model.n_kv_heads=2", "model.ffn_hidden=128",
         "model.vocab_size=320", "data.seq_len=32", "train.precision=fp32", "parallel.dp_replicate=1"]


def torchrun(worker: str, nproc: int, *sets: str) -> list[dict]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           str(REPO / "tests" / worker), *SHAPE, *sets]
    proc = subprocess.run(cmd, cwd=REPO, env=cli_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    ranks = sorted((json.loads(m) for m in re.findall(r"\{[^{}]*\}", proc.stdout)), key=lambda r: r["rank"])
    assert [r["rank"] for r in ranks] == list(range(nproc)), proc.stdout
    return ranks


def test_tp_loss_on_vocabulary_sharded_logits_matches_one_process():
    """TP=2: the head's output stays a DTensor sharded on the vocabulary (each rank holds V/2 of the logits; no
    rank gathers them whole) and the cross-entropy runs under `loss_parallel`; loss and every gradient match a
    plain Llama with the same weights in one process. On main the head gathered replicated logits."""
    for r in torchrun("tp_loss_worker.py", 2, "model.n_layers=2", "parallel.dp_shard=1", "parallel.tp=2"):
        head = r["head_type"], r["head_placements"], r["head_local_shape"]
        assert head == ("DTensor", ["S(2)"], [2, 32, 160]), r
        assert r["block_out_shape"] == [2, 16, 64], r  # sequence parallel: each rank holds half the sequence
        assert r["loss_type"] == "Tensor", r  # what the trainer divides and logs: a plain tensor
        # the clipping norm sums squares over the sequence shards in another order than one process: 1.7e-5 on
        # torch 2.6 (test-compat), 8e-8 on today's; the gradients themselves stay within 1e-5
        assert r["loss_rel"] < 1e-5 and r["grad_rel"] < 1e-5 and r["norm_rel"] < 1e-4, r


def test_tp_without_sequence_parallelism_matches_one_process():
    """parallel.sequence_parallel=false (Megatron's layout before SP): the hidden states between blocks are whole
    on both TP ranks, the norms' weights replicated DTensors (one mesh for the gradient norm), the head's output
    still vocabulary-sharded into the loss, which is now computed in sequence slices (train.loss_chunks, refused
    under SP); loss, every gradient and the clipped norm match one process as with SP. On main the key was
    refused: the trainer ran TP with SP only."""
    for r in torchrun("tp_loss_worker.py", 2, "model.n_layers=2", "parallel.dp_shard=1", "parallel.tp=2",
                      "parallel.sequence_parallel=false", "train.loss_chunks=2"):
        assert r["block_out_shape"] == [2, 32, 64] and r["norm_placements"] == ["R"], r
        assert (r["head_type"], r["head_placements"], r["head_local_shape"]) == ("DTensor", ["S(2)"], [2, 16, 160]), r
        assert r["loss_rel"] < 1e-5 and r["grad_rel"] < 1e-5 and r["norm_rel"] < 1e-5, r


def test_pp_times_fsdp_gathers_each_block_once_per_step():
    """pp=2 × dp_shard=2, 4 micro-batches: each FSDP unit with parameters (2 blocks and the stage's root on every
    rank) is all-gathered once per step and kept for all micro-batches (torchtitan under PP). On main the blocks
    resharded after every micro-batch's forward: 7 gathers per step here, growing with the micro-batches."""
    ranks = torchrun("pp_gather_worker.py", 4, "model.n_layers=4", "parallel.pp=2", "parallel.dp_shard=2",
                     "train.micro_batch=1", "train.grad_accum=4")
    assert all(r["units"] == 3 and r["all_gathers"] == 3 for r in ranks), ranks
    assert [len(r["losses"]) for r in ranks] == [0, 0, 4, 4], ranks  # the last stage's ranks compute the loss


def test_pp_times_tp_last_stage_loss_on_vocabulary_sharded_logits():
    """pp=2 × tp=2: the last stage's head output stays sharded on the vocabulary into the loss (the schedule runs
    under `loss_parallel`) and the schedule records plain losses, the same on both TP ranks. The numbers against
    one process: tests/test_pipeline.py::test_pp2_times_tp2_matches_one_process."""
    ranks = torchrun("pp_gather_worker.py", 4, "model.n_layers=4", "parallel.pp=2", "parallel.dp_shard=1",
                     "parallel.tp=2", "train.micro_batch=1", "train.grad_accum=2")
    first, last = ranks[:2], ranks[2:]  # the pp dimension is the outermost of the mesh
    assert all("head_type" not in r and r["losses"] == [] for r in first), first
    for r in last:
        head = r["head_type"], r["head_placements"], r["head_local_shape"]
        assert head == ("DTensor", ["S(2)"], [1, 32, 160]) and r["loss_types"] == ["Tensor"], r
    assert last[0]["losses"] == last[1]["losses"] and len(last[0]["losses"]) == 2, last
