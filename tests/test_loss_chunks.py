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


def test_chunked_loss_under_autocast_matches_bf16_in_one_piece():
    """The slices' matmuls run in autocast's dtype (bf16 here), as the head in one piece does."""
    g = torch.Generator().manual_seed(1)
    x, y = torch.randint(0, 1000, (2, 32), generator=g), torch.randint(0, 1000, (2, 32), generator=g)
    ref, ref_grads = loss_and_grads(1, x, y, autocast=True)
    got, grads = loss_and_grads(4, x, y, autocast=True)
    assert abs(got - ref) / ref < 1e-5, (got, ref)
    assert_grads_close(grads, ref_grads, 1e-2)  # bf16 head matmuls: each slice's gradient rounds on its own


def head_matmul_flops(chunks: int, x, y) -> int:
    from torch.utils.flop_counter import FlopCounterMode

    model = build_model(CFG, seed=0)
    with FlopCounterMode(display=False) as count:
        model(x, y, chunks).backward()
    return count.get_total_flops()


def test_chunked_loss_does_not_recompute_the_head():
    """Forward + backward count the matmuls of the loss in one piece, not one head matmul more per slice
    (the checkpointed slices this replaced: 3 · 2·B·T·d·V more here)."""
    g = torch.Generator().manual_seed(2)
    x, y = torch.randint(0, 1000, (2, 48), generator=g), torch.randint(0, 1000, (2, 48), generator=g)
    assert head_matmul_flops(3, x, y) == head_matmul_flops(1, x, y)


class LargestLogits(torch.utils._python_dispatch.TorchDispatchMode):
    """The most elements of any tensor with a vocabulary-sized last dimension made while it is on, but the
    head's weight (V×d) and its transpose."""

    def __init__(self, vocab: int, dim: int = CFG.d_model):
        super().__init__()
        self.vocab, self.weight, self.most = vocab, vocab * dim, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.dim() and t.shape[-1] == self.vocab and t.numel() != self.weight:
                self.most = max(self.most, t.numel())
        return out


@pytest.mark.parametrize("autocast", [False, True])
def test_chunked_loss_holds_one_slice_of_logits_at_a_time(autocast):
    """No B·T·V tensor (logits, their fp32 copy, their gradient) exists in forward or backward: one slice's."""
    g = torch.Generator().manual_seed(3)
    x, y = torch.randint(0, 1000, (2, 32), generator=g), torch.randint(0, 1000, (2, 32), generator=g)
    model = build_model(CFG, seed=0)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast), LargestLogits(1000) as seen:
        model(x, y, 4).backward()
    assert seen.most == 2 * 32 // 4 * 1000, seen.most
    with LargestLogits(1000) as whole:   # the probe sees the loss in one piece
        build_model(CFG, seed=0)(x, y, 1).backward()
    assert whole.most == 2 * 32 * 1000


def test_chunked_loss_scales_by_the_incoming_gradient_and_skips_a_frozen_head():
    """The gradients are computed in forward, so backward must still honour what the caller did with the sum
    (the trainer divides it by tokens and accumulation steps); a frozen head gets no gradient."""
    g = torch.Generator().manual_seed(4)
    x, y = torch.randint(0, 1000, (2, 24), generator=g), torch.randint(0, 1000, (2, 24), generator=g)
    grads = {}
    for chunks in (1, 3):
        model = build_model(CFG, seed=0)
        model.lm_head.weight.requires_grad_(False)
        (model(x, y, chunks) / 7.5).backward()
        assert model.lm_head.weight.grad is None
        grads[chunks] = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    assert_grads_close(grads[3], grads[1], 1e-5)


def test_chunked_loss_without_gradients_is_the_plain_loss():
    g = torch.Generator().manual_seed(5)
    x, y = torch.randint(0, 1000, (2, 24), generator=g), torch.randint(0, 1000, (2, 24), generator=g)
    model = build_model(CFG, seed=0)
    with torch.no_grad():
        assert abs(float(model(x, y, 5)) - float(model(x, y, 1))) < 1e-5 * float(model(x, y, 1))


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
