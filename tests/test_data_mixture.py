"""Mixtures: datasets drawn in proportion to their weights, deterministically, resumed bitwise."""

from __future__ import annotations

import sysconfig
from pathlib import Path

import pytest
import torch

from conftest import assert_one_line_error, cli_inprocess, overrides, read_metrics, run_cli

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
STDLIB = Path(sysconfig.get_paths()["stdlib"])
MIX = ["data.mixture={a: 3, b: 1}", "train.steps=12", "checkpoint.interval_steps=6", "log.eval_interval=6"]


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("mix") / "storage"
    # Two kinds: mixture names are looked up in every kind.
    run_cli("data", "prepare", "--root", root, "--name", "a", "--source", STDLIB / "json", "--tokenizer", "byte",
            check=True)
    run_cli("data", "prepare", "--root", root, "--name", "b", "--kind", "text", "--source", STDLIB / "email",
            "--tokenizer", "byte", check=True)
    return root


def test_mixture_shares_and_bitwise_resume(root):
    run_cli("train", "--config", "llm_tiny", "--root", root, *overrides(*MIX, "run.name=mix"), check=True)
    rows = read_metrics(root, "mix")
    assert all("tokens_by_source" in r for r in rows)
    for r in rows:
        by = r["tokens_by_source"]
        assert sum(by.values()) == r["tokens_seen"]
        assert abs(by["a"] / r["tokens_seen"] - 0.75) <= 0.05 + 1 / (r["step"] * 4), r  # 4 samples a step
    assert rows[-1]["tokens_by_source"] == {"a": 36 * 32, "b": 12 * 32}  # 48 samples, 3:1 exactly

    run_cli("train", "--config", "llm_tiny", "--root", root, *overrides(*MIX, "run.name=mix2", "train.stop_at=6"),
            check=True)
    second = run_cli("train", "--config", "llm_tiny", "--root", root, *overrides(*MIX, "run.name=mix2"), check=True)
    assert "resumed from" in second.stdout
    ref = {r["step"]: r for r in rows}
    got = {r["step"]: r for r in read_metrics(root, "mix2")}
    for step in range(7, 13):
        assert got[step]["loss"] == ref[step]["loss"], step  # bitwise
        assert got[step]["tokens_by_source"] == ref[step]["tokens_by_source"]


def test_mixture_order_does_not_depend_on_world_size(root):
    from llmcluster.config.schema import DataConfig
    from llmcluster.data.dataset import open_training_data

    data = DataConfig(mixture={"a": 1, "b": 2}, seq_len=16)
    rows = {}
    for dp in (1, 2):
        got = []
        samplers = [open_training_data(root, data, 7, verify=False, max_vocab=None)[1] for _ in range(dp)]
        for _ in range(3):
            per_rank = [list(s.micro_batches(8, r, dp, 8 // dp)) for r, s in enumerate(samplers)]
            got += [x for mbs in zip(*per_rank) for _, x, _ in mbs]
        rows[dp] = torch.cat(got)
    assert torch.equal(rows[1], rows[2])
    assert samplers[0].tokens_by_source() == {"a": 8 * 16, "b": 16 * 16}


def test_mixture_of_different_tokenizers_is_refused(capsys, root, tiny_root):
    run_cli("data", "prepare", "--root", root, "--name", "c", "--source", STDLIB / "json", "--tokenizer",
            "bpe:300", check=True)
    proc = cli_inprocess(capsys, "train", "--config", "llm_tiny", "--root", root,
                         *overrides("data.mixture={a: 1, c: 1}", "run.name=bad"))
    assert_one_line_error(proc, "different tokenizers")
    proc = cli_inprocess(capsys, "train", "--config", "llm_tiny", "--root", root,
                         *overrides("data.mixture={a: 1, nope: 1}", "run.name=bad"))
    assert_one_line_error(proc, "'nope'", "not found")


def test_validation_loss_per_mixture_source(root):
    """Each source is evaluated on its own validation windows (issue 28); val_loss pools their tokens."""
    run_cli("train", "--config", "llm_tiny", "--root", root,
            *overrides(*MIX, "train.steps=4", "log.eval_interval=2", "run.name=mixval"), check=True)
    evals = [r for r in read_metrics(root, "mixval") if "val_loss" in r]
    assert [r["step"] for r in evals] == [2, 4]
    for r in evals:
        by = r["val_loss_by_source"]
        assert set(by) == {"a", "b"} and by["a"] != by["b"]
        assert min(by.values()) <= r["val_loss"] <= max(by.values())
