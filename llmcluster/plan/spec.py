"""The plan file: model, cluster, parallel, training. Every section forbids unknown keys.

The cluster (and its cost) come from the one cluster spec (config/cluster.py); `PlanCluster` is the planner's view.

Cross-field rules (TP divides the heads, the mesh fits the cluster, the batch divides) are checked here so
a bad plan is one line naming the keys, before any arithmetic runs.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from llmcluster.config.cluster import ClusterSpec, Cost, Hardware, Reliability, Topology
from llmcluster.config.gpus import GPUSpec, gpu_spec, pcie_h2d_GBps
from llmcluster.config.schema import DistConfig, FtConfig, LogConfig, LoraConfig, ModelConfig, ParallelKeys
from llmcluster.errors import UserError


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ModelSpec(ModelConfig):
    """The training model (config/schema.py ModelConfig: the same keys, so a preset's `model:` section is a plan's
    model as it stands) extended with what planning also needs: other shapes (GELU MLPs, a head dimension other
    than d_model / n_heads, dropout), the sequence length trained at, and a published parameter count."""
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    name: str | None = None
    head_dim_override: int | None = Field(None, ge=1, alias="head_dim")  # None: d_model / n_heads (PaLM: 256)
    ffn_type: Literal["swiglu", "gelu"] = "swiglu"
    seq_len: int = Field(2048, ge=1)
    dropout: bool = False  # GPT-3-style models store dropout masks (Korthikanti's 34 includes them)
    params: int | None = Field(None, ge=1)  # a published count that overrides the one from the dims

    @model_validator(mode="after")
    def _heads(self):   # replaces ModelConfig's: a planned model need not be RoPE-shaped
        if self.head_dim_override is None and self.d_model % self.n_heads:
            raise ValueError(f"model.n_heads ({self.n_heads}) must divide model.d_model ({self.d_model})")
        if self.n_kv_heads is not None and self.n_heads % self.n_kv_heads:
            raise ValueError(f"model.n_kv_heads ({self.n_kv_heads}) must divide model.n_heads ({self.n_heads})")
        return self

    @property
    def head_dim(self) -> int:
        return self.head_dim_override or self.d_model // self.n_heads

    @property
    def attn_dim(self) -> int:
        """H·Q: heads x head dimension (= d_model unless head_dim says otherwise)."""
        return self.n_heads * self.head_dim


# The cluster spec's defaults are the planner's (one home for each figure, docs/cluster.md).
_TOPOLOGY, _RELIABILITY, _HARDWARE = Topology(), Reliability(), Hardware()


class PlanCluster(Section):
    """The planner's flat view of the cluster spec (llmcluster/config/cluster.py), built by `from_cluster`.

    Users never write this: a plan names its cluster (`cluster: seed-a100`, `cluster: {base: ..., ...}`, an
    inline cluster spec, or `--cluster FILE`), and the planner reads these fields from it."""
    gpu: str
    name: str | None = None                       # the cluster spec's name
    nodes: int = Field(1, ge=1)
    gpus_per_node: int = Field(8, ge=1)
    intra_node: Literal["nvlink", "pcie"] | None = None  # None: NVLink if the GPU has it
    intra_node_busbw_GBps: float | None = Field(None, gt=0)  # achieved all-reduce busbw GB/s; None: table
    fabric: str = "ib-ndr"                        # a key of data/hardware.yaml `fabrics`
    nics_per_node: int | None = Field(None, ge=1)  # None: one per GPU (rail-optimised)
    nic_GBps: float | None = Field(None, gt=0)    # achieved GB/s per NIC; None: the fabric's
    intra_latency_us: float = Field(_TOPOLOGY.intra_latency_us, ge=0)   # per collective step (assumption)
    inter_latency_us: float = Field(_TOPOLOGY.inter_latency_us, ge=0)
    switch_radix: int = Field(_TOPOLOGY.switch_radix, ge=4)
    storage_write_GBps: float = Field(10.0, gt=0)  # GB/s, aggregate, to the checkpoint store
    storage_read_GBps: float = Field(20.0, gt=0)
    node_power_kw: float | None = Field(None, gt=0)  # None: from GPU TDP x Epoch's server factor
    node_mtbf_hours: float = Field(_RELIABILITY.node_mtbf_hours, gt=0)   # per node; the job's MTBF is this / nodes
    restart_minutes: float = Field(_RELIABILITY.restart_minutes, ge=0)
    gpu_reserved_gib: float = Field(_HARDWARE.gpu_reserved_gib, ge=0)
    allocator_slack: float = Field(_HARDWARE.allocator_slack, ge=0)
    rack_kw: float = Field(_TOPOLOGY.rack_kw, gt=0)
    air_cooling_max_kw: float = Field(_TOPOLOGY.air_cooling_max_kw, gt=0)
    host_memory_gb: float | None = Field(None, gt=0)   # hardware.memory_gb: the fine-tuning table's offload
    pcie_gen: int | None = Field(None, ge=3, le=6)     # hardware.pcie_gen / pcie_lanes: None, the GPU table's link
    pcie_lanes: Literal[1, 2, 4, 8, 16] | None = None

    @field_validator("gpu")
    @classmethod
    def _known_gpu(cls, v: str) -> str:
        try:
            return gpu_spec(v).name
        except UserError as e:
            raise ValueError(f"cluster.hardware.gpu: {e}") from None

    @classmethod
    def from_cluster(cls, c: ClusterSpec) -> "PlanCluster":
        h, t = c.hardware, c.topology
        if h.spec is None:
            raise UserError(f"cluster {c.name}: hardware.gpu is none: the planner plans GPU clusters")
        fabric = h.fabric
        if fabric in ("none", "ethernet"):
            if c.node_count > 1:
                raise UserError(f"cluster {c.name}: {c.node_count} nodes on hardware.fabric {fabric}: the planner "
                                "has figures for ib-hdr, ib-ndr, roce-200 and roce-400 only")
            fabric = "none"   # one node: no inter-node traffic
        ckpt, data = c.storage.area("checkpoints"), c.storage.area("datasets")
        fields = dict(
            gpu=h.gpu, name=c.name, nodes=c.node_count, gpus_per_node=h.gpus_per_node, intra_node=h.intra_node,
            intra_node_busbw_GBps=h.intra_node_busbw_GBps, fabric=fabric,
            nics_per_node=h.nics_per_node or t.rails, nic_GBps=h.nic_GBps,
            intra_latency_us=t.intra_latency_us, inter_latency_us=t.inter_latency_us, switch_radix=t.switch_radix,
            storage_write_GBps=ckpt.write_GBps, storage_read_GBps=data.read_GBps, node_power_kw=h.node_power_kw,
            node_mtbf_hours=c.reliability.node_mtbf_hours, restart_minutes=c.reliability.restart_minutes,
            gpu_reserved_gib=h.gpu_reserved_gib, allocator_slack=h.allocator_slack, rack_kw=t.rack_kw,
            host_memory_gb=h.memory_gb, pcie_gen=h.pcie_gen, pcie_lanes=h.pcie_lanes,
            air_cooling_max_kw=t.air_cooling_max_kw)
        return cls(**{k: v for k, v in fields.items() if v is not None})

    @property
    def spec(self) -> GPUSpec:
        return gpu_spec(self.gpu)

    @property
    def total_gpus(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def pcie_h2d_GBps(self) -> float:
        """One GPU's achieved host->device GB/s on this cluster's link (hardware.pcie_gen / pcie_lanes)."""
        return pcie_h2d_GBps(self.spec, self.pcie_gen, self.pcie_lanes)

    @property
    def nics(self) -> int:
        return self.nics_per_node or self.gpus_per_node


class ParallelSpec(ParallelKeys):
    """The job config's layout keys, meaning what they mean to `llmcluster train` (`parallel.*` and
    `train.micro_batch / grad_accum / global_batch`), plus what only the cost model needs.

    dp_replicate x dp_shard is the data-parallel degree (-1: the rest of the cluster after tp x pp);
    dp_shard > 1 is FSDP (ZeRO-3; with fsdp_reshard_after_forward false ZeRO-2-like), dp_replicate > 1
    with dp_shard > 1 is HSDP, dp_shard 1 is DDP (ZeRO-0). activation_checkpoint selective recomputes every
    ac_every-th block whole (the trainer's meaning, not Korthikanti's: attention scores are never kept by
    SDPA/flash attention, `flash_attention`). `zero` costs the layouts of other trainers (Megatron's
    distributed optimizer is ZeRO-1): `plan` says when the trainer cannot run a plan.
    """
    dp_replicate: int = Field(1, ge=-1)
    dp_shard: int = Field(-1, ge=-1)
    tp: int = Field(1, ge=1)
    pp: int = Field(1, ge=1)
    pp_schedule: Literal["1F1B", "interleaved_1F1B"] = "1F1B"
    pp_virtual_stages: int | None = Field(None, ge=1)  # None: 1 (1F1B), 2 (interleaved)
    activation_checkpoint: Literal["none", "selective", "full"] = "none"
    ac_every: int = Field(2, ge=1)
    fsdp_reshard_after_forward: bool = True
    micro_batch: int = Field(1, ge=1)   # sequences per GPU per forward
    grad_accum: int | None = Field(None, ge=1)    # micro-batches per step; None: global_batch / (micro x dp)
    global_batch: int | None = Field(None, ge=1)  # sequences per optimizer step; None: micro x accum x dp
    zero: Literal[0, 1, 2, 3] | None = None       # None: what the keys above give (see `zero_stage`)
    flash_attention: bool = True
    # The attention kernel whose published fwd+bwd rate prices the attention core (plan/attention.py):
    # auto is FlashAttention-2 with flash_attention, else the unfused math path.
    attention_kernel: Literal["auto", "fa1", "fa2", "fa3", "cudnn", "math"] = "auto"
    # Korthikanti et al.'s selective recompute: the attention core (QK^T, softmax, PV) is recomputed in
    # backward and its scores are never kept (not the trainer's `selective`, which recomputes whole blocks).
    attention_recompute: bool = False
    # TP collectives overlapped with the GEMMs (torchtitan's async TP, Megatron's tp_comm_overlap); the 2022
    # Megatron runs had none.
    tp_overlap: bool = False
    # The framework fuses the memory-bound ops (Megatron-LM's defaults: fused layernorm, bias-GeLU,
    # bias-dropout-add, scale-mask-softmax): they move the byte table's bytes once (memory_passes 1) instead of
    # the fitted memory_passes of eager PyTorch.
    fused_kernels: bool = False
    # ZeRO-1 (Megatron-LM's distributed optimizer) traffic overlapped per bucket (its overlap_grad_reduce +
    # overlap_param_gather):
    # gradients reduced while the last backward runs, parameters gathered under the next step's first forward;
    # only the last (first) bucket waits. Off: the gradient reduction overlaps the backward, the ZeRO
    # parameter all-gather is exposed whole.
    dp_overlap: bool = False
    # Sequence parallelism with TP (Korthikanti et al.): norms, dropout and residuals sharded along the sequence.
    # false: Megatron's layouts before it (TP only, norms replicated; the published no-SP activation figures),
    # as the trainer's parallel.sequence_parallel.
    sequence_parallel: bool = True
    # FSDP2's CPUOffloadPolicy, as the trainer's parallel.fsdp_offload: sharded parameters, gradients and optimizer
    # states in host memory, the optimizer step on the CPU (costed by the fine-tuning model, plan/finetune.py)
    fsdp_offload: bool = False
    precision: Literal["bf16", "fp16", "fp8", "fp32"] = "bf16"
    memory_convention: Literal["zero-paper", "megatron", "fsdp2", "deepspeed"] = "zero-paper"

    @property
    def recomputed_share(self) -> float:
        """The share of blocks recomputed whole in backward."""
        return {"none": 0.0, "full": 1.0}.get(self.activation_checkpoint, 1 / self.ac_every)


class TrainingSpec(Section):
    tokens: float = Field(1e12, gt=0)
    mfu: float | None = Field(None, gt=0, le=1)        # override the calibrated efficiency model
    goodput: float | None = Field(None, gt=0, le=1)    # override the restart/checkpoint model
    # Slow steps (stragglers, stalled reads, hangs that recover) as a share of wall time. None: the fitted
    # share per doubling of the nodes (plan/data/step_model.yaml); measure yours with `llmcluster jobs goodput`
    # (its hang_or_straggler bucket) and set it.
    straggler_share: float | None = Field(None, ge=0, lt=1)
    # What is trained, as the job config's train.lora and train.optimizer: adapters on a frozen base (LoRA; QLoRA
    # with lora.base_precision nf4) and the optimizer's states. Either, or parallel.fsdp_offload, makes the plan a
    # fine-tuning plan: `plan` sizes that method (plan/finetune.py) instead of pre-training's layout.
    lora: LoraConfig | None = None
    optimizer: Literal["adamw", "adamw8bit", "adamw4bit"] = "adamw"


class EvalSpec(Section):
    """In-training evaluation, as the job config's log.eval_interval / log.eval_batches (their defaults)."""
    interval_steps: int = Field(LogConfig.model_fields["eval_interval"].default, ge=1)
    batches: int = Field(LogConfig.model_fields["eval_batches"].default, ge=0)


class PlanSpec(Section):
    model: ModelSpec
    cluster: PlanCluster
    parallel: ParallelSpec = ParallelSpec()
    training: TrainingSpec = TrainingSpec()
    eval: EvalSpec = EvalSpec()
    cost: Cost = Cost()             # the cluster spec's `cost:` (load_plan copies it here)
    # per-step fault tolerance (torchft), the job config's own section: the dp_replicate replicas are the
    # replica groups; the plan predicts goodput with and without it (plan/checkpoint.py ft_recovery)
    ft: FtConfig = FtConfig()
    # the job config's dist: section: dist.timeout_s is how long the restart path takes to notice a hung rank (its
    # process group's collectives time out), as ft.timeout_s is ft's (plan/checkpoint.py failure_s)
    dist: DistConfig = DistConfig()

    @model_validator(mode="after")
    def _mesh(self):
        m, c, p = self.model, self.cluster, self.parallel
        if m.n_heads % p.tp:
            raise ValueError(f"parallel.tp ({p.tp}) must divide model.n_heads ({m.n_heads})")
        if p.tp > m.kv_heads and p.tp % m.kv_heads:
            raise ValueError(f"parallel.tp ({p.tp}) and the kv heads ({m.kv_heads}) must divide one another")
        stages = p.pp * p.virtual_stages
        if stages > m.n_layers:  # uneven stages are fine (config/stages.py); empty ones are not
            raise ValueError(f"parallel.pp x virtual stages ({stages}) exceeds model.n_layers ({m.n_layers})")
        model_parallel = p.tp * p.pp
        if c.total_gpus % model_parallel:
            raise ValueError(f"parallel.tp x pp ({model_parallel}) must divide the cluster's "
                             f"{c.total_gpus} GPUs (cluster nodes x hardware.gpus_per_node)")
        rest = c.total_gpus // model_parallel
        r, s = p.dp_replicate, p.dp_shard
        known = (r if r > 0 else 1) * (s if s > 0 else 1)
        if known > rest or (r > 0 and s > 0 and known != rest) or rest % known:
            raise ValueError(f"parallel tp x pp x dp_replicate x dp_shard = {model_parallel * known} GPUs but "
                             f"the cluster has {c.nodes} nodes x {c.gpus_per_node} = {c.total_gpus} "
                             "(set dp_replicate or dp_shard to -1 to take the rest)")
        dp, gb = self.dp, p.global_batch
        if gb is not None and gb % (p.micro_batch * dp):
            raise ValueError(f"parallel.global_batch ({gb}) must be a multiple of "
                             f"micro_batch x dp ({p.micro_batch} x {dp})")
        if gb is not None and p.grad_accum is not None and gb != p.micro_batch * p.grad_accum * dp:
            raise ValueError(f"parallel.global_batch ({gb}) must equal micro_batch x grad_accum x dp "
                             f"({p.micro_batch} x {p.grad_accum} x {dp})")
        if self.ft.enabled:
            groups = self.dp_degrees[0]
            if c.nodes % groups:   # as the launchers: each group is a torchrun world of whole nodes
                raise ValueError(f"ft.enabled: the cluster's {c.nodes} nodes do not split evenly into "
                                 f"{groups} replica groups (parallel.dp_replicate)")
            if self.ft.min_replicas > groups:
                raise ValueError(f"ft.min_replicas ({self.ft.min_replicas}) is more than the replica groups "
                                 f"(parallel.dp_replicate = {groups})")
        if p.precision == "fp8" and c.spec.fp8_tflops is None:
            raise ValueError(f"parallel.precision fp8: {c.gpu} has no fp8 tensor cores")
        if self.finetune and (p.tp > 1 or p.pp > 1 or p.zero is not None):
            raise ValueError("training.lora, training.optimizer and parallel.fsdp_offload are planned with FSDP "
                             "over every GPU (the trainer's fine-tuning layout): drop parallel.tp, pp and zero")
        return self

    @property
    def finetune(self) -> bool:
        """Whether the plan names a fine-tuning method (adapters, low-bit optimizer states or offload): `plan`
        then sizes that method's row of the fine-tuning table instead of pre-training's layout."""
        t = self.training
        return t.lora is not None or t.optimizer != "adamw" or self.parallel.fsdp_offload

    @property
    def dp_degrees(self) -> tuple[int, int]:
        """(dp_replicate, dp_shard) with the -1 resolved against the cluster."""
        p = self.parallel
        rest = self.cluster.total_gpus // (p.tp * p.pp)
        r, s = p.dp_replicate, p.dp_shard
        return (rest // s, s) if r == -1 else (r, rest // r if s == -1 else s)

    @property
    def dp(self) -> int:
        r, s = self.dp_degrees
        return r * s

    @property
    def zero_stage(self) -> int:
        """The ZeRO stage the layout amounts to: FSDP is 3 (2 when weights stay gathered between forward
        and backward), DDP 0; `parallel.zero` (another trainer's layout) overrides."""
        return self.parallel.zero if self.parallel.zero is not None else self.zero_stage_from_keys()

    @property
    def shard_degree(self) -> int:
        """Ranks the sharded states are split over: dp_shard (HSDP replicates across dp_replicate), or
        every data-parallel rank for an explicit `parallel.zero`."""
        return self.dp if self.parallel.zero is not None else self.dp_degrees[1]

    @property
    def world(self) -> int:
        return self.parallel.tp * self.parallel.pp * self.dp

    @property
    def global_batch(self) -> int:
        p = self.parallel
        return p.global_batch or p.micro_batch * (p.grad_accum or 1) * self.dp

    @property
    def micro_batches(self) -> int:
        """Micro-batches per optimizer step per pipeline (gradient accumulation steps)."""
        return self.global_batch // (self.parallel.micro_batch * self.dp)

    @property
    def stage_layer_counts(self) -> list[int]:
        """Transformer blocks on each pp rank (all its virtual stages), from the trainer's split."""
        from llmcluster.config.stages import stage_layers

        p = self.parallel
        split = stage_layers(self.model.n_layers, p.pp * p.virtual_stages)
        return [sum(len(split[r + v * p.pp]) for v in range(p.virtual_stages)) for r in range(p.pp)]

    def trainer_gaps(self) -> list[str]:
        """What `llmcluster train` cannot run in this plan (empty: it can)."""
        m, p = self.model, self.parallel
        r, s = self.dp_degrees
        gaps = []
        if p.zero is not None and p.zero != self.zero_stage_from_keys():
            gaps.append(f"parallel.zero={p.zero} (the trainer's data parallelism is DDP, FSDP or HSDP)")
        if p.tp > 1 and m.kv_heads % p.tp:
            gaps.append(f"tp {p.tp} does not divide the {m.kv_heads} kv heads")
        if (p.tp > 1 or p.pp > 1) and r > 1 and s == 1:
            gaps.append("tp or pp with plain replication (use dp_shard)")
        if p.pp > 1 and m.tie_embeddings:
            gaps.append("tied embeddings with pp > 1")
        if p.pp > 1 and p.pp_schedule == "1F1B" and self.micro_batches < p.pp:
            gaps.append(f"grad_accum {self.micro_batches} < pp {p.pp} (1F1B)")
        if (m.ffn_type != "swiglu" or m.head_dim not in (None, m.d_model // m.n_heads) or m.dropout
                or m.d_model % m.n_heads or (m.d_model // m.n_heads) % 2):
            gaps.append("the model is not a Llama shape (SwiGLU, an even head_dim = d_model / n_heads, no dropout)")
        if p.precision not in ("bf16", "fp16", "fp32", "fp8"):
            gaps.append(f"precision {p.precision}")
        if p.precision == "fp8" and (p.tp > 1 or p.pp > 1):  # train.float8 is refused with them (untested)
            gaps.append("fp8 with tp or pp")
        return gaps

    def zero_stage_from_keys(self) -> int:
        if self.dp_degrees[1] > 1:
            # under PP the trainer keeps each stage's blocks gathered for the whole step (train/pipeline.py)
            return 3 if self.parallel.fsdp_reshard_after_forward and self.parallel.pp == 1 else 2
        return 0
