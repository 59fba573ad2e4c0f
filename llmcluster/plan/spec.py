"""The plan file: model, cluster, parallel, training, cost. Every section forbids unknown keys.

Cross-field rules (TP divides the heads, the mesh fits the cluster, the batch divides) are checked here so
a bad plan is one line naming the keys, before any arithmetic runs.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from llmcluster.config.gpus import GPUSpec, gpu_spec
from llmcluster.errors import UserError


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ModelSpec(Section):
    """A decoder-only transformer by its dimensions (a preset name is resolved into these)."""
    name: str | None = None
    n_layers: int = Field(ge=1)
    d_model: int = Field(ge=8)
    n_heads: int = Field(ge=1)
    n_kv_heads: int | None = Field(None, ge=1)   # None: = n_heads (multi-head attention)
    head_dim: int | None = Field(None, ge=1)     # None: d_model / n_heads (PaLM: 256 with d_model 18432)
    ffn_hidden: int = Field(ge=1)
    ffn_type: Literal["swiglu", "gelu"] = "swiglu"
    vocab_size: int = Field(ge=2)
    seq_len: int = Field(2048, ge=1)
    tie_embeddings: bool = False
    dropout: bool = False  # GPT-3-style models store dropout masks (Korthikanti's 34 includes them)
    params: int | None = Field(None, ge=1)  # a published count that overrides the one from the dims

    @model_validator(mode="after")
    def _heads(self):
        if self.head_dim is None and self.d_model % self.n_heads:
            raise ValueError(f"model.n_heads ({self.n_heads}) must divide model.d_model ({self.d_model})")
        if self.n_kv_heads is not None and self.n_heads % self.n_kv_heads:
            raise ValueError(f"model.n_kv_heads ({self.n_kv_heads}) must divide model.n_heads ({self.n_heads})")
        return self

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def attn_dim(self) -> int:
        """H·Q: heads x head dimension (= d_model unless head_dim says otherwise)."""
        return self.n_heads * (self.head_dim or self.d_model // self.n_heads)


class ClusterSpec(Section):
    gpu: str
    nodes: int = Field(1, ge=1)
    gpus_per_node: int = Field(8, ge=1)
    intra_node: Literal["nvlink", "pcie"] | None = None  # None: NVLink if the GPU has it
    intra_node_busbw_GBps: float | None = Field(None, gt=0)  # achieved all-reduce busbw GB/s; None: table
    fabric: str = "ib-ndr"                        # a key of data/hardware.yaml `fabrics`
    nics_per_node: int | None = Field(None, ge=1)  # None: one per GPU (rail-optimised)
    nic_GBps: float | None = Field(None, gt=0)    # achieved GB/s per NIC; None: the fabric's
    intra_latency_us: float = Field(10.0, ge=0)   # per collective step (assumption, see docs)
    inter_latency_us: float = Field(20.0, ge=0)
    switch_radix: int = Field(64, ge=4)           # QM9700 NDR: 64 ports
    storage_write_GBps: float = Field(10.0, gt=0)  # GB/s, aggregate, to the checkpoint store
    storage_read_GBps: float = Field(20.0, gt=0)
    node_power_kw: float | None = Field(None, gt=0)  # None: from GPU TDP x Epoch's server factor
    node_mtbf_hours: float = Field(50_000.0, gt=0)   # per node; the job's MTBF is this / nodes
    restart_minutes: float = Field(15.0, ge=0)      # lost per failure: requeue, load, warm up
    gpu_reserved_gib: float = Field(1.0, ge=0)      # CUDA context, cuBLAS/NCCL workspaces (assumption)
    allocator_slack: float = Field(0.05, ge=0)      # caching-allocator fragmentation, share of allocated
    rack_kw: float = Field(40.0, gt=0)              # power budget per rack
    air_cooling_max_kw: float = Field(40.0, gt=0)   # above this per rack: liquid cooling

    @field_validator("gpu")
    @classmethod
    def _known_gpu(cls, v: str) -> str:
        try:
            return gpu_spec(v).name
        except UserError as e:
            raise ValueError(f"cluster.gpu: {e}") from None

    @property
    def spec(self) -> GPUSpec:
        return gpu_spec(self.gpu)

    @property
    def total_gpus(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def nics(self) -> int:
        return self.nics_per_node or self.gpus_per_node


class ParallelSpec(Section):
    tp: int = Field(1, ge=1)
    pp: int = Field(1, ge=1)
    dp: int | None = Field(None, ge=1)  # None: the rest of the cluster
    zero: Literal[0, 1, 2, 3] = 3       # 3 = FSDP full shard
    sequence_parallel: bool = False
    recompute: Literal["none", "selective", "full"] = "none"
    micro_batch: int = Field(1, ge=1)   # sequences per GPU per forward
    global_batch: int | None = Field(None, ge=1)  # sequences per optimizer step; None: micro x dp
    pp_schedule: Literal["1f1b", "interleaved"] = "1f1b"
    virtual_stages: int = Field(1, ge=1)
    flash_attention: bool = True
    precision: Literal["bf16", "fp16", "fp8", "fp32"] = "bf16"
    memory_convention: Literal["zero-paper", "megatron", "fsdp2", "deepspeed"] = "zero-paper"


class TrainingSpec(Section):
    tokens: float = Field(1e12, gt=0)
    mfu: float | None = Field(None, gt=0, le=1)        # override the calibrated efficiency model
    goodput: float | None = Field(None, gt=0, le=1)    # override the restart/checkpoint model


class CostSpec(Section):
    """Every price is optional: None takes it from the dated prices file (`prices`)."""
    prices: str | None = None                 # path to a prices YAML; None: the bundled one
    cloud_usd_per_gpu_hour: float | None = Field(None, gt=0)
    server_usd: float | None = Field(None, gt=0)     # one node, without the network
    network_fraction: float | None = Field(None, ge=0, lt=1)  # network share of the cluster's cost
    power_usd_per_kwh: float | None = Field(None, gt=0)
    pue: float | None = Field(None, ge=1)
    maintenance_per_year: float | None = Field(None, ge=0)  # fraction of capex per year
    colocation_usd_per_kw_month: float | None = Field(None, ge=0)
    staff_usd_per_month: float | None = Field(None, ge=0)
    utilisation: float | None = Field(None, gt=0, le=1)      # busy fraction of the on-prem cluster
    server_life_years: float | None = Field(None, gt=0)


class PlanSpec(Section):
    model: ModelSpec
    cluster: ClusterSpec
    parallel: ParallelSpec = ParallelSpec()
    training: TrainingSpec = TrainingSpec()
    cost: CostSpec = CostSpec()

    @model_validator(mode="after")
    def _mesh(self):
        m, c, p = self.model, self.cluster, self.parallel
        if m.n_heads % p.tp:
            raise ValueError(f"parallel.tp ({p.tp}) must divide model.n_heads ({m.n_heads})")
        if p.tp > m.kv_heads and p.tp % m.kv_heads:
            raise ValueError(f"parallel.tp ({p.tp}) and the kv heads ({m.kv_heads}) must divide one another")
        stages = p.pp * (p.virtual_stages if p.pp_schedule == "interleaved" else 1)
        if m.n_layers % stages:
            raise ValueError(f"parallel.pp x virtual_stages ({stages}) must divide model.n_layers ({m.n_layers})")
        if p.pp_schedule == "interleaved" and p.pp == 1:
            raise ValueError("parallel.pp_schedule 'interleaved' needs parallel.pp > 1")
        if p.sequence_parallel and p.tp == 1:
            raise ValueError("parallel.sequence_parallel needs parallel.tp > 1")
        model_parallel = p.tp * p.pp
        if p.dp is None:
            if c.total_gpus % model_parallel:
                raise ValueError(f"parallel.tp x pp ({model_parallel}) must divide the cluster's "
                                 f"{c.total_gpus} GPUs (cluster.nodes x gpus_per_node)")
        elif model_parallel * p.dp > c.total_gpus:
            raise ValueError(f"parallel tp x pp x dp = {model_parallel * p.dp} GPUs: more than the cluster has "
                             f"({c.nodes} nodes x {c.gpus_per_node} = {c.total_gpus})")
        dp = self.dp
        if p.global_batch is not None and p.global_batch % (p.micro_batch * dp):
            raise ValueError(f"parallel.global_batch ({p.global_batch}) must be a multiple of "
                             f"micro_batch x dp ({p.micro_batch} x {dp})")
        if p.precision == "fp8" and c.spec.fp8_tflops is None:
            raise ValueError(f"parallel.precision fp8: {c.gpu} has no fp8 tensor cores")
        return self

    @property
    def dp(self) -> int:
        p = self.parallel
        return p.dp if p.dp is not None else self.cluster.total_gpus // (p.tp * p.pp)

    @property
    def world(self) -> int:
        return self.parallel.tp * self.parallel.pp * self.dp

    @property
    def global_batch(self) -> int:
        return self.parallel.global_batch or self.parallel.micro_batch * self.dp

    @property
    def micro_batches(self) -> int:
        """Micro-batches per optimizer step per pipeline (gradient accumulation steps)."""
        return self.global_batch // (self.parallel.micro_batch * self.dp)
