"""The attention core (QK^T, softmax, PV) priced on its own: its FLOPs as the kernel executes them and the
rate that kernel reaches at this GPU, head dimension and sequence length in published benchmarks
(plan/data/attention_kernels.yaml; docs/planning.md, section 2). Nothing here is fitted.

    time per token and layer = recomputes x 3.5 x forward FLOPs / rate(kernel, GPU, head dim, seq)

forward FLOPs = 4·s·H·Q / tp per token (halved with the causal mask by kernels that skip the masked
blocks: flash kernels; the unfused math path computes every score). 3.5 is the benchmarks' own count of a
forward + backward (the backward recomputes the scores: 2.5 forwards); a recomputed forward (full activation
checkpointing, or Korthikanti's attention-only recompute) adds one forward's FLOPs per recompute.
"""

from __future__ import annotations

import math

from llmcluster.plan.spec import PlanSpec
from llmcluster.plan.tables import attention_kernels

FAMILY = {"A100-40GB": "A100", "A100-80GB": "A100", "H100": "H100", "H200": "H100"}
A100_BF16_TFLOPS = 312.0   # the A100 table scales to GPUs without figures of their own by bf16 peak


def kernel(plan: PlanSpec) -> str:
    p = plan.parallel
    if p.attention_kernel != "auto":
        return p.attention_kernel
    return "fa2" if p.flash_attention else "math"


def _interp(xs: list[float], ys: list[float], x: float, log: bool) -> float:
    """Piecewise-linear (in log x when `log`), held flat outside the published range."""
    if x <= xs[0]:
        return ys[0]
    if x >= xs[-1]:
        return ys[-1]
    f = math.log if log else (lambda v: v)
    for i in range(1, len(xs)):
        if x <= xs[i]:
            t = (f(x) - f(xs[i - 1])) / (f(xs[i]) - f(xs[i - 1]))
            return ys[i - 1] + t * (ys[i] - ys[i - 1])
    return ys[-1]


def _rate(curves: dict, head_dim: int, seq: int, seqs: list[int]) -> float:
    dims = sorted(curves)
    at = [_interp(seqs, curves[d], seq, log=True) for d in dims]
    return _interp(dims, at, head_dim, log=False)


def rate_tflops(name: str, gpu: str, bf16_tflops: float, head_dim: int, seq: int) -> float:
    """Forward + backward TFLOP/s of kernel `name` (benchmark count) on this GPU."""
    t = attention_kernels()
    seqs, fam = t["seq"], FAMILY.get(gpu)
    if name in t["fwd_bwd"]:
        table = t["fwd_bwd"][name]
        if fam in table:
            return _rate(table[fam], head_dim, seq, seqs)
        return _rate(table["A100"], head_dim, seq, seqs) * bf16_tflops / A100_BF16_TFLOPS
    # fa3 / cudnn: published forward only (H100); fwd+bwd scaled from FlashAttention-2's by the forward ratio
    fwd = t["forward"]["H100"]
    ratio = _rate(fwd[name], head_dim, seq, seqs) / _rate(fwd["fa2"], head_dim, seq, seqs)
    return rate_tflops("fa2", gpu, bf16_tflops, head_dim, seq) * ratio


def forward_flops_per_token(plan: PlanSpec) -> float:
    """One layer's attention-core forward FLOPs per token on one GPU, as the kernel executes them."""
    m = plan.model
    causal = attention_kernels()["causal"][kernel(plan)]
    return 4 * m.seq_len * m.attn_dim / plan.parallel.tp / (2 if causal else 1)


def attention_seconds_per_token_layer(plan: PlanSpec) -> float:
    """Seconds one GPU spends in one layer's attention core per token, forward, backward and recompute."""
    p, spec = plan.parallel, plan.cluster.spec
    recomputes = p.recomputed_share + (1.0 if p.attention_recompute and p.recomputed_share < 1 else 0.0)
    flops = (3.5 + recomputes) * forward_flops_per_token(plan)
    rate = rate_tflops(kernel(plan), plan.cluster.gpu, spec.bf16_tflops, plan.model.head_dim, plan.model.seq_len)
    return flops / (rate * 1e12)
