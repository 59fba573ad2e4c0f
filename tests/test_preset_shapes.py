"""Every shipped preset's layer shape trains, at the meshes users run it on, through the CLI (torchrun + gloo).

The shapes that ship (configs/llm_*.yaml) differ in what breaks distributed code: head_dim 32/64/128, GQA 1/3/8,
ffn/d 8/3, 43/16, 27/10 and 7/2, activation checkpointing none/selective/full. Each is kept exactly and made
small: 4 layers (2 where every block is checkpointed alike or none is), the fewest heads that keep the head_dim,
the GQA ratio and an integral ffn at the same ffn/d (llm_tiny, already that small, keeps its own width: the one
torch 2.6 failed on). Each shape trains 3 steps as DDP and as FSDP on 2 ranks (1b and 7b, identical once scaled,
run once), plus one HSDP (2x2) and one FSDP x TP (2x2) case on 4 ranks; runs of one shape start from the same
seeded weights and see the same batches, so their losses agree. A shape's DDP and FSDP runs share one torchrun
launch, as do the two 4-rank runs: each rank runs them one after the other through the CLI's entry
(train_runs_worker.py). The preset's activation checkpointing is kept: tiny and 125m have none, and with
ac_every=2 block 1 is neither checkpointed nor the last (kept gathered), i.e. resharded after forward and not
recomputed, what torch 2.6 could not train on CPU (docs/compat.md). torch.compile is off (a cold inductor build
per process costs minutes on 2 cores; test_parallel.py covers it on today's torch).

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

from conftest import REPO, cli_env, repo_source_dataset, train_runs
from llmcluster.config.load import load_job_config

# One pytest-xdist worker runs them all (`make test`: --dist loadgroup): the module's runs, launched together,
# are made once, not once on each worker that gets one of their tests.
pytestmark = pytest.mark.xdist_group("preset_runs")

PRESETS = ["llm_tiny", "llm_125m", "llm_1b", "llm_7b", "llm_13b", "llm_70b"]
STEPS = 3
LAYERS = 4  # where selective checkpointing tells blocks apart (n_layers), and in the all-gather count
GLOBAL_BATCH = 4  # sequences of 16 tokens per step at every mesh: runs of one shape see the same batches
COMMON = ["data.dataset=src", "data.kind=code", "model.vocab_size=320", "data.seq_len=16",
          "train.precision=fp32", "train.compile=false",
          "train.warmup_steps=1", f"train.steps={STEPS}", "train.threads=1", "train.grad_accum=1", "log.interval=1",
          "log.eval_interval=1000", "log.eval_batches=1", "log.progress=false", "log.metrics_bind=null",
          "checkpoint.interval_steps=1000", "checkpoint.async=false", "run.seed=1234"]
FULL_WIDTH = 256  # a preset no wider trains at its own width (as cheap as its fewest-heads shape on CPU)
MESHES = {  # name: (ranks, dp_replicate, dp_shard, tp)
    "ddp": (2, 2, 1, 1),
    "fsdp": (2, 1, 2, 1),
    "hsdp": (4, 2, 2, 1),
    "fsdp_tp": (4, 1, 2, 2),
}


def small_shape(preset: str, tp: int = 1) -> dict[str, int | bool]:
    """The preset's head_dim, GQA ratio, ffn/d and tying with the fewest heads (kv heads divisible by tp); a
    preset already that small (llm_tiny, d 192) keeps its own heads: its full width is what torch 2.6 failed on."""
    m = load_job_config(preset).model
    if m.d_model <= FULL_WIDTH and m.kv_heads % tp == 0:
        return {"d_model": m.d_model, "n_heads": m.n_heads, "n_kv_heads": m.kv_heads, "ffn_hidden": m.ffn_hidden,
                "tie_embeddings": m.tie_embeddings}
    ratio = m.n_heads // m.kv_heads
    ffn_per_d = Fraction(m.ffn_hidden, m.d_model)
    kv = tp
    while (ffn_per_d * kv * ratio * m.head_dim).denominator != 1:
        kv += tp
    d = kv * ratio * m.head_dim
    return {"d_model": d, "n_heads": kv * ratio, "n_kv_heads": kv, "ffn_hidden": int(ffn_per_d * d),
            "tie_embeddings": m.tie_embeddings}


def n_layers(preset: str) -> int:
    """4 blocks where selective checkpointing (ac_every=2) tells them apart: one checkpointed, one neither
    checkpointed nor the last (resharded after forward, not recomputed), the last (kept gathered). Where every
    block is checkpointed or none is, 2 take every path (one resharded after forward, the last kept), and the
    widest shapes (70b, 13b: full) cost half the CPU."""
    return LAYERS if load_job_config(preset).parallel.activation_checkpoint == "selective" else 2


def layer_setup(preset: str) -> tuple:
    """What of a preset reaches the scaled-down run: its shape, depth and activation checkpointing."""
    p = load_job_config(preset).parallel
    return tuple(small_shape(preset).items()), n_layers(preset), p.activation_checkpoint, p.ac_every


# Presets whose scaled-down runs would be identical (1b and 7b: the same shape and checkpointing) run once.
SETUPS: dict[tuple, list[str]] = {}
for _name in PRESETS:
    SETUPS.setdefault(layer_setup(_name), []).append(_name)
DISTINCT = [names[0] for names in SETUPS.values()]


def overrides(preset: str, mesh: str) -> list[str]:
    _, rep, shard, tp = MESHES[mesh]
    shape = small_shape(preset, tp)
    items = [*COMMON, *(f"model.{k}={str(v).lower()}" for k, v in shape.items()), f"model.n_layers={n_layers(preset)}",
             f"parallel.dp_replicate={rep}", f"parallel.dp_shard={shard}", f"parallel.tp={tp}", "parallel.pp=1",
             f"train.micro_batch={GLOBAL_BATCH // (rep * shard)}", f"run.name={preset}-{mesh}"]
    return [a for kv in items for a in ("--set", kv)]


# The runs one torchrun launch trains one after the other (tests/train_runs_worker.py): a shape's DDP and FSDP
# runs, and the two 4-rank runs. A launch costs its processes' start (torch and the trainer, ~5 s of CPU each).
FOUR_RANK_RUNS = [("llm_125m", "hsdp"), ("llm_7b", "fsdp_tp")]


def launch_of(preset: str, mesh: str) -> list[tuple[str, str]]:
    return FOUR_RANK_RUNS if MESHES[mesh][0] == 4 else [(preset, "ddp"), (preset, "fsdp")]


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    """Storage with a byte-level dataset made from this repo's own source files."""
    return repo_source_dataset(tmp_path_factory.mktemp("presets") / "s", 30)


@pytest.fixture(scope="module")
def train(root):
    """train(preset, mesh): `llmcluster train -c PRESET --set ...` once per module, in one launch with the other
    runs of launch_of(preset, mesh); returns {step: loss, "val0": validation loss before training, "val": after
    the last step}."""
    done: dict[tuple[str, str], dict] = {}

    def run(preset: str, mesh: str) -> dict:
        if (preset, mesh) not in done:
            runs = [r for r in launch_of(preset, mesh) if r not in done]
            outputs = train_runs(MESHES[mesh][0], [["train", "-c", p, "--root", str(root), *overrides(p, m)]
                                                 for p, m in runs])
            for (p, m), output in zip(runs, outputs):
                lines = (root / "logs" / f"{p}-{m}" / "metrics.jsonl").read_text().splitlines()
                records = [json.loads(line) for line in lines]
                out: dict = {r["step"]: r["loss"] for r in records}
                out["val"] = records[-1].get("val_loss")
                out["val0"] = float(re.search(r"^step 0 val ([\d.]+)", output, re.M).group(1))
                done[p, m] = out
        return done[preset, mesh]

    return run


def assert_trains(run: dict) -> None:
    assert sorted(k for k in run if isinstance(k, int)) == list(range(1, STEPS + 1)), run
    assert all(math.isfinite(v) for v in run.values()), run
    # It learns: the same held-out batch scores better after the steps than before them.
    assert run["val"] < run["val0"], run


def assert_same_run(a: dict, b: dict, tol: float = 1e-3) -> None:
    """Same seeded weights and batches: step 1 (before any update) agrees to rounding, later steps to the
    drift of another reduction order through AdamW."""
    assert abs(a[1] - b[1]) < 1e-5, (a, b)
    assert max(abs(a[k] - b[k]) for k in a) < tol, (a, b)


@pytest.mark.parametrize("preset", PRESETS)
def test_small_shape_keeps_the_preset_shape(preset):
    m = load_job_config(preset).model
    s = load_job_config(preset, ["parallel.tp=1", *(f"model.{k}={str(v).lower()}"
                                                    for k, v in small_shape(preset).items())]).model
    assert (s.head_dim, s.n_heads // s.kv_heads, Fraction(s.ffn_hidden, s.d_model), s.tie_embeddings) == \
        (m.head_dim, m.n_heads // m.kv_heads, Fraction(m.ffn_hidden, m.d_model), m.tie_embeddings)
    assert s.d_model <= 1024 and n_layers(preset) <= m.n_layers
    assert preset in SETUPS[layer_setup(preset)]  # and its runs below train it (or one identical to it)


@pytest.mark.slow
@pytest.mark.parametrize("preset", DISTINCT, ids=["+".join(n) for n in SETUPS.values()])
def test_preset_shape_trains_as_ddp_and_fsdp_alike(train, preset):
    ddp, fsdp = train(preset, "ddp"), train(preset, "fsdp")
    assert_trains(ddp)
    assert_trains(fsdp)
    assert_same_run(ddp, fsdp)


@pytest.mark.slow
def test_hsdp_on_four_ranks_trains_as_fsdp_on_two(train):
    hsdp = train("llm_125m", "hsdp")
    assert_trains(hsdp)
    assert_same_run(hsdp, train("llm_125m", "fsdp"))  # the gradient average over 2 x 2 ranks is right


@pytest.mark.slow
def test_fsdp_times_tp_on_four_ranks_trains(train):
    # TP splits the kv heads: the 7b shape with 2 of them (test_parallel.py holds FSDP x TP to one process)
    assert_trains(train("llm_7b", "fsdp_tp"))


@pytest.mark.slow
def test_the_tiny_preset_as_fsdp_without_activation_checkpointing(train):
    """The preset that died in its first backward on torch 2.6 ("modified by an inplace operation" on a
    [512, 192] weight: a block resharded after forward and not recomputed, see docs/compat.md) trains as FSDP
    at its full width, without activation checkpointing: the FSDP run of the llm_tiny case above."""
    m = load_job_config("llm_tiny")
    assert small_shape("llm_tiny") == {"d_model": 192, "n_heads": m.model.n_heads, "n_kv_heads": m.model.kv_heads,
                                       "ffn_hidden": 512, "tie_embeddings": m.model.tie_embeddings}
    assert m.parallel.activation_checkpoint == "none"
    assert_trains(train("llm_tiny", "fsdp"))


@pytest.mark.slow
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
