"""Memory per GPU: parameters, model states under ZeRO/FSDP x TP x PP, activations, buffers.

Model states follow the ZeRO paper (Rajbhandari et al. 2020) with a selectable byte convention;
activations follow Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
Models", Table 2 and section 4, term by term so SwiGLU, GQA, flash attention and dropout-free models
change exactly the terms they change. Sources and worked examples: docs/planning.md.
"""

from __future__ import annotations

from dataclasses import dataclass

from llmcluster.plan.spec import ModelSpec, PlanSpec

GIB = 1024**3

# Bytes per parameter: (weights, gradients, optimizer states) before sharding.
CONVENTIONS = {
    "zero-paper": (2, 2, 12),  # fp16 weights + fp16 grads + fp32 master, Adam m, v (K = 12)
    "megatron": (2, 4, 12),    # bf16 weights + fp32 main grads + fp32 master, m, v
    "fsdp2": (4, 4, 8),        # fp32 sharded params + fp32 grads + Adam m, v; bf16 compute copy apart
    "deepspeed": (2, 2, 16),   # DeepSpeed's estimator: 16 = fp32 master, m, v and the fp32 grad copy
}


# ---------------------------------------------------------------------------------------------------
# Parameters


@dataclass(frozen=True)
class ParamCount:
    embedding: int
    output: int       # 0 when tied to the embedding
    per_layer: int
    n_layers: int
    final_norm: int

    @property
    def total(self) -> int:
        return self.embedding + self.output + self.per_layer * self.n_layers + self.final_norm

    @property
    def largest_layer(self) -> int:
        """The biggest unit that is ever whole on one GPU (a block, or the embedding)."""
        return max(self.per_layer, self.embedding, self.output)


def count_params(m: ModelSpec) -> ParamCount:
    """Llama/GPT-style decoder without biases: q, k, v, o; MLP; two norms per layer; final norm."""
    d, head_dim = m.d_model, m.attn_dim // m.n_heads
    attn = 2 * d * m.attn_dim + 2 * d * m.kv_heads * head_dim
    mlp = (3 if m.ffn_type == "swiglu" else 2) * d * m.ffn_hidden
    emb = m.vocab_size * d
    return ParamCount(embedding=emb, output=0 if m.tie_embeddings else emb,
                      per_layer=attn + mlp + 2 * d, n_layers=m.n_layers, final_norm=d)


def stage_params(pc: ParamCount, tp: int, pp: int, first: bool, blocks: int | None = None) -> float:
    """Parameters held by one GPU of the first (embedding) or last (output head) pipeline rank, which
    holds `blocks` transformer blocks (default: an even share).

    TP shards every matrix (vocab-parallel embedding and head); the tiny norm weights are counted as
    sharded too. A tied head still needs its own copy on the last stage when pp > 1.
    """
    layers = pc.per_layer * (pc.n_layers / pp if blocks is None else blocks)
    if pp == 1:
        return (layers + pc.embedding + pc.output + pc.final_norm) / tp
    if first:
        return (layers + pc.embedding) / tp
    return (layers + (pc.output or pc.embedding) + pc.final_norm) / tp


# ---------------------------------------------------------------------------------------------------
# Model states


def model_states(psi: float, dp: int, zero: int, convention: str = "zero-paper",
                 unit_params: float = 0.0) -> tuple[float, float, float]:
    """(weights, gradients, optimizer) bytes per GPU for `psi` parameters on this GPU.

    ZeRO stage 1 shards the optimizer states over the dp ranks, stage 2 also the gradients, stage 3
    (= FSDP full shard) everything. `unit_params` is the largest unit that is gathered whole under
    stage 3 (an FSDP block): fsdp2 holds it in bf16 twice (current + prefetched) plus its unsharded
    bf16 gradient; DeepSpeed's estimator adds 4 bytes x largest layer (params + grads in fp16) and keeps
    no other fp16 gradient at stage 3 (its 16 bytes include the fp32 gradient partition).
    """
    w, g, o = CONVENTIONS[convention]
    weights, grads, optim = w * psi, g * psi, o * psi
    if zero >= 1:
        optim /= dp
    if zero >= 2 and convention != "deepspeed":  # DeepSpeed's estimator keeps 2Ψ of fp16 grads here
        grads /= dp
    if zero == 2 and convention == "fsdp2":
        # FSDP2 without resharding after forward: fp32 shards, plus every block's bf16 copy gathered from
        # its forward until its backward (the ZeRO-2-like layout); gradients reduce-scattered per block.
        weights, grads = w * psi / dp + 2 * psi, g * psi / dp + 2 * unit_params
    if zero == 3:
        weights, grads = w * psi / dp, g * psi / dp
        if convention == "fsdp2":
            weights += 2 * 2 * unit_params
            grads += 2 * unit_params
        elif convention == "deepspeed":  # 18Ψ/N: sharded fp16 grads go straight into the fp32 copy
            weights += 2 * unit_params
            grads = 2 * unit_params
    return weights, grads, optim


def projection_fans(m: ModelSpec) -> dict[str, tuple[int, int]]:
    """(in, out) features of each projection of a block, by the names train.lora.targets uses."""
    d, kv = m.d_model, m.kv_heads * (m.attn_dim // m.n_heads)
    return {"q_proj": (d, m.attn_dim), "k_proj": (d, kv), "v_proj": (d, kv), "o_proj": (m.attn_dim, d),
            "gate_proj": (d, m.ffn_hidden), "up_proj": (d, m.ffn_hidden), "down_proj": (m.ffn_hidden, d)}


def lora_params(m: ModelSpec, rank: int, targets: tuple[str, ...] | list[str]) -> int:
    """Trainable parameters of LoRA adapters (train.lora): rank x (in + out) per targeted projection per
    layer, the shapes llmcluster/model/lora.py gives A (rank x in) and B (out x rank)."""
    fans = projection_fans(m)
    return m.n_layers * sum(rank * sum(fans[t]) for t in targets)


def lora_model_states(psi_base: float, psi_lora: float, dp: int, zero: int,
                      convention: str = "zero-paper") -> tuple[float, float, float]:
    """(weights, gradients, optimizer) bytes per GPU under LoRA: the frozen base holds weights only (sharded
    at stage 3); gradients and optimizer states exist for the adapters alone."""
    w, _, _ = CONVENTIONS[convention]
    base = w * psi_base / (dp if zero == 3 else 1)
    aw, ag, ao = model_states(psi_lora, dp, zero, convention)
    return base + aw, ag, ao


# ---------------------------------------------------------------------------------------------------
# Activations


def layer_activation_bytes(m: ModelSpec, seq: int, micro_batch: int, tp: int = 1, sp: bool = False,
                           recompute: str = "none", flash: bool = False) -> float:
    """Bytes one transformer layer keeps for backward, on one GPU (16-bit activations).

    Korthikanti et al. count, per layer, with s seq, b micro-batch, h hidden, a heads:
      kept whole under TP (sharded by SP): 2 layernorm inputs 4sbh, attention input 2sbh, MLP input 2sbh,
        2 dropout masks 2sbh                                   -> 10 sbh
      sharded by TP: Q, K 4sbh, V 2sbh, projection input 2sbh, MLP 16sbh (GeLU input + fc2 input)
                                                               -> 24 sbh
      attention scores: softmax output 2as^2b, dropout mask as^2b, dropout output 2as^2b -> 5as^2b
    giving sbh(34 + 5as/h) with no parallelism. A dropout-free model drops the masks (and the score
    dropout: 2as^2b remain); SwiGLU keeps gate, up and their product (6sbf instead of 4sbf); GQA shrinks
    K and V by kv_heads/heads; flash attention and selective recompute keep no scores at all.
    Full recompute keeps only the layer input, 2sbh (sharded by SP).
    """
    s, b, h, a = seq, micro_batch, m.d_model, m.n_heads
    sbh = s * b * h
    shard_replicated = tp if sp else 1
    if recompute == "full":
        return 2 * sbh / shard_replicated
    kv = m.kv_heads / m.n_heads
    mlp = (6 if m.ffn_type == "swiglu" else 4) * s * b * m.ffn_hidden
    replicated = (4 + 2 + 2 + (2 if m.dropout else 0)) * sbh
    sharded = (2 + 2 * kv + 2 * kv + 2) * sbh + mlp
    scores = 0.0 if (flash or recompute == "selective") else (5 if m.dropout else 2) * a * s * s * b
    return replicated / shard_replicated + (sharded + scores) / tp


def pipeline_factor(pp: int, micro_batches: int, schedule: str, virtual_stages: int) -> float:
    """Layers' worth of activations on the first stage, in units of L/pp layers (one stage's layers).

    1F1B: the first stage has min(pp, micro-batches) micro-batches in flight, i.e. L layers' worth when
    there are at least pp micro-batches. Interleaved: x (1 + (p-1)/(p*m)), m the virtual stages.
    """
    if pp == 1:
        return 1.0
    in_flight = min(pp, micro_batches)
    if schedule == "interleaved":
        return in_flight * (1 + (pp - 1) / (pp * virtual_stages))
    return float(in_flight)


def logits_bytes(m: ModelSpec, seq: int, micro_batch: int, tp: int) -> float:
    """The head's output kept for the loss: bf16 logits and their fp32 upcast (vocab-parallel)."""
    return (2 + 4) * seq * micro_batch * m.vocab_size / tp


# ---------------------------------------------------------------------------------------------------
# Per-GPU total


@dataclass
class MemoryReport:
    weights: float
    gradients: float
    optimizer: float
    activations: float
    buffers: float
    capacity: float
    stage: str                 # which pipeline stage is the peak: "only", "first", "last"
    activation_per_layer: float

    @property
    def total(self) -> float:
        return self.weights + self.gradients + self.optimizer + self.activations + self.buffers

    @property
    def fits(self) -> bool:
        return self.total <= self.capacity


def checkpointed_layer_bytes(m: ModelSpec, seq: int, micro_batch: int, tp: int, share: float,
                             flash: bool, sequence_parallel: bool = True) -> float:
    """Per-layer activations when a `share` of the blocks is recomputed whole (the trainer's AC: full is
    share 1, selective every k-th block 1/k); sequence parallelism with tp > 1 unless the plan turns it off
    (`parallel.sequence_parallel: false`, Megatron's layouts before SP)."""
    sp = tp > 1 and sequence_parallel
    kept = layer_activation_bytes(m, seq, micro_batch, tp, sp, "none", flash)
    return share * layer_activation_bytes(m, seq, micro_batch, tp, sp, "full", flash) + (1 - share) * kept


def plan_memory(plan: PlanSpec) -> MemoryReport:
    m, c, p = plan.model, plan.cluster, plan.parallel
    pc = count_params(m)
    per_layer = checkpointed_layer_bytes(m, m.seq_len, p.micro_batch, p.tp, p.recomputed_share,
                                         p.flash_attention or p.attention_recompute, p.sequence_parallel)
    blocks = plan.stage_layer_counts  # per pp rank: uneven splits allowed
    unit = pc.largest_layer / p.tp if p.memory_convention == "deepspeed" else pc.per_layer / p.tp
    schedule = "interleaved" if p.pp_schedule == "interleaved_1F1B" else "1f1b"

    def stage(first: bool) -> tuple[float, float, float, float]:
        layers = blocks[0] if first else blocks[-1]
        w, g, o = model_states(stage_params(pc, p.tp, p.pp, first, layers), plan.shard_degree,
                               plan.zero_stage, p.memory_convention, unit)
        if first:
            acts = per_layer * layers * pipeline_factor(p.pp, plan.micro_batches, schedule, p.virtual_stages)
        else:
            acts = per_layer * layers
        if not first or p.pp == 1:
            acts += logits_bytes(m, m.seq_len, p.micro_batch, p.tp)
        return w, g, o, acts

    candidates = {"only": stage(True)} if p.pp == 1 else {"first": stage(True), "last": stage(False)}
    name, (w, g, o, acts) = max(candidates.items(), key=lambda kv: sum(kv[1]))
    allocated = w + g + o + acts
    buffers = c.gpu_reserved_gib * GIB + c.allocator_slack * allocated
    return MemoryReport(weights=w, gradients=g, optimizer=o, activations=acts, buffers=buffers,
                        capacity=c.spec.memory_bytes, stage=name, activation_per_layer=per_layer)
