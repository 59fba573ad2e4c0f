"""A training step's compute from bytes and shapes: GEMM time, attention time, memory-bound time, the optimizer step.

    GEMM time    = hardware matmul FLOPs of the linear layers / (achievable matmul rate x shape efficiency x residual)
    attention    = the attention core at its kernel's published rate (plan/attention.py; not fitted)
    memory time  = bytes the non-GEMM ops move / HBM bandwidth          (norms, RoPE, activation, residual
                                                                          adds, softmax/CE over the vocabulary)
    optimizer    = bytes of params, grads and AdamW states (+ clipping) / HBM bandwidth, once per step

The achievable matmul rate is the GPU table's `mamf_bf16_tflops` (ml-engineering's MAMF finder; scaled by
the datasheet ratio for other precisions, 80% of peak where the table has none). The shape efficiency
`d / (d + d_half)` of a GEMM's smallest non-token dimension d (on this GPU, after TP) makes narrow GEMMs
run below the achievable rate; `d_half`, `memory_passes` (how many times real kernels move the byte
table's bytes) and the residual per GPU family are fitted (calibration.fit_step_model) on published runs
that are not the ones the planner is validated on (docs/planning.md, section 2).
Everything here is torch-free; tests/test_plan_step_model.py checks the byte table against a meta-device
count of the trainer's own model.
"""

from __future__ import annotations

from dataclasses import dataclass

from llmcluster.plan.memory import CONVENTIONS, count_params, stage_params
from llmcluster.plan.spec import ModelSpec, PlanSpec
from llmcluster.plan.tables import step_model_constants

MAMF_FALLBACK = 0.8  # achievable / peak where the GPU table has no MAMF figure (H100/H200 measure 0.80)


_OVERRIDE: dict | None = None  # calibration.fit_step_model's trial constants while it searches


def fitted() -> dict:
    """The fitted constants (plan/data/step_model.yaml, written from calibration.fit_step_model)."""
    if _OVERRIDE is not None:
        return _OVERRIDE
    return step_model_constants()


# GPUs sharing a compute die share a fitted residual (the published runs are on A100s and H100s).
RESIDUAL_FAMILY = {"A100-40GB": "A100", "A100-80GB": "A100", "H100": "H100", "H200": "H100"}


def fitted_residual(gpu: str) -> tuple[float, str]:
    """(the fitted GEMM residual for this GPU, the family it comes from); a GPU without fit runs of its own
    family takes the mean of the fitted families'."""
    res = fitted()["residual"]
    fam = RESIDUAL_FAMILY.get(gpu)
    if fam in res:
        return res[fam], fam
    return sum(res.values()) / len(res), "mean of " + "/".join(res)


def shape_efficiency(d: float, d_half: float) -> float:
    return d / (d + d_half)


def achievable_tflops(plan: PlanSpec) -> float:
    spec, precision = plan.cluster.spec, plan.parallel.precision
    ratio = spec.mamf_bf16_tflops / spec.bf16_tflops if spec.mamf_bf16_tflops else MAMF_FALLBACK
    return spec.peak_tflops(precision) * ratio


def gemms(m: ModelSpec, tp: int) -> list[tuple[str, float, float]]:
    """(name, forward FLOPs per token, smallest non-token dimension on one GPU) of one block's matmuls.

    q, k, v are one fused GEMM (Megatron's). The attention core (QK^T, PV) is not among them: it is priced
    at its kernel's own rate (plan/attention.py).
    """
    d, hq, kvq = m.d_model, m.attn_dim, m.kv_heads * m.head_dim
    f_in = (2 if m.ffn_type == "swiglu" else 1) * m.ffn_hidden
    out = [("qkv", 2 * d * (hq + 2 * kvq) / tp, min(d, (hq + 2 * kvq) / tp)),
           ("attn_out", 2 * hq * d / tp, min(d, hq / tp)),
           ("mlp_in", 2 * d * f_in / tp, min(d, f_in / tp)),
           ("mlp_out", 2 * m.ffn_hidden * d / tp, min(d, m.ffn_hidden / tp))]
    return out


def block_gemm_efficiency(m: ModelSpec, tp: int, d_half: float) -> float:
    """FLOP-weighted shape efficiency of one block (the head's vocab GEMM is wide: efficiency of d)."""
    g = gemms(m, tp)
    return sum(f for _, f, _ in g) / sum(f / shape_efficiency(dim, d_half) for _, f, dim in g)


def memory_bytes_per_token(m: ModelSpec, tp: int, precision: str, flash: bool = True,
                           sequence_parallel: bool = True) -> dict[str, dict]:
    """The per-op byte table: bytes one GPU's HBM moves per token, forward and backward, per block (the
    first six) and per model (the last three). a = activation bytes (2 for 16-bit, 4 for fp32). Ops on the
    full hidden size are sharded by sequence parallelism (unless the plan turns it off), the rest by TP.

    op            forward                 backward
    rmsnorm x2    read x, write y: 2·h·a  read x, dy, write dx: 3·h·a
    residual x2   read 2, write 1: 3·h·a  gradient fan-in add: 3·h·a
    rope (q, k)   2·(HQ + kvQ)·a          2·(HQ + kvQ)·a
    activation    SwiGLU 3·f·a, GeLU 2·f·a   SwiGLU 5·f·a, GeLU 3·f·a
    softmax       flash: 0 (fused); else 2·H·s·a   3·H·s·a (the scores, per token and head)
    embedding     read row + write: 2·h·a        scatter-add into the fp32 gradient: 2·h·4
    final norm    2·h·a                          3·h·a
    cross-entropy bf16 logits -> fp32 (2+4), log-softmax (4+4), per vocab entry  gradient (4+4), -> 16-bit (4+2)
    """
    a = 4 if precision == "fp32" else 2
    h, hq, kvq, f = m.d_model, m.attn_dim, m.kv_heads * m.head_dim, m.ffn_hidden
    sp = tp if sequence_parallel else 1  # SP shards the norms and residual adds along the sequence
    act = (3, 5) if m.ffn_type == "swiglu" else (2, 3)
    per_layer = {
        "rmsnorm": (2 * 2 * h * a / sp, 2 * 3 * h * a / sp),
        "residual": (2 * 3 * h * a / sp, 2 * 3 * h * a / sp),
        "rope": (2 * (hq + kvq) * a / tp, 2 * (hq + kvq) * a / tp),
        "activation": (act[0] * f * a / tp, act[1] * f * a / tp),
        "softmax": (0.0, 0.0) if flash else (2 * m.n_heads * m.seq_len * a / tp, 3 * m.n_heads * m.seq_len * a / tp),
    }
    per_model = {
        "embedding": (2 * h * a / sp, 2 * h * 4 / sp),
        "final_norm": (2 * h * a / sp, 3 * h * a / sp),
        "cross_entropy": ((2 + 4 + 4 + 4) * m.vocab_size / tp, (4 + 4 + 4 + 2) * m.vocab_size / tp),
    }
    return {"per_layer": per_layer, "per_model": per_model}


def optimizer_bytes_per_param(convention: str) -> int:
    """AdamW (fused) and global-norm clipping, per parameter of this GPU's optimizer shard: read fp32
    param, grad, m, v and write param, m, v (24 + g); clipping reads the grads for the norm and scales
    them in place (3·g); a separate 16-bit weight copy is written back (2) unless the params are fp32
    (fsdp2 casts at all-gather)."""
    grad = CONVENTIONS[convention][1]
    return 24 + 4 * grad + (0 if convention == "fsdp2" else 2)


@dataclass
class Terms:
    gemm_s: float        # per optimizer step, the slowest pipeline rank, recomputation included
    attention_s: float   # the attention core (QK^T, softmax, PV), forward, backward and recompute
    memory_s: float
    optimizer_s: float
    gemm_efficiency: float   # the blocks' FLOP-weighted shape efficiency


def step_terms(plan: PlanSpec, hardware_flops_per_token: float, residual: float) -> Terms:
    """The compute terms of one optimizer step on one GPU of the slowest pipeline stage;
    `hardware_flops_per_token`: the linear layers' executed FLOPs (compute.gemm_flops_per_token)."""
    from llmcluster.plan.attention import attention_seconds_per_token_layer

    m, p, spec = plan.model, plan.parallel, plan.cluster.spec
    d_half = fitted()["d_half"]
    tokens = plan.global_batch * m.seq_len / plan.dp  # one model replica's (tp x pp GPUs) tokens per step
    layers = max(plan.stage_layer_counts)
    stage = layers / (m.n_layers / p.pp)
    eff = block_gemm_efficiency(m, p.tp, d_half)
    rate = achievable_tflops(plan) * 1e12 * eff * residual
    gemm = hardware_flops_per_token * tokens / (p.tp * p.pp) / rate * stage
    attention = tokens * layers * attention_seconds_per_token_layer(plan)
    # the softmax's bytes are in the attention kernels' published rates: not counted again here
    table = memory_bytes_per_token(m, p.tp, p.precision, True, p.sequence_parallel)
    bw = spec.memory_bw_gbps * 1e9
    fwd = sum(v[0] for v in table["per_layer"].values())
    bwd = sum(v[1] for v in table["per_layer"].values())
    per_layer = fwd * (1 + p.recomputed_share) + bwd
    ends = table["per_model"] if p.pp == 1 else {k: v for k, v in table["per_model"].items() if k != "embedding"}
    per_model = sum(f + b for f, b in ends.values())  # pp > 1: the last rank's (the head's side is the larger)
    # memory_passes: how many times real kernels move the table's bytes (1: perfectly fused; eager
    # PyTorch upcasts norms and softmax to fp32 and runs them as several kernels). Fitted.
    passes = 1.0 if p.fused_kernels else fitted().get("memory_passes", 1.0)
    memory = tokens * (layers * per_layer + per_model) * passes / bw
    shard = stage_params(count_params(m), p.tp, p.pp, True, layers)
    if plan.zero_stage >= 1:
        shard /= plan.shard_degree
    optimizer = shard * optimizer_bytes_per_param(p.memory_convention) / bw
    return Terms(gemm_s=gemm, attention_s=attention, memory_s=memory, optimizer_s=optimizer, gemm_efficiency=eff)
