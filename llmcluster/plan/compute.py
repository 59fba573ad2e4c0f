"""Step time, throughput and MFU: the step model's compute terms plus the communication left exposed.

    step = GEMM + attention + memory-bound + optimizer + exposed TP collectives + exposed DP/ZeRO traffic
           + PP bubble + PP sends

GEMM, memory-bound and optimizer time come from bytes and shapes (`step_model.py`); the attention core
from its kernel's published rate (`attention.py`). `efficiency` is the
residual factor on the GEMMs' achievable rate (the GPU's MAMF x the shape efficiency): fitted once on
published runs (`calibration.fit_step_model`), or inverted from `llmcluster bench` records of this very
cluster or from a given `training.mfu`.
"""

from __future__ import annotations

from dataclasses import dataclass

from llmcluster.model.flops import matmul_params, train_flops_per_token
from llmcluster.plan.comm import collective_time, plan_links
from llmcluster.plan.memory import count_params, stage_params
from llmcluster.plan.spec import ModelSpec, PlanSpec
from llmcluster.plan.step_model import step_terms


def params(m: ModelSpec) -> int:
    return m.params or count_params(m).total


def flops_per_token(m: ModelSpec) -> float:
    """The package's one convention (model/flops.py, as bench and the trainer count): 6N + 12·L·H·Q·T with N the
    matmul parameters (no input embedding), so `plan --calibrate` compares like with like."""
    n = matmul_params(params(m), m.vocab_size * m.d_model, m.tie_embeddings)
    return train_flops_per_token(n, m.n_layers, m.attn_dim, m.seq_len)


def hardware_flops_per_token(m: ModelSpec, recomputed_share: float) -> float:
    """What the GPU actually executes: each block recomputed in backward repeats its forward (a third of
    its training FLOPs); full activation checkpointing is share 1, selective every k-th block 1/k."""
    return flops_per_token(m) * (1 + recomputed_share / 3)


def gemm_flops_per_token(m: ModelSpec, recomputed_share: float) -> float:
    """The linear layers' share of `hardware_flops_per_token`: without the attention core's 12·L·H·Q·T
    (priced on its own, attention.py)."""
    return hardware_flops_per_token(m, recomputed_share) - 12 * m.n_layers * m.attn_dim * m.seq_len * (
        1 + recomputed_share / 3)


def mfu(flops_per_token_: float, tokens_per_s: float, gpus: int, peak_tflops: float) -> float:
    return flops_per_token_ * tokens_per_s / (gpus * peak_tflops * 1e12)


@dataclass
class StepTime:
    step_s: float
    compute_s: float          # GEMM + attention + memory-bound (what the pipeline bubble idles a share of)
    gemm_s: float
    attention_s: float
    memory_s: float
    optimizer_s: float
    tp_s: float
    dp_s: float
    bubble_s: float
    p2p_s: float
    tokens_per_s_per_gpu: float
    tflops_per_gpu: float     # model FLOPs (MFU numerator), TFLOP/s
    mfu: float
    efficiency: float
    gemm_efficiency: float    # the blocks' shape efficiency (fraction of the GPU's achievable matmul rate)

    def breakdown(self) -> dict[str, float]:
        """The step's terms, in seconds per optimizer step: they add up to step_s."""
        return {"gemm": self.gemm_s, "attention": self.attention_s, "memory_bound": self.memory_s,
                "optimizer": self.optimizer_s, "tp_comm": self.tp_s, "dp_comm": self.dp_s,
                "pp_bubble": self.bubble_s, "pp_p2p": self.p2p_s}


def step_time(plan: PlanSpec, efficiency: float) -> StepTime:
    m, c, p = plan.model, plan.cluster, plan.parallel
    links = plan_links(plan)
    world, dp, n_micro = plan.world, plan.dp, plan.micro_batches
    tokens_step = plan.global_batch * m.seq_len
    peak = c.spec.peak_tflops(p.precision) * 1e12
    # The slowest pipeline rank sets the pace (uneven stages: the one with the most blocks).
    terms = step_terms(plan, gemm_flops_per_token(m, p.recomputed_share), efficiency)
    compute = terms.gemm_s + terms.attention_s + terms.memory_s
    layers = max(plan.stage_layer_counts)
    per_micro = compute / n_micro
    act_bytes = 2 * m.seq_len * p.micro_batch * m.d_model  # one layer's input/output, 16-bit

    # TP: two all-reduces forward, two backward per layer (the same volume as SP's all-gather +
    # reduce-scatter); full recompute repeats the forward's two. On the critical path unless the plan
    # overlaps them with the GEMMs (`parallel.tp_overlap`: torchtitan's async TP, Megatron's
    # tp_comm_overlap), where only what exceeds the GEMM time stays exposed.
    tp = 0.0
    if p.tp > 1:
        per_layer = 4 + 2 * p.recomputed_share
        tp = n_micro * layers * per_layer * collective_time("all_reduce", p.tp, act_bytes, links.tp.busbw_GBps,
                                                            links.tp.latency_s)
        if p.tp_overlap:
            tp = max(0.0, tp - terms.gemm_s)

    # DP / ZeRO over the dp group, on the 16-bit gradients and parameters of this GPU's shard.
    grad_bytes = (4 if p.precision == "fp32" else 2) * stage_params(count_params(m), p.tp, p.pp, True, layers)
    t = lambda kind: collective_time(kind, dp, grad_bytes, links.dp.busbw_GBps, links.dp.latency_s)  # noqa: E731
    backward = per_micro * 2 / 3  # gradients are reduced in buckets while backward runs
    zero = plan.zero_stage
    # dp_overlap: per bucket (Megatron-LM's floor of 40M parameters): one bucket of each collective waits
    bucket = min(1.0, 40e6 * p.tp * p.pp / count_params(m).total) if p.dp_overlap else 1.0
    if zero == 3:
        # FSDP: all-gather before forward and before backward, reduce-scatter after, every micro-batch,
        # prefetched one block ahead: only what exceeds the compute, plus the first block, is exposed.
        per_micro_comm = 2 * t("all_gather") + t("reduce_scatter")
        dp_s = n_micro * max(0.0, per_micro_comm - per_micro) + per_micro_comm / layers
    elif zero == 2:
        dp_s = n_micro * max(0.0, t("reduce_scatter") - backward) + t("all_gather")
    elif zero == 1 and p.dp_overlap:
        forward = per_micro / 3
        dp_s = (max(0.0, t("reduce_scatter") - backward) + max(0.0, t("all_gather") - forward)
                + bucket * (t("reduce_scatter") + t("all_gather")))
    elif zero == 1:
        dp_s = max(0.0, t("reduce_scatter") - backward) + t("all_gather")
    else:
        dp_s = max(0.0, t("all_reduce") - backward)

    # PP: the bubble idles (p-1)/(v·m) of the pipelined work; each micro-batch crosses each stage
    # boundary twice (activation forward, gradient backward).
    bubble = p2p = 0.0
    if p.pp > 1:
        v = p.virtual_stages
        bubble = (p.pp - 1) / (v * n_micro) * (compute + tp)
        # Scatter/gather (Narayanan et al. 2021, arXiv 2104.04473, section 4.1): each TP rank sends its
        # 1/tp slice across the stage boundary; without SP the receiving stage all-gathers it over the TP link.
        sent = act_bytes / p.tp
        gather = 0.0 if p.sequence_parallel else collective_time("all_gather", p.tp, act_bytes,
                                                                 links.tp.busbw_GBps, links.tp.latency_s)
        p2p = 2 * n_micro * v * (sent / (links.pp.busbw_GBps * 1e9) + links.pp.latency_s + gather)

    step = compute + terms.optimizer_s + tp + dp_s + bubble + p2p
    tps = tokens_step / step / world
    f = flops_per_token(m)
    return StepTime(step_s=step, compute_s=compute, gemm_s=terms.gemm_s, attention_s=terms.attention_s,
                    memory_s=terms.memory_s,
                    optimizer_s=terms.optimizer_s, tp_s=tp, dp_s=dp_s, bubble_s=bubble, p2p_s=p2p,
                    tokens_per_s_per_gpu=tps, tflops_per_gpu=f * tps / 1e12, mfu=f * tps / peak,
                    efficiency=efficiency, gemm_efficiency=terms.gemm_efficiency)


def efficiency_for_mfu(plan: PlanSpec, target_mfu: float) -> float:
    """Invert step_time: the residual at which this plan reaches `target_mfu` (bisection; MFU rises
    monotonically with it). Capped at 1 (the GPU's achievable matmul rate at this shape): a target the
    model cannot reach returns 1."""
    lo, hi = 1e-3, 1.0
    if step_time(plan, hi).mfu <= target_mfu:
        return hi
    for _ in range(50):
        mid = (lo + hi) / 2
        if step_time(plan, mid).mfu < target_mfu:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2
