"""The small team's question (issue 55): for a model and a cluster, which fine-tuning methods fit, and how.

Methods: full fine-tuning, LoRA on an fp32 or bf16 frozen base, QLoRA (NF4 base), each with AdamW or 8-bit
AdamW states and with or without FSDP2's CPU offload. FSDP shards every state over all the cluster's GPUs.
Per GPU: the sharded states (weights, gradients, optimizer), FSDP's gathered blocks (current and prefetched, in
the compute precision), the activations (plan/memory.py's Korthikanti terms under the plan's activation
checkpointing, flash attention) and the logits, the GPU's reserve and the allocator's slack. Offload moves the
sharded states to the host (host RAM per node: its GPUs' shares) and sends each block's weights over PCIe at
every all-gather and each gradient back. The byte counts are those of the trainer's objects
(train/qlora.py BYTES_PER_PARAM, model/lora.py's adapters, torchao's AdamW8bit: one byte per moment value and a
fp32 scale per 256 values; tensors under 4096 values keep fp32 states, negligible here).
Pure Python: the planner never imports torch.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from llmcluster.plan.memory import (GIB, checkpointed_layer_bytes, count_params, logits_bytes, lora_params)
from llmcluster.plan.spec import ModelSpec, PlanSpec

# Bytes per parameter (as train/qlora.py counts them; nf4: 4 bits + an int8 scaler per 64 + fp32 per 256 scalers)
BASE_BYTES = {"fp32": 4.0, "bf16": 2.0, "nf4": 0.5 + 1 / 64 + 4 / (64 * 256)}
OPTIM_BYTES = {"adamw": 8.0, "adamw8bit": 2.0 + 2 * 4 / 256}   # two moments (+ their block scales)
METHODS = (("full", None), ("lora", "fp32"), ("lora", "bf16"), ("qlora", "nf4"))
LORA_RANK, LORA_TARGETS = 8, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass
class FinetuneRow:
    method: str             # full, lora-fp32, lora-bf16, qlora
    optimizer: str          # adamw, adamw8bit
    offload: bool
    weights_gb: float       # per GPU, on the GPU (0 of the sharded states when offloaded)
    gradients_gb: float
    optimizer_gb: float
    gathered_gb: float      # FSDP's unsharded blocks in flight
    activations_gb: float
    peak_gb: float          # everything on one GPU, with reserve and allocator slack
    capacity_gb: float
    fits: bool              # on the GPU, and (offload) in the node's host memory when the cluster spec gives it
    host_ram_gb: float      # per node: the offloaded states of its GPUs
    pcie_gb_per_step: float  # per GPU, host <-> device, offload only


def base_split(m: ModelSpec) -> tuple[int, int]:
    """(parameters that become NF4: the blocks' projections; the rest: embedding, head, norms)."""
    pc = count_params(m)
    proj = (pc.per_layer - 2 * m.d_model) * pc.n_layers
    return proj, pc.total - proj


def model_state_bytes(m: ModelSpec, method: str, base: str | None, optimizer: str, shards: int = 1,
                      rank: int = LORA_RANK, targets=LORA_TARGETS) -> tuple[float, float, float]:
    """(weights, gradients, optimizer) bytes on one of `shards` FSDP ranks (1: the whole model's)."""
    total = count_params(m).total
    if method == "full":
        return 4.0 * total / shards, 4.0 * total / shards, OPTIM_BYTES[optimizer] * total / shards
    proj, rest = base_split(m)
    frozen = proj * BASE_BYTES[base] + rest * (4.0 if base == "fp32" else 2.0)
    adapters = lora_params(m, rank, targets)
    optim = sum(m.n_layers * _state_bytes(n, optimizer) for n in adapter_sizes(m, rank, targets))
    return (frozen + 4.0 * adapters) / shards, 4.0 * adapters / shards, optim / shards


def adapter_sizes(m: ModelSpec, rank: int, targets) -> list[int]:
    """The values of each adapter tensor of one layer (A: rank x in, B: out x rank; plan/memory.py's shapes)."""
    return [rank * f for t in targets for f in _fan(m, t)]


def _fan(m: ModelSpec, target: str) -> tuple[int, int]:
    d, kv = m.d_model, m.kv_heads * (m.attn_dim // m.n_heads)
    return {"q_proj": (d, m.attn_dim), "k_proj": (d, kv), "v_proj": (d, kv), "o_proj": (m.attn_dim, d),
            "gate_proj": (d, m.ffn_hidden), "up_proj": (d, m.ffn_hidden), "down_proj": (m.ffn_hidden, d)}[target]


def _state_bytes(numel: int, optimizer: str) -> float:
    """AdamW's two moments of one tensor; torchao's 8-bit keeps fp32 ones for tensors under 4096 values or not
    a multiple of its 256-value blocks, and each quantized moment carries its own 256-entry fp32 code map."""
    if optimizer == "adamw8bit" and (numel < 4096 or numel % 256):
        return 8.0 * numel
    return OPTIM_BYTES[optimizer] * numel + (2 * 256 * 4 if optimizer == "adamw8bit" else 0)


def finetune_table(plan: PlanSpec, rank: int = LORA_RANK, targets=LORA_TARGETS) -> list[FinetuneRow]:
    m, c, p = plan.model, plan.cluster, plan.parallel
    gpus, spec = c.total_gpus, c.spec
    pc = count_params(m)
    per_layer_acts = checkpointed_layer_bytes(m, m.seq_len, p.micro_batch, 1, p.recomputed_share, flash=True)
    acts = per_layer_acts * m.n_layers + logits_bytes(m, m.seq_len, p.micro_batch, 1)
    rows = []
    for method, base in METHODS:
        for optimizer in OPTIM_BYTES:
            for offload in (False, True):
                w, g, o = model_state_bytes(m, method, base, optimizer, gpus, rank, targets)
                # FSDP's gathered blocks: the current and the prefetched one, in bf16 (NF4 for QLoRA's), plus
                # the block's unsharded gradient for a full fine-tune
                unit = pc.per_layer * (BASE_BYTES["nf4"] if base == "nf4" else 2.0)
                gathered = (2 * unit + (2.0 * pc.per_layer if method == "full" else 0.0)) if gpus > 1 else 0.0
                host = (w + g + o) * c.gpus_per_node if offload else 0.0
                pcie = 0.0
                if offload:
                    pcie = (w + g) * gpus          # every block's weights gathered in, each gradient out
                    w = g = o = 0.0
                allocated = w + g + o + gathered + acts
                peak = allocated * (1 + c.allocator_slack) + c.gpu_reserved_gib * GIB
                rows.append(FinetuneRow(
                    method=method if method != "lora" else f"lora-{base}", optimizer=optimizer, offload=offload,
                    weights_gb=w / 1e9, gradients_gb=g / 1e9, optimizer_gb=o / 1e9, gathered_gb=gathered / 1e9,
                    activations_gb=acts / 1e9, peak_gb=peak / 1e9, capacity_gb=spec.memory_gb,
                    fits=peak <= spec.memory_bytes and (c.host_memory_gb is None or host <= c.host_memory_gb * 1e9),
                    host_ram_gb=host / 1e9, pcie_gb_per_step=pcie / 1e9))
    return rows


def finetune_result(plan: PlanSpec) -> dict:
    c = plan.cluster
    return {"model": plan.model.name, "cluster": c.name, "gpu": c.gpu, "gpus": c.total_gpus,
            "seq_len": plan.model.seq_len, "micro_batch": plan.parallel.micro_batch,
            "activation_checkpoint": plan.parallel.activation_checkpoint, "lora_rank": LORA_RANK,
            "pcie_h2d_GBps": c.spec.pcie_h2d_GBps, "host_memory_gb": c.host_memory_gb,
            "rows": [asdict(r) for r in finetune_table(plan)]}


def render_finetune(result: dict) -> None:
    print(f"fine-tuning {result['model']} on {result['gpus']} x {result['gpu']} ({result['cluster']}): seq "
          f"{result['seq_len']}, micro-batch {result['micro_batch']}, activation checkpointing "
          f"{result['activation_checkpoint']}, LoRA rank {result['lora_rank']} on all projections, FSDP over all GPUs")
    print(f"{'method':<10} {'optimizer':<10} {'offload':<7} {'fits':<4} {'peak GB/GPU':>11} {'states GB':>9} "
          f"{'acts GB':>7} {'host GB/node':>12} {'PCIe GB/step':>12}")
    for r in result["rows"]:
        states = r["weights_gb"] + r["gradients_gb"] + r["optimizer_gb"]
        print(f"{r['method']:<10} {r['optimizer']:<10} {'yes' if r['offload'] else 'no':<7} "
              f"{'yes' if r['fits'] else 'no':<4} {r['peak_gb']:>11.1f} {states:>9.1f} {r['activations_gb']:>7.1f} "
              f"{r['host_ram_gb']:>12.1f} {r['pcie_gb_per_step']:>12.1f}")
