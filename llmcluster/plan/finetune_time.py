"""One fine-tuning step's time on one GPU (plan/finetune.py's rows): the step model's terms (plan/step_model.py,
plan/compute.py) for what a fine-tuning method executes, plus what offload adds.

    GEMM         the linear layers' FLOPs: full fine-tuning 6N (+2N a recomputed block); a frozen base needs no
                 weight gradient, so LoRA/QLoRA run 4N (+2N), plus the adapters' own 6 (+2) FLOPs a value
    attention    the attention core at its kernel's rate (unchanged: the input gradient flows through every block)
    memory-bound the byte table's ops, plus each frozen weight converted at every use: NF4 dequantized to bf16
                 (read 0.516 + write 2 bytes a value; torchao's linear_nf4 dequantizes in forward, recompute and
                 backward), an fp32 base cast to bf16 by autocast on one GPU (read 4 + write 2; forward and recompute)
    optimizer    the trainable shard's params, gradients (read + clipping) and states once per step over HBM; with
                 offload on the CPU at one core's measured fused AdamW rate (plan/data/hardware.yaml)
    FSDP comm    per micro-batch: the weights gathered in forward and again in backward (in their gathered dtype:
                 NF4 stays NF4), the trainable gradients reduce-scattered in fp32; prefetched one unit ahead, so only
                 what exceeds the compute, plus the first unit, is exposed (compute.py's ZeRO-3 rule)
    offload PCIe per micro-batch: each gather's input copied host -> device (the shard, twice) and each gradient
                 shard back, full duplex, at the cluster's PCIe rate (hardware.pcie_gen / pcie_lanes over the GPU
                 table's achieved Gen4/Gen5 x16 figure); overlapped as FSDP's own transfers are, on the same rule
"""

from __future__ import annotations

from dataclasses import dataclass

from llmcluster.plan.comm import collective_time, plan_links
from llmcluster.plan.compute import StepTime, flops_per_token, gemm_flops_per_token
from llmcluster.plan.finetune import BASE_BYTES, OPTIM_BYTES, Method, base_split
from llmcluster.plan.memory import count_params
from llmcluster.plan.spec import PlanSpec
from llmcluster.plan.step_model import fitted, fitted_residual, step_terms
from llmcluster.plan.tables import hardware


@dataclass
class FinetuneTime:
    step: StepTime          # dp_s holds every exposed transfer: FSDP's collectives and offload's PCIe copies
    pcie_s: float           # of step.dp_s: what offload's copies add
    pcie_bytes: float       # per GPU per step, both directions


def finetune_step(plan: PlanSpec, f: Method, weights_shard: float, grads_shard: float,
                  efficiency: float | None = None) -> FinetuneTime:
    """`weights_shard`, `grads_shard`: one GPU's sharded weight and gradient bytes (what offload keeps on the
    host); `efficiency`: the GEMM residual (None: the fitted one for this GPU)."""
    m, c, p = plan.model, plan.cluster, plan.parallel
    gpus, n_micro, share, layers = c.total_gpus, plan.micro_batches, p.recomputed_share, m.n_layers
    eff = efficiency if efficiency is not None else fitted_residual(c.gpu)[0]
    pc = count_params(m)
    adapters = f.adapters(m)
    linear = gemm_flops_per_token(m, share)       # (6 + 2 share) N: full training's linear layers
    model_flops = flops_per_token(m)
    if f.method != "full":
        linear = linear * (4 + 2 * share) / (6 + 2 * share) + (6 + 2 * share) * adapters
        model_flops += -gemm_flops_per_token(m, 0.0) / 3 + 6 * adapters
    terms = step_terms(plan, linear, eff)
    bw = c.spec.memory_bw_gbps * 1e9

    proj, _ = base_split(m)
    per_use, uses = 0.0, 0.0
    if f.base == "nf4":
        per_use, uses = BASE_BYTES["nf4"] + 2.0, 2 + share
    elif (f.base == "fp32" or f.method == "full") and gpus == 1 and p.precision != "fp32":
        per_use, uses = 4.0 + 2.0, 1 + share
    memory = terms.memory_s + n_micro * uses * proj * per_use * fitted().get("memory_passes", 1.0) / bw

    trainable = (pc.total if f.method == "full" else adapters) / gpus
    if f.offload:
        optimizer = trainable / hardware()["cpu_adamw_params_per_s"]
    else:
        optimizer = trainable * (8 + 16 + 2 * OPTIM_BYTES[f.optimizer]) / bw
    compute = terms.gemm_s + terms.attention_s + memory
    per_micro = compute / n_micro

    comm = 0.0
    if gpus > 1:
        link = plan_links(plan).dp
        base = pc.per_layer * layers * (BASE_BYTES["nf4"] if f.base == "nf4" else 2.0)
        gathered = base + 2.0 * (pc.embedding + pc.output + pc.final_norm) + 2.0 * adapters
        comm = (2 * collective_time("all_gather", gpus, gathered, link.busbw_GBps, link.latency_s)
                + collective_time("reduce_scatter", gpus, 4.0 * trainable * gpus, link.busbw_GBps, link.latency_s))
    pcie = pcie_bytes = 0.0
    if f.offload:
        h2d, d2h = 2 * weights_shard, grads_shard
        pcie_bytes = n_micro * (h2d + d2h)
        pcie = max(h2d, d2h) / (c.pcie_h2d_GBps * 1e9)

    def exposed(transfer: float) -> float:
        return n_micro * max(0.0, transfer - per_micro) + transfer / layers

    dp, with_pcie = exposed(comm), exposed(comm + pcie)
    step = compute + optimizer + with_pcie
    tps = plan.global_batch * m.seq_len / step / gpus
    peak = c.spec.peak_tflops(p.precision) * 1e12
    st = StepTime(step_s=step, compute_s=compute, gemm_s=terms.gemm_s, attention_s=terms.attention_s,
                  memory_s=memory, optimizer_s=optimizer, tp_s=0.0, dp_s=with_pcie, bubble_s=0.0, p2p_s=0.0,
                  tokens_per_s_per_gpu=tps, tflops_per_gpu=model_flops * tps / 1e12, mfu=model_flops * tps / peak,
                  efficiency=eff, gemm_efficiency=terms.gemm_efficiency)
    return FinetuneTime(step=st, pcie_s=with_pcie - dp, pcie_bytes=pcie_bytes)
