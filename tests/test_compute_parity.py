"""Issue 36's changes to the math, each against the path it replaced: RMSNorm and RoPE in the compute dtype
(fp32 unchanged to the bit; bf16 within its rounding of the fp32 path), and the compiled blocks + loss
against eager (loss and every gradient). In-process, CPU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from llmcluster.config.schema import ModelConfig
from llmcluster.model.llama import RMSNorm, apply_rope, build_model, rope_cos_sin

CFG = ModelConfig(n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, ffn_hidden=128, vocab_size=512,
                  max_seq_len=64)
BF16_ULP = 2.0 ** -8   # bf16 keeps 8 significant bits: one rounding moves a value by at most this, relatively


def fp32_rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """The replaced RMSNorm: an fp32 copy normalised, rounded to x's dtype, then times the weight."""
    return w * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


def test_rms_norm_on_fp32_is_the_old_path_to_the_bit():
    g = torch.Generator().manual_seed(0)
    norm = RMSNorm(96, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(96, generator=g) + 0.5)
    x = torch.randn(3, 17, 96, generator=g).requires_grad_()
    new, old = norm(x), fp32_rms_norm(x, norm.weight, 1e-5)
    assert torch.equal(new, old)
    up = torch.randn(new.shape, generator=g)
    assert all(torch.equal(a, b) for a, b in zip(torch.autograd.grad(new, (x, norm.weight), up),
                                                 torch.autograd.grad(old, (x, norm.weight), up)))


def test_rms_norm_on_bf16_stays_bf16_within_one_rounding_of_fp32():
    """What stays fp32: the variance, the normalisation and the weight product inside the fused op; the result
    is rounded once to bf16 (HF's rounds twice: before and after the weight)."""
    g = torch.Generator().manual_seed(1)
    norm = RMSNorm(4096, 1e-5).to(torch.bfloat16)   # a wide row: a bf16 variance would be visibly off
    with torch.no_grad():
        norm.weight.copy_(torch.rand(4096, generator=g) + 0.5)
    x = (torch.randn(4, 4096, generator=g) * 3 + 1).to(torch.bfloat16)
    y = norm(x)
    ref = F.rms_norm(x.float(), (4096,), norm.weight.float(), 1e-5)
    assert y.dtype == torch.bfloat16
    assert ((y.float() - ref).abs() <= BF16_ULP * ref.abs()).all()
    old = fp32_rms_norm(x, norm.weight, 1e-5).float()
    assert (y.float() - ref).abs().max() <= (old - ref).abs().max()   # no worse than the path it replaced


def test_rope_in_bf16_is_within_two_roundings_of_fp32():
    """cos/sin rounded to bf16 once, then x·cos + rotate(x)·sin in bf16: each output within two bf16 roundings
    of the largest input magnitude of its row pair (the products and their sum round once each)."""
    g = torch.Generator().manual_seed(2)
    cos, sin = rope_cos_sin(64, 512, 500000.0)
    x = torch.randn(2, 4, 512, 64, generator=g).to(torch.bfloat16)
    got = apply_rope(x, cos.to(torch.bfloat16), sin.to(torch.bfloat16))
    ref = apply_rope(x.float(), cos, sin)
    assert got.dtype == torch.bfloat16
    scale = x.float().abs().amax(-1, keepdim=True)
    assert ((got.float() - ref).abs() <= 3 * BF16_ULP * scale).all()


@pytest.mark.parametrize("autocast, dtype", [(False, torch.float32), (True, torch.bfloat16)])
def test_rope_tables_come_in_the_compute_dtype(autocast, dtype):
    model = build_model(CFG, seed=0)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        cos, sin = model._rope(3, 10)
    assert cos.dtype == sin.dtype == dtype and cos.shape == (7, CFG.head_dim)
    assert torch.equal(cos.float(), model.rope_cos[3:10].to(dtype).float())


def test_the_model_under_autocast_stays_close_to_fp32():
    """Whole forward + backward under bf16 autocast (norms and RoPE now in bf16 there) against fp32."""
    g = torch.Generator().manual_seed(3)
    x, y = torch.randint(0, 512, (2, 64), generator=g), torch.randint(0, 512, (2, 64), generator=g)
    losses = {}
    for autocast in (False, True):
        model = build_model(CFG, seed=0)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = model(x, y)
        loss.backward()
        losses[autocast] = loss.detach()
    assert abs(float(losses[True]) - float(losses[False])) < 1e-2 * float(losses[False])


def loss_and_grads(model, x, y, chunks, autocast):
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = model(x, y, chunks) / y.numel()
    loss.backward()
    # a compiled block's parameters are named through its wrapper (layers.0._orig_mod.…)
    return float(loss.detach()), {n.replace("._orig_mod", ""): p.grad for n, p in model.named_parameters()}


@pytest.mark.slow
@pytest.mark.parametrize("chunks, autocast, rel", [(1, False, 1e-5), (3, False, 1e-5), (1, True, 2e-2),
                                                   (3, True, 2e-2)])
def test_compiled_blocks_and_loss_match_eager(chunks, autocast, rel):
    """apply_compile (the blocks, and the head's loss in one piece or in slices) against the eager model: the
    loss and each gradient within `rel` of its largest element (bf16: inductor fuses and rounds differently)."""
    from llmcluster.train.parallelize import apply_compile, compile_available

    if compile_available(torch.device("cpu")):
        pytest.skip("no C++ compiler for inductor")
    g = torch.Generator().manual_seed(4)
    x, y = torch.randint(0, 512, (2, 48), generator=g), torch.randint(0, 512, (2, 48), generator=g)
    y[0, :5] = -100
    ref_loss, ref = loss_and_grads(build_model(CFG, seed=0), x, y, chunks, autocast)
    compiled = build_model(CFG, seed=0)
    assert apply_compile(compiled, torch.device("cpu")) and compiled.compile_loss
    got_loss, got = loss_and_grads(compiled, x, y, chunks, autocast)
    assert abs(got_loss - ref_loss) < rel * ref_loss, (got_loss, ref_loss)
    errs = {n: float((got[n] - r).abs().max() / r.abs().max()) for n, r in ref.items()}
    assert max(errs.values()) < rel, errs
