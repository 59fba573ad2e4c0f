"""The plan -> train loop: every layout `plan --search` lists for a tiny model on one node of 4 GPUs is
one the trainer runs, with the `set` overrides the search printed, and it trains the same model as one
process (torchrun, 4 CPU ranks over gloo; the GPUs of the plan exist only on paper).

Candidates that differ only in activation checkpointing share a layout: recomputing activations frees memory and
changes no number, so each layout trains once (4 runs, not 10: ~100 s of the suite; the four in one torchrun
launch), with its activation checkpointing chosen so that every mode the search lists trains at world 4; the
trainer's config loader accepts every candidate's overrides."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from conftest import repo_source_dataset, run_cli, train_runs
from test_parallel import TINY, assert_matches, losses, train

pytestmark = pytest.mark.slow

STEPS = range(1, 5)
MODEL = ["--set", "model.n_layers=4", "--set", "train.steps=4"]
PLAN = {"model": {"name": "tiny", "n_layers": 4, "d_model": 64, "n_heads": 4, "n_kv_heads": 2, "ffn_hidden": 128,
                  "vocab_size": 320, "seq_len": 32},
        "cluster": {"name": "one-node", "nodes": {"count": 1}, "hardware": {"gpu": "A100-80GB", "gpus_per_node": 4}},
        "parallel": {"global_batch": 4}, "training": {"tokens": 1e6}}


def test_every_search_candidate_trains_under_torchrun_and_matches_one_process(tmp_path):
    plan = tmp_path / "tiny.yaml"
    plan.write_text(yaml.safe_dump(PLAN))
    job = tmp_path / "job.yaml"
    proc = run_cli("plan", plan, "--search", "--json", "--emit-config", job, check=True)
    found = json.loads(proc.stdout)["search"]
    sets = list(dict.fromkeys(tuple(c["set"]) for c in found))  # distinct, best first
    assert len(sets) == len(found) and all(c["tp"] * c["pp"] * c["dp"] == 4 for c in found)
    # The emitted job config is the best candidate's layout, in a file the trainer loads.
    from llmcluster.config.load import load_job_config

    cfg = load_job_config(str(job))
    for item in found[0]["set"]:
        key, value = item.split("=", 1)
        section, name = key.split(".")
        assert str(getattr(getattr(cfg, section), name)).lower() == value.lower(), item

    root = repo_source_dataset(tmp_path / "s", 30)
    train(root, "single", 1, *MODEL, "--set", "parallel.dp_shard=1", "--set", "train.micro_batch=1",
          "--set", "train.grad_accum=4")
    reference = losses(root, "single")
    for overrides in sets:
        load_job_config(str(job), list(overrides))
    chosen = one_per_layout(sets)
    assert len(chosen) == 4 and {ac_mode(c) for c in chosen} == {ac_mode(c) for c in sets} == \
        {"none", "selective", "full"}, chosen
    # the four layouts one after the other in one launch of 4 ranks (train_runs_worker.py): torch and the trainer
    # start once, not once per layout
    train_runs(4, [["train", "--root", str(root), *TINY, "--set", f"run.name=cand{i}", *MODEL,
                    *[a for o in overrides for a in ("--set", o)]] for i, overrides in enumerate(chosen)])
    for i in range(len(chosen)):
        assert_matches(reference, losses(root, f"cand{i}"), STEPS)


AC_KEYS = ("parallel.activation_checkpoint=", "parallel.ac_every=")


def ac_mode(overrides: tuple[str, ...]) -> str:
    return next(o.split("=", 1)[1] for o in overrides if o.startswith(AC_KEYS[0]))


def one_per_layout(sets: list[tuple[str, ...]]) -> list[tuple[str, ...]]:
    """One candidate of each layout (the overrides but activation checkpointing), preferring a mode not yet chosen."""
    layouts: dict[tuple[str, ...], list[tuple[str, ...]]] = {}
    for c in sets:
        layouts.setdefault(tuple(o for o in c if not o.startswith(AC_KEYS)), []).append(c)
    chosen: list[tuple[str, ...]] = []
    for members in layouts.values():
        fresh = [c for c in members if ac_mode(c) not in {ac_mode(x) for x in chosen}]
        chosen.append((fresh or members)[-1])
    return chosen
