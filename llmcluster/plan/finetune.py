"""The small team's question (issue 55): for a model and a cluster, which fine-tuning methods fit, and how.

Methods: full fine-tuning, LoRA on an fp32 or bf16 frozen base, QLoRA (NF4 base), each with AdamW or 8-bit
AdamW states and with or without FSDP2's CPU offload. FSDP shards every state over all the cluster's GPUs.
Per GPU: the sharded states (weights, gradients, optimizer), FSDP's gathered units (the current and the
prefetched block, and the root unit: embedding, final norm and head, which the trainer keeps gathered from
forward to backward, train/parallelize.py), the activations (plan/memory.py's Korthikanti terms under the plan's
activation checkpointing, flash attention; with checkpointing, the recomputed block's own activations while its
backward runs) and what the loss holds, the GPU's reserve and the allocator's slack. Offload moves the sharded
states to the host (host RAM per node: its GPUs' shares) and sends each block's weights over PCIe at every
all-gather and each gradient back. The byte counts are those of the trainer's objects (train/qlora.py
BYTES_PER_PARAM, model/lora.py's adapters, torchao's AdamW8bit/4bit: one byte / half a byte per moment value and a
fp32 scale per 256 / 128 values; tensors under 4096 values keep fp32 states). Step time and tokens/s:
plan/finetune_time.py. Other stacks' costs (the published rows' own recipes): `STACKS`.
Pure Python: the planner never imports torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from llmcluster.plan.memory import GIB, count_params, layer_activation_bytes, lora_params, projection_fans
from llmcluster.plan.spec import ModelSpec, PlanSpec

# Bytes per parameter (as train/qlora.py counts them; nf4: 4 bits + an int8 scaler per 64 + fp32 per 256 scalers)
BASE_BYTES = {"fp32": 4.0, "bf16": 2.0, "nf4": 0.5 + 1 / 64 + 4 / (64 * 256)}
# torchao.optim: (bytes per moment value, values per fp32 scale, entries of each moment's fp32 code map)
LOWBIT = {"adamw8bit": (1.0, 256, 256), "adamw4bit": (0.5, 128, 16)}
OPTIM_BYTES = {"adamw": 8.0, **{k: 2 * (v + 4 / block) for k, (v, block, _) in LOWBIT.items()}}  # two moments
METHODS = (("full", None), ("lora", "fp32"), ("lora", "bf16"), ("qlora", "nf4"))
TABLE_OPTIMIZERS = ("adamw", "adamw8bit")
LORA_RANK, LORA_TARGETS = 8, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class Stack:
    """What a training stack holds beyond the states: each a named cost of its code (docs/planning.md, "Fine-tuning:
    the published rows"). The planner plans `llmcluster`; the others are the published rows' own recipes."""
    label: str
    logits_bytes: float              # per (token x vocabulary entry), held at the loss
    adapter_bytes: float             # each adapter value, and its gradient
    adapter_state_bytes: float | None  # AdamW's two moments per adapter value; None: the optimizer's (OPTIM_BYTES)
    lora_dropout: bool               # each adapter keeps its dropped input (16-bit) and the dropout mask (1 byte)
    nf4_scales_whole: bool = False   # NF4's scales (all but the 4-bit codes) whole on every GPU, not sharded


STACKS = {
    # model/loss.py: bf16 logits and their fp32 upcast (plan/memory.py logits_bytes); adapters fp32 (model/lora.py)
    "llmcluster": Stack("llmcluster (FSDP2, torchao NF4)", 6.0, 4.0, None, False),
    # transformers 4.40 LlamaForCausalLM: `logits = logits.float()`, then `logits[..., :-1, :].contiguous()` and
    # CrossEntropyLoss's fp32 log-softmax, all three alive at the loss; peft 0.10 makes adapters in fp32 and runs
    # `lora_B(lora_A(dropout(x)))` (lora_dropout 0.05); adamw_torch keeps fp32 moments; bitsandbytes keeps each
    # weight's quant state (absmax: a uint8 per 64 values, fp32 per 256 of those) on the module, which FSDP neither
    # shards nor offloads (nn/modules.py fix_4bit_weight_quant_state_from_module: "the quant state got lost when the
    # parameter got converted. This happens for example for fsdp")
    "hf-peft": Stack("transformers 4.40 + peft 0.10 + bitsandbytes 0.43, FSDP1", 12.0, 4.0, 8.0, True, True),
    # torchtune 0.1: `self.output(h).float()`, the recipe's `logits[..., :-1, :].contiguous()` (the unshifted copy
    # freed) and the fp32 log-softmax; dtype bf16 builds adapters and AdamW's moments in bf16; lora_dropout 0.05
    "torchtune": Stack("torchtune 0.1 (lora_finetune_single_device, dtype bf16)", 8.0, 2.0, 4.0, True),
}


@dataclass
class FinetuneRow:
    method: str             # full, lora-fp32, lora-bf16, qlora
    optimizer: str          # adamw, adamw8bit, adamw4bit
    offload: bool
    weights_gb: float       # per GPU, on the GPU (0 of the sharded states when offloaded)
    gradients_gb: float
    optimizer_gb: float
    gathered_gb: float      # FSDP's unsharded units in flight: two blocks and the root (embedding, norm, head)
    activations_gb: float   # kept for backward, at the step's peak (the loss, or the recomputed block)
    peak_gb: float          # everything on one GPU, with reserve and allocator slack
    capacity_gb: float
    fits: bool              # on the GPU, and (offload) in the node's host memory when the cluster spec gives it
    host_ram_gb: float      # per node: the offloaded states of its GPUs
    pcie_gb_per_step: float  # per GPU, host <-> device, offload only
    step_s: float           # one optimizer step (plan/finetune_time.py)
    tokens_per_s: float     # all GPUs together
    pcie_s: float           # of step_s: what offload's transfers leave exposed
    optimizer_s: float      # of step_s: the optimizer step (on the CPU with offload)
    trainer_gap: str | None = None   # why `llmcluster train` cannot run this row, if it cannot


@dataclass(frozen=True)
class Method:
    """One row's choice: what trains, on what base, with which states, offloaded or not."""
    method: str                  # full, lora, qlora
    base: str | None             # the frozen base's storage: fp32, bf16, nf4 (None: full)
    optimizer: str
    offload: bool
    rank: int = LORA_RANK
    targets: tuple[str, ...] = LORA_TARGETS

    @property
    def label(self) -> str:
        return f"lora-{self.base}" if self.method == "lora" else self.method

    def adapters(self, m: ModelSpec) -> int:
        return 0 if self.method == "full" else lora_params(m, self.rank, self.targets)


def plan_method(plan: PlanSpec) -> Method:
    """The method a fine-tuning plan names (training.lora, training.optimizer, parallel.fsdp_offload)."""
    lora, t = plan.training.lora, plan.training
    if lora is None:
        return Method("full", None, t.optimizer, plan.parallel.fsdp_offload)
    base = lora.base_precision
    return Method("qlora" if base == "nf4" else "lora", base, t.optimizer, plan.parallel.fsdp_offload, lora.rank,
                  tuple(lora.targets))


def base_split(m: ModelSpec) -> tuple[int, int]:
    """(parameters that become NF4: the blocks' projections; the rest: embedding, head, norms)."""
    pc = count_params(m)
    proj = (pc.per_layer - 2 * m.d_model) * pc.n_layers
    return proj, pc.total - proj


def model_state_bytes(m: ModelSpec, method: str, base: str | None, optimizer: str, shards: int = 1,
                      rank: int = LORA_RANK, targets=LORA_TARGETS,
                      stack: Stack = STACKS["llmcluster"]) -> tuple[float, float, float]:
    """(weights, gradients, optimizer) bytes on one of `shards` FSDP ranks (1: the whole model's)."""
    total = count_params(m).total
    if method == "full":
        return 4.0 * total / shards, 4.0 * total / shards, OPTIM_BYTES[optimizer] * total / shards
    proj, rest = base_split(m)
    frozen = proj * BASE_BYTES[base] + rest * (4.0 if base == "fp32" else 2.0)
    adapters = lora_params(m, rank, targets)
    if stack.adapter_state_bytes is not None:
        optim = stack.adapter_state_bytes * adapters
    else:
        optim = sum(m.n_layers * _state_bytes(n, optimizer) for n in adapter_sizes(m, rank, targets))
    return (frozen + stack.adapter_bytes * adapters) / shards, stack.adapter_bytes * adapters / shards, optim / shards


def adapter_sizes(m: ModelSpec, rank: int, targets) -> list[int]:
    """The values of each adapter tensor of one layer (A: rank x in, B: out x rank; plan/memory.py's shapes)."""
    fans = projection_fans(m)
    return [rank * f for t in targets for f in fans[t]]


def _state_bytes(numel: int, optimizer: str) -> float:
    """AdamW's two moments of one tensor; torchao's low-bit ones keep fp32 moments for tensors under 4096 values or
    not a multiple of their blocks, and each quantized moment carries its own fp32 code map."""
    if optimizer not in LOWBIT:
        return OPTIM_BYTES[optimizer] * numel
    _, block, codes = LOWBIT[optimizer]
    if numel < 4096 or numel % block:
        return 8.0 * numel
    return OPTIM_BYTES[optimizer] * numel + 2 * codes * 4


def activation_bytes(plan: PlanSpec, f: Method, stack: Stack) -> float:
    """What one GPU keeps for backward at the step's peak (16-bit activations, flash attention): the checkpointed
    blocks' inputs (or every block's activations without checkpointing), then the larger of what the loss holds and
    the recomputed block's own activations while its backward runs."""
    m, p = plan.model, plan.parallel
    s, b, share = m.seq_len, p.micro_batch, p.recomputed_share
    kept = layer_activation_bytes(m, s, b, 1, False, "none", True)
    if stack.lora_dropout and f.method != "full":   # each adapter's dropped input and its mask
        kept += sum(projection_fans(m)[t][0] for t in f.targets) * s * b * (2 + 1)
    stored = m.n_layers * (share * layer_activation_bytes(m, s, b, 1, False, "full", True) + (1 - share) * kept)
    return stored + max(stack.logits_bytes * s * b * m.vocab_size, kept if share > 0 else 0.0)


def gathered_bytes(plan: PlanSpec, f: Method) -> float:
    """FSDP's unsharded units on one GPU (none on one GPU): the current and the prefetched block in the compute
    precision (NF4 stays NF4), a full fine-tune's unsharded block gradient, and the root unit (embedding, final norm,
    head) in bf16, kept gathered from forward to backward (the trainer's and FSDP1's root alike)."""
    if plan.cluster.total_gpus == 1:
        return 0.0
    pc = count_params(plan.model)
    block = pc.per_layer * (BASE_BYTES["nf4"] if f.base == "nf4" else 2.0)
    root = 2.0 * (pc.embedding + pc.output + pc.final_norm)
    return 2 * block + (2.0 * pc.per_layer if f.method == "full" else 0.0) + root


def trainer_gap(plan: PlanSpec, f: Method) -> str | None:
    if f.offload and plan.cluster.total_gpus == 1:
        return "parallel.fsdp_offload needs FSDP over 2+ GPUs (the trainer refuses it with dp_shard 1)"
    return None


def checkpoint_bytes(plan: PlanSpec) -> float:
    """What a checkpoint of the plan's method holds, the whole model's: its weights and optimizer states (the
    trainer's DCP state: fp32 weights of a full run; a LoRA run's frozen base as stored, its adapters fp32); an NF4
    run leaves its frozen base out (checkpointer.skip_frozen: a resume quantizes init_from again)."""
    f = plan_method(plan)
    w, g, o = model_state_bytes(plan.model, f.method, f.base, f.optimizer, 1, f.rank, f.targets)
    return (g if f.base == "nf4" else w) + o      # an NF4 run's trained weights: its adapters, g's bytes exactly


def detail(plan: PlanSpec, f: Method, efficiency: float | None = None, stack: str = "llmcluster"):
    """(the row of method `f` on this plan's model, cluster and batch: memory per GPU and per node and its step
    time; the step's terms, plan/finetune_time.FinetuneTime)."""
    from llmcluster.plan.finetune_time import finetune_step

    m, c = plan.model, plan.cluster
    st = STACKS[stack]
    gpus = c.total_gpus
    w, g, o = model_state_bytes(m, f.method, f.base, f.optimizer, gpus, f.rank, f.targets, st)
    scales = 0.0
    if st.nf4_scales_whole and f.base == "nf4":   # whole on each GPU, not in the (offloaded) shards
        scales = base_split(m)[0] * (BASE_BYTES["nf4"] - 0.5)
        w -= scales / gpus
    host = (w + g + o) * c.gpus_per_node if f.offload else 0.0
    timing = finetune_step(plan, f, w, g, efficiency)
    if f.offload:
        w = g = o = 0.0
    w += scales
    gathered, acts = gathered_bytes(plan, f), activation_bytes(plan, f, st)
    peak = (w + g + o + gathered + acts) * (1 + c.allocator_slack) + c.gpu_reserved_gib * GIB
    fits = peak <= c.spec.memory_bytes and (c.host_memory_gb is None or host <= c.host_memory_gb * 1e9)
    row = FinetuneRow(
        method=f.label, optimizer=f.optimizer, offload=f.offload, weights_gb=w / 1e9, gradients_gb=g / 1e9,
        optimizer_gb=o / 1e9, gathered_gb=gathered / 1e9, activations_gb=acts / 1e9, peak_gb=peak / 1e9,
        capacity_gb=c.spec.memory_gb, fits=fits, host_ram_gb=host / 1e9, pcie_gb_per_step=timing.pcie_bytes / 1e9,
        step_s=timing.step.step_s, tokens_per_s=timing.step.tokens_per_s_per_gpu * gpus, pcie_s=timing.pcie_s,
        optimizer_s=timing.step.optimizer_s, trainer_gap=trainer_gap(plan, f) if stack == "llmcluster" else None)
    return row, timing


def finetune_row(plan: PlanSpec, f: Method, efficiency: float | None = None, stack: str = "llmcluster") -> FinetuneRow:
    return detail(plan, f, efficiency, stack)[0]


def finetune_table(plan: PlanSpec, efficiency: float | None = None, stack: str = "llmcluster") -> list[FinetuneRow]:
    """Every method x optimizer x offload on the plan's model, cluster and batch (the plan's LoRA rank and targets
    when it names them, else rank 8 on all seven projections)."""
    lora = plan.training.lora
    rank, targets = (lora.rank, tuple(lora.targets)) if lora else (LORA_RANK, LORA_TARGETS)
    return [finetune_row(plan, Method(method, base, optimizer, offload, rank, targets), efficiency, stack)
            for method, base in METHODS for optimizer in TABLE_OPTIMIZERS for offload in (False, True)]
