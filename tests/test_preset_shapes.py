"""Every shipped preset's layer shape trains, at the meshes users run it on, through the CLI (torchrun + gloo).

The shapes that ship (configs/llm_*.yaml) differ in what breaks distributed code: head_dim 32/64/128, GQA 1/3/8,
ffn/d 8/3, 43/16, 27/10 and 7/2, activation checkpointing none/selective/full. Each is kept exactly and made
small: 4 layers, the fewest heads that keep the head_dim, the GQA ratio and an integral ffn at the same ffn/d.
Each shape trains a few steps as DDP and as FSDP on 2 ranks (presets whose scaled-down runs would be
identical, 1b and 7b, run once), plus one HSDP (2x2) and one FSDP x TP (2x2) case on
4 ranks; DDP and FSDP start from the same seeded weights and batches, so their losses agree. The preset's own
activation checkpointing is kept (with 4 layers and ac_every=2, blocks 1 and 3 are not recomputed: the
blocks resharded after forward that torch 2.6 could not train on CPU). torch.compile is off (a cold
inductor build per process costs minutes on 2 cores; test_parallel.py covers it on today's torch).

`make test-compat` runs this file on the floor torch, `make test` on today's.
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from fractions import Fraction
from pathlib import Path

import pytest

from conftest import REPO, cli_env, repo_source_dataset
from llmcluster.config.load import load_job_config

pytestmark = pytest.mark.slow

PRESETS = ["llm_tiny", "llm_125m", "llm_1b", "llm_7b", "llm_13b", "llm_70b"]
STEPS = 4
LAYERS = 4
# One sequence of 16 tokens per data-parallel rank: DDP and FSDP of one shape see the same batches.
COMMON = ["data.dataset=src", "data.kind=code", "model.vocab_size=320", "data.seq_len=16", "train.micro_batch=1",
          f"model.n_layers={LAYERS}", "train.precision=fp32", "train.compile=false", "train.lr=1e-3",
          "train.warmup_steps=1", f"train.steps={STEPS}", "train.threads=1", "train.grad_accum=1",
          "log.interval=1", "log.eval_interval=1000", "log.eval_batches=1", "log.progress=false",
          "log.metrics_bind=null", "checkpoint.interval_steps=1000", "checkpoint.async=false", "run.seed=1234"]
MESHES = {  # name: (ranks, dp_replicate, dp_shard, tp)
    "ddp": (2, 2, 1, 1),
    "fsdp": (2, 1, 2, 1),
    "hsdp": (4, 2, 2, 1),
    "fsdp_tp": (4, 1, 2, 2),
}


def small_shape(preset: str, tp: int = 1) -> dict[str, int | bool]:
    """The preset's head_dim, GQA ratio, ffn/d and tying with the fewest heads (kv heads divisible by tp)."""
    m = load_job_config(preset).model
    ratio = m.n_heads // m.kv_heads
    ffn_per_d = Fraction(m.ffn_hidden, m.d_model)
    kv = tp
    while (ffn_per_d * kv * ratio * m.head_dim).denominator != 1:
        kv += tp
    d = kv * ratio * m.head_dim
    return {"d_model": d, "n_heads": kv * ratio, "n_kv_heads": kv, "ffn_hidden": int(ffn_per_d * d),
            "tie_embeddings": m.tie_embeddings}


def layer_setup(preset: str) -> tuple:
    """What of a preset reaches the scaled-down run: its shape and its activation checkpointing."""
    p = load_job_config(preset).parallel
    return tuple(small_shape(preset).items()), p.activation_checkpoint, p.ac_every


# Presets whose scaled-down runs would be identical (1b and 7b: the same shape and checkpointing) run once.
SETUPS: dict[tuple, list[str]] = {}
for _name in PRESETS:
    SETUPS.setdefault(layer_setup(_name), []).append(_name)
DISTINCT = [names[0] for names in SETUPS.values()]


def overrides(preset: str, mesh: str) -> list[str]:
    _, rep, shard, tp = MESHES[mesh]
    shape = small_shape(preset, tp)
    items = [*COMMON, *(f"model.{k}={str(v).lower()}" for k, v in shape.items()),
             f"parallel.dp_replicate={rep}", f"parallel.dp_shard={shard}", f"parallel.tp={tp}", "parallel.pp=1",
             f"run.name={preset}-{mesh}"]
    return [a for kv in items for a in ("--set", kv)]


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    """Storage with a byte-level dataset made from this repo's own source files."""
    return repo_source_dataset(tmp_path_factory.mktemp("presets") / "s", 30)


def train(root: Path, preset: str, mesh: str) -> dict[int, float]:
    """`torchrun -m llmcluster train -c PRESET --set ...`; the losses it logged, by step."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={MESHES[mesh][0]}",
           "-m", "llmcluster", "train", "-c", preset, "--root", str(root), *overrides(preset, mesh)]
    proc = subprocess.run(cmd, cwd=REPO, env=cli_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{preset} {mesh}: exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    lines = (root / "logs" / f"{preset}-{mesh}" / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r["loss"] for r in map(json.loads, lines) if "loss" in r}


def assert_trains(losses: dict[int, float]) -> None:
    assert sorted(losses) == list(range(1, STEPS + 1)), losses
    assert all(math.isfinite(v) for v in losses.values()), losses
    assert losses[STEPS] < losses[1], losses  # it learns (byte frequencies, at least)


@pytest.mark.parametrize("preset", PRESETS)
def test_small_shape_keeps_the_preset_shape(preset):
    m = load_job_config(preset).model
    s = load_job_config(preset, ["parallel.tp=1", *(f"model.{k}={str(v).lower()}"
                                                    for k, v in small_shape(preset).items())]).model
    assert (s.head_dim, s.n_heads // s.kv_heads, Fraction(s.ffn_hidden, s.d_model), s.tie_embeddings) == \
        (m.head_dim, m.n_heads // m.kv_heads, Fraction(m.ffn_hidden, m.d_model), m.tie_embeddings)
    assert s.d_model <= 1024 and LAYERS <= m.n_layers
    assert preset in SETUPS[layer_setup(preset)]  # and its runs below train it (or one identical to it)


@pytest.mark.parametrize("preset", DISTINCT, ids=["+".join(n) for n in SETUPS.values()])
def test_preset_shape_trains_as_ddp_and_fsdp_alike(root, preset):
    ddp, fsdp = train(root, preset, "ddp"), train(root, preset, "fsdp")
    assert_trains(ddp)
    assert_trains(fsdp)
    # Same seeded weights and batches: step 1 (before any update) agrees to rounding, later steps to the drift
    # of another reduction order through AdamW.
    assert abs(ddp[1] - fsdp[1]) < 1e-5, (ddp, fsdp)
    assert max(abs(ddp[s] - fsdp[s]) for s in ddp) < 1e-3, (ddp, fsdp)


@pytest.mark.parametrize("preset,mesh", [("llm_125m", "hsdp"), ("llm_7b", "fsdp_tp")])
def test_preset_shape_trains_on_four_ranks(root, preset, mesh):
    assert_trains(train(root, preset, mesh))


def test_fsdp_all_gathers_per_step():
    """Forward gathers every block and the root once. Backward gathers again each block resharded after
    forward: all but the last (kept, as backward needs it first), and never the root (embedding, norm and
    head are what backward needs first; torch 2.13 resharded it when told True, one more gather per step)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           str(REPO / "tests" / "fsdp_gather_worker.py"), f"model.n_layers={LAYERS}", "model.d_model=64",
           "model.n_heads=4", "model.n_kv_heads=2", "model.ffn_hidden=128", "model.vocab_size=320",
           "train.precision=fp32", "parallel.dp_replicate=1", "parallel.dp_shard=2"]
    proc = subprocess.run(cmd, cwd=REPO, env=cli_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    ranks = [json.loads(m) for m in re.findall(r"\{[^{}]*\}", proc.stdout)]
    assert sorted(r["rank"] for r in ranks) == [0, 1], proc.stdout
    # resharded after forward: n blocks + root, then n - 1 blocks again; kept: n blocks + root, once
    assert all((r["all_gathers_reshard_true"], r["all_gathers_reshard_false"]) == (2 * LAYERS, LAYERS + 1)
               for r in ranks), ranks
