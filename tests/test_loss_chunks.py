"""The chunked cross-entropy (`train.loss_chunks`) against the loss in one piece, and the TF32 switch.

In-process, CPU: the loss and every gradient of a small Llama with a vocabulary large next to its width.
The memory it saves is measured by benchmarks/chunked_loss_memory.py, not here (no timing or memory
assertions in tests).
"""

from __future__ import annotations

import pytest
import torch

from conftest import assert_one_line_error, run_cli
from llmcluster.config.schema import JobConfig, ModelConfig
from llmcluster.model.llama import build_model, cross_entropy_sum

CFG = ModelConfig(n_layers=2, d_model=32, n_heads=4, n_kv_heads=2, ffn_hidden=64, vocab_size=1000,
                  max_seq_len=64)


def loss_and_grads(chunks: int, x, y, autocast: bool = False):
    model = build_model(CFG, seed=0)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = model(x, y, chunks)
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def assert_grads_close(got: dict, ref: dict, rel: float) -> None:
    """Each gradient within `rel` of its largest element (elementwise rtol fails on near-zero entries)."""
    errs = {n: float((got[n] - g).abs().max() / g.abs().max()) for n, g in ref.items()}
    assert max(errs.values()) < rel, errs


@pytest.mark.parametrize("chunks", [2, 5, 64])  # even slices, uneven ones, one position each
def test_chunked_loss_matches_loss_in_one_piece(chunks):
    g = torch.Generator().manual_seed(0)
    x, y = torch.randint(0, 1000, (3, 64), generator=g), torch.randint(0, 1000, (3, 64), generator=g)
    y[0, :10] = -100  # untrained positions (chat data) count in neither
    ref, ref_grads = loss_and_grads(1, x, y)
    got, grads = loss_and_grads(chunks, x, y)
    assert torch.equal(ref, cross_entropy_sum(build_model(CFG, seed=0)(x), y).detach())  # the plain loss
    assert abs(got - ref) / ref < 1e-5, (got, ref)
    assert_grads_close(grads, ref_grads, 1e-5)


def test_chunked_loss_under_autocast_recomputes_in_bf16():
    """The slices' logits are recomputed in backward under the forward's autocast state (bf16 here)."""
    g = torch.Generator().manual_seed(1)
    x, y = torch.randint(0, 1000, (2, 32), generator=g), torch.randint(0, 1000, (2, 32), generator=g)
    ref, ref_grads = loss_and_grads(1, x, y, autocast=True)
    got, grads = loss_and_grads(4, x, y, autocast=True)
    assert abs(got - ref) / ref < 1e-5, (got, ref)
    assert_grads_close(grads, ref_grads, 1e-2)  # bf16 head matmuls: each slice's gradient rounds on its own


@pytest.mark.parametrize("extra, needles", [
    (["parallel.tp=2"], ["train.loss_chunks", "parallel.tp", "parallel.sequence_parallel=false"]),
    (["parallel.pp=2", "train.grad_accum=2"], ["train.loss_chunks", "parallel.pp"]),
])
def test_loss_chunks_with_tp_or_pp_is_a_one_line_error(tmp_path, extra, needles):
    sets = [a for kv in ["train.loss_chunks=4", "model.n_layers=2", *extra] for a in ("--set", kv)]
    proc = run_cli("train", "--root", tmp_path, "--config", "llm_tiny", *sets)
    assert_one_line_error(proc, *needles)


@pytest.mark.parametrize("allow, precision", [(True, "high"), (False, "highest")])
def test_allow_tf32_sets_the_matmul_precision_on_cuda(monkeypatch, allow, precision):
    """No GPU here: CUDA's presence is mocked; the precision flag itself is torch's own."""
    from llmcluster.distributed.process_groups import pick_device

    before = torch.get_float32_matmul_precision()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", lambda i: None)
    try:
        cfg = JobConfig.model_validate({"train": {"allow_tf32": allow, "device": "cuda"}})
        assert pick_device(cfg, 0) == torch.device("cuda", 0)
        assert torch.get_float32_matmul_precision() == precision
    finally:
        torch.set_float32_matmul_precision(before)


@pytest.mark.slow
def test_fsdp_with_chunked_loss_matches_one_process_in_one_piece(tmp_path):
    """Through the CLI: 2 ranks FSDP2 with train.loss_chunks=4 (the head's weights gathered by the FSDP root,
    the slices recomputed in backward) against one process computing the loss in one piece."""
    from conftest import repo_source_dataset
    from test_parallel import assert_matches, losses, mesh, train

    root = repo_source_dataset(tmp_path / "s", 30)
    steps = ["--set", "train.stop_at=4"]
    train(root, "plain", 1, *mesh(1, 1), *steps)
    train(root, "chunked", 2, *mesh(1, 2), *steps, "--set", "train.loss_chunks=4")
    assert_matches(losses(root, "plain"), losses(root, "chunked"), range(1, 5))
