"""The one job-config schema: run, model, data, train, parallel, checkpoint, log, dist, job, serve.

Every section forbids unknown keys so a typo is an error, not a silently ignored setting. Cross-field
rules that need the world size (batch divisibility by data-parallel degree) live in `train.mesh`, the
rest are checked here.
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from llmcluster.config.job import JobSpec
from llmcluster.config.serve import ServeConfig
from llmcluster.render import show_value

RUN_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}", re.ASCII)


def check_run_name(name: str) -> str:
    """Run names become directory names and shell words: letters, digits, '.', '_', '-' only."""
    if not RUN_NAME_RE.fullmatch(name) or ".." in name:
        raise ValueError(
            f"invalid run name {show_value(name)}: use letters, digits, '.', '_' and '-' "
            "(no '/', '..', spaces or shell metacharacters)")
    return name


class Section(BaseModel):
    # every number finite (issue 50): an infinite duration rendered `sleep inf` and overflowed timedelta
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, validate_assignment=True, populate_by_name=True)


class RunConfig(Section):
    name: str = "llm-tiny"
    storage: str | None = None  # None: $LLMCLUSTER_STORAGE, else the cluster spec's storage.root
    seed: int = 1337

    _check_name = field_validator("name")(classmethod(lambda cls, v: check_run_name(v)))


class RopeScaling(Section):
    """Llama 3's RoPE frequency scaling (HF rope_type "llama3"): long wavelengths stretched by `factor`."""
    rope_type: Literal["llama3"] = "llama3"
    factor: float = Field(gt=0)
    low_freq_factor: float = Field(gt=0)
    high_freq_factor: float = Field(gt=0)
    original_max_position_embeddings: int = Field(ge=1)


class ModelConfig(Section):
    """A Llama-style decoder. Defaults are the tiny CPU model."""
    n_layers: int = Field(4, ge=1)
    d_model: int = Field(256, ge=8)
    n_heads: int = Field(8, ge=1)
    n_kv_heads: int | None = Field(None, ge=1)  # None: = n_heads (multi-head attention)
    ffn_hidden: int = Field(768, ge=1)
    vocab_size: int = Field(8192, ge=2)
    max_seq_len: int = Field(2048, ge=1)
    rope_theta: float = Field(10000.0, gt=0)
    rope_scaling: RopeScaling | None = None
    norm_eps: float = Field(1e-5, gt=0)
    tie_embeddings: bool = False
    init_std: float = Field(0.02, gt=0)
    # Packed documents end in this token: attention stays inside each one (chat/SFT data sets it itself)
    doc_mask_id: int | None = Field(None, ge=0)

    @model_validator(mode="after")
    def _heads(self):
        if self.d_model % self.n_heads:
            raise ValueError(f"model.n_heads ({self.n_heads}) must divide model.d_model ({self.d_model})")
        if (self.d_model // self.n_heads) % 2:
            raise ValueError("model.d_model / model.n_heads must be even (RoPE rotates pairs)")
        if self.n_kv_heads is not None and self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"model.n_kv_heads ({self.n_kv_heads}) must divide model.n_heads ({self.n_heads})")
        return self

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


class DataConfig(Section):
    dataset: str = "stdlib"        # a name under datasets/<kind>/, or a path to a prepared dataset dir
    kind: Literal["code", "text", "multimodal"] = "code"
    seq_len: int = Field(256, ge=1)
    # {name: weight}: sample the datasets in proportion instead of `dataset` (names looked up in every kind)
    mixture: dict[str, float] | None = None

    @field_validator("mixture")
    @classmethod
    def _weights(cls, v):
        if v is not None:
            if not v:
                raise ValueError("data.mixture is empty: name at least one dataset")
            bad = [k for k, w in v.items() if not w > 0]
            if bad:
                raise ValueError(f"data.mixture: weight of {bad[0]!r} must be > 0")
        return v


LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class LoraConfig(Section):
    """Low-rank adapters (Hu et al. 2021): W x + (alpha / rank) B A x on the targeted projections; only A and
    B train (B starts at zero, so step 0 is the base model)."""
    rank: int = Field(8, ge=1)
    alpha: float = Field(16.0, gt=0)
    targets: list[Literal["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]] = \
        Field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"], min_length=1)
    # The frozen base's storage (train/qlora.py): fp32; bf16 (no fp32 copy of weights that never change); nf4
    # (QLoRA: torchao's 4-bit NormalFloat, from train.init_from's weights). The adapters stay fp32.
    base_precision: Literal["fp32", "bf16", "nf4"] = "fp32"


class Float8Config(Section):
    """float8 matmuls in the blocks' projections through torchao (train/float8.py; `pip install
    'llmcluster[float8]'`, sm89+): dynamic scales per tensor or per row; the LM head stays in high precision."""
    recipe: Literal["tensorwise", "rowwise"] = "tensorwise"
    emulate: bool = False   # tests only: the float8 casts emulated in high precision, so CPU runs them (no gain)


class TrainConfig(Section):
    steps: int = Field(1000, ge=1)
    stop_at: int | None = Field(None, ge=1)    # stop (with a checkpoint) here; the schedule spans `steps`
    micro_batch: int = Field(8, ge=1)          # sequences per rank per forward
    grad_accum: int = Field(1, ge=1)           # micro-batches per optimizer step
    global_batch: int | None = Field(None, ge=1)  # if set: must equal micro_batch * grad_accum * dp
    # A resume at another data-parallel degree keeps the checkpoint's global batch by adjusting grad_accum
    # (train/batch.py) or is refused; true trains on at this config's global batch instead.
    allow_batch_change: bool = False
    lr: float = Field(3e-4, ge=0)             # 0: a run that changes nothing (checks an import round trip)
    min_lr_ratio: float = Field(0.1, ge=0, le=1)
    warmup_steps: int = Field(100, ge=0)
    schedule: Literal["cosine", "linear", "constant"] = "cosine"
    weight_decay: float = Field(0.1, ge=0)
    beta1: float = Field(0.9, ge=0, lt=1)
    beta2: float = Field(0.95, ge=0, lt=1)
    eps: float = Field(1e-8, gt=0)
    grad_clip: float = Field(1.0, ge=0)        # 0 disables clipping
    precision: Literal["fp32", "bf16", "fp16"] = "bf16"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    compile: bool = False
    # cross-entropy in this many slices of the sequence, each slice's logits recomputed in backward: never
    # the whole B·T·V in fp32 (a 128k vocabulary); 1: in one piece
    loss_chunks: int = Field(1, ge=1)
    allow_tf32: bool = True                    # CUDA: fp32 matmuls and convolutions on TF32 tensor cores
    # Python's gc at the same steps on every rank, every this many (generation 1; train/gc_cadence.py); 0: its
    # automatic collection, at a different moment on each rank
    gc_interval: int = Field(50, ge=0)
    threads: int | None = Field(None, ge=1)    # torch intra-op threads per rank (CPU); None: cores / ranks
    max_bad_steps: int = Field(5, ge=1)        # non-finite steps in a row before the run stops
    spike_zscore: float | None = Field(None, gt=0)  # loss z-score over the window that counts as a spike
    spike_window: int = Field(100, ge=10)
    skip_spikes: bool = False
    init_from: str | None = None               # a local HF model dir: its config sets `model`, its weights step 0
    lora: LoraConfig | None = None             # train adapters only; the base weights stay frozen
    float8: Float8Config | None = None         # the plan's `precision: fp8`; train.precision is the rest's
    # AdamW's states: fp32, or 8-bit / 4-bit block-quantized (torchao.optim; train/optimizer.py)
    optimizer: Literal["adamw", "adamw8bit", "adamw4bit"] = "adamw"

    @property
    def last_step(self) -> int:
        """The step this run ends at: stop_at when it comes first, else steps."""
        return min(self.steps, self.stop_at) if self.stop_at else self.steps


def low_bit_lora_checks(cfg) -> None:
    """QLoRA's and the low-bit optimizers' refusals (train/qlora.py): each one line."""
    lora, t, p = cfg.train.lora, cfg.train, cfg.parallel
    if lora is not None and lora.base_precision == "nf4":
        for bad, what in ((p.tp > 1, "parallel.tp > 1"), (p.pp > 1, "parallel.pp > 1")):
            if bad:
                raise ValueError(f"train.lora.base_precision=nf4 with {what} is not supported: NF4's scales are "
                                 "per whole weight; shard the base with parallel.dp_shard (FSDP)")
        if cfg.ft.enabled:
            raise ValueError("train.lora.base_precision=nf4 with ft.enabled is not supported (untested: a heal copies "
                             "the model's state from a peer)")
        if not t.init_from:
            raise ValueError("train.lora.base_precision=nf4 needs train.init_from (the weights to quantize: a QLoRA "
                             "base is a trained model): --set train.init_from=DIR, a local Hugging Face model "
                             "directory")
    if lora is not None and lora.base_precision != "fp32" and p.pp > 1:
        raise ValueError(f"train.lora.base_precision={lora.base_precision} with parallel.pp > 1 is not supported "
                         "yet (the pipeline's stages are built apart): use fp32 or shard with parallel.dp_shard")
    if t.optimizer != "adamw" and t.precision == "fp16":
        raise ValueError(f"train.optimizer={t.optimizer} with train.precision=fp16 is not supported (the grad "
                         "scaler's unscale is untested with quantized states): use bf16")
    if p.fsdp_offload and p.dp_shard == 1:
        raise ValueError("parallel.fsdp_offload needs FSDP (parallel.dp_shard > 1 or -1): without FSDP there is "
                         "nothing to offload")


def check_parallel_keys(p) -> None:
    """The rules the trainer's `parallel:` and the plan's share: one home, so plan and train agree.
    `sequence_parallel` has none of its own: with tp = 1 there is nothing to shard and it is accepted and ignored
    (as fsdp_reshard_after_forward without FSDP), so one config runs at any tp (`--set parallel.tp=1`)."""
    for k in ("dp_replicate", "dp_shard"):
        if getattr(p, k) == 0:
            raise ValueError(f"parallel.{k} must be >= 1 or -1")
    if p.dp_replicate == -1 and p.dp_shard == -1:
        raise ValueError("only one of parallel.dp_replicate and parallel.dp_shard may be -1")
    if p.pp_schedule == "1F1B" and (p.pp_virtual_stages or 1) != 1:
        raise ValueError("parallel.pp_virtual_stages > 1 needs parallel.pp_schedule=interleaved_1F1B")


class ParallelKeys(Section):
    """What the trainer's `parallel:` and the plan's ParallelSpec share (check_parallel_keys, the stage count):
    written once, so plan and train agree. Subclasses declare the fields."""

    @model_validator(mode="after")
    def _degrees(self):
        check_parallel_keys(self)
        return self

    @property
    def virtual_stages(self) -> int:
        """Model chunks per pp rank: 1 without a pipeline; else pp_virtual_stages or the schedule's default."""
        if self.pp == 1:
            return 1
        return self.pp_virtual_stages or (2 if self.pp_schedule == "interleaved_1F1B" else 1)


class ParallelConfig(ParallelKeys):
    """Mesh degrees; -1 means "whatever is left of the world size" (at most one of them)."""
    dp_replicate: int = Field(1, ge=-1)
    dp_shard: int = Field(-1, ge=-1)
    tp: int = Field(1, ge=1)
    pp: int = Field(1, ge=1)                   # pipeline stages' ranks: the outermost mesh dimension
    pp_schedule: Literal["1F1B", "interleaved_1F1B"] = "1F1B"
    pp_virtual_stages: int | None = Field(None, ge=1)  # stages per pp rank; None: 1 (1F1B), 2 (interleaved)
    # auto: the least recompute whose step fits the GPU by the planner's memory model (train/resources.py);
    # none on CPU
    activation_checkpoint: Literal["none", "selective", "full", "auto"] = "none"
    ac_every: int = Field(2, ge=1)             # selective: checkpoint every k-th block
    fsdp_reshard_after_forward: bool = True    # false: ZeRO-2-like (gathered weights kept for backward); pp > 1: false
    sequence_parallel: bool = True             # false: TP with replicated norms (Megatron pre-SP); tp 1: ignored
    # FSDP2's CPUOffloadPolicy: parameters, gradients and optimizer states in pinned host memory (GPU runs; on a
    # CPU run it is accepted and changes nothing: they are in host memory already)
    fsdp_offload: bool = False

    @property
    def pp_stages(self) -> int:
        """Model chunks in the whole pipeline: pp ranks x virtual stages per rank."""
        return self.pp * self.virtual_stages if self.pp > 1 else 1


class CheckpointConfig(Section):
    interval_steps: int = Field(100, ge=1)     # a checkpoint is also written at the last step
    interval: Literal["steps", "auto"] = "steps"  # auto: Young/Daly sqrt(2*C*MTBF) from measured C
    mtbf_hours: float = Field(24.0, gt=0)      # mean time between failures of the whole job (for auto)
    keep_last: int = Field(3, ge=2)
    keep_every: int | None = Field(None, ge=1)  # milestone: also keep every M-th step
    async_save: bool = Field(False, alias="async")
    grace_period_s: float = Field(120.0, gt=0)  # preemption: the checkpoint must finish within this
    lock_stale_s: float = Field(600.0, gt=0)    # an owner lock whose heartbeat stands still this long: stale
    allow_dataset_change: bool = False         # resume although the dataset's meta.json changed since


METRICS_BIND_RE = re.compile(r"(?P<host>[A-Za-z0-9._-]+|\[[0-9A-Fa-f:]+\]):(?P<port>[0-9]{1,5})", re.ASCII)


class WandbConfig(Section):
    project: str = Field(min_length=1, max_length=128)
    entity: str | None = None
    mode: Literal["online", "offline", "disabled"] | None = None   # None: $WANDB_MODE, else wandb's default


class MlflowConfig(Section):
    # None: a SQLite store on this node ($LLMCLUSTER_CACHE or ~/.cache/llmcluster/mlflow.db). SQLite locks
    # do not hold on NFS/Lustre: a sqlite URI under the storage root is refused at start.
    tracking_uri: str | None = None
    experiment: str = Field("llmcluster", min_length=1, max_length=256)

    @field_validator("tracking_uri")
    @classmethod
    def _no_credentials(cls, v: str | None) -> str | None:
        # The config is copied into the launch directory, run.json, train_state.json and every sink: no secret
        # may be in it. Parsed as MLflow parses it (after strip), so leading blanks do not hide a user:pass@.
        if v is None:
            return None
        where = uri_credential(v)
        if where:
            raise ValueError(f"log.mlflow.tracking_uri must not carry credentials ({where}): pass them through "
                             "job.secret_env (MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD, or "
                             "MLFLOW_TRACKING_TOKEN; a database store: its driver's variable, e.g. PGPASSWORD), "
                             "taken from the submitting environment and never written to a file")
        return v.strip()


# query keys that carry a secret: whole words of the key (api_key, X-Amz-Signature, sslpassword), any case
_SECRET_QUERY = re.compile(r"(?:^|[^a-z])(?:password|passwd|pwd|pass|token|secret|key|apikey|accesskey|auth|"
                           r"authorization|credentials?|sig|signature|sas)(?:$|[^a-z])|password|secret|token",
                           re.ASCII)


def uri_credential(uri: str) -> str | None:
    """What in a URI is a credential (userinfo, or a query key such as password=), named without its value;
    None when there is none. An unparsable URI is not one: whatever reads it refuses it later."""
    from urllib.parse import parse_qsl, urlsplit

    try:
        parts = urlsplit(uri.strip())
    except ValueError:
        return None
    if "@" in parts.netloc:
        return "user:password@"
    for key, _ in parse_qsl(parts.query, keep_blank_values=True):
        if _SECRET_QUERY.search(key.lower()):
            return f"the query key {key[:40]!r}"
    return None


class LogConfig(Section):
    interval: int = Field(10, ge=1)
    eval_interval: int = Field(100, ge=1)
    eval_batches: int = Field(8, ge=1)
    tensorboard: bool = False
    progress: bool = True                     # rank 0 progress bar on a terminal
    # Prometheus llmcluster_train_* as HOST:PORT; each rank serves PORT + its local rank (the ports
    # `monitor config` scrapes per node); PORT 0: rank 0 only, on any free port
    metrics_bind: str | None = None
    straggler_factor: float = Field(1.5, gt=1)  # a rank slower than median * factor is named
    sample_log: bool = False                  # logs/<run>/samples-rank<r>.jsonl: global sample ids per step
    wandb: WandbConfig | None = None          # {project: P}: rank 0 logs to Weights & Biases
    mlflow: MlflowConfig | None = None        # {tracking_uri: URI, experiment: E}: rank 0 logs to MLflow

    @field_validator("metrics_bind")
    @classmethod
    def _bind(cls, v):
        m = METRICS_BIND_RE.fullmatch(v) if v is not None else None
        if v is not None and (m is None or int(m["port"]) > 65535):
            raise ValueError(f"log.metrics_bind {show_value(v)} must be HOST:PORT "
                             "(e.g. 0.0.0.0:9401; port 0: any free)")
        return v

    @property
    def metrics(self) -> tuple[str, int] | None:
        """(host, port) of log.metrics_bind, or None."""
        if self.metrics_bind is None:
            return None
        host, port = self.metrics_bind.rsplit(":", 1)
        return host.strip("[]"), int(port)


class DistConfig(Section):
    backend: Literal["auto", "nccl", "gloo"] = "auto"
    timeout_s: float = Field(600.0, gt=0)     # a collective that takes longer fails, naming step and rank


class EvalConfig(Section):
    """Downstream evaluation of new checkpoints, each a job of its own (`llmcluster eval --model RUN --step N`)."""
    tasks: list[str] | None = None          # None: `llmcluster eval`'s shipped local tasks
    interval_checkpoints: int = Field(1, ge=1)   # every Nth durable checkpoint (the last one always)
    local: bool = False     # on the local scheduler the job competes for the training's cores: opt in

    @field_validator("tasks")
    @classmethod
    def _task_names(cls, v: list[str] | None) -> list[str] | None:
        for t in v or []:    # a name or a local task YAML's path: never a flag, never a list separator
            if not t or t.startswith("-") or "," in t or len(t) > 256:
                raise ValueError(f"eval.tasks: {t!r} is not a task name or path")
        return v


class FtConfig(Section):
    """Per-step fault tolerance on torchft (docs/fault-tolerance.md): each of parallel.dp_replicate's replicas is a
    replica group of its own (its own torchrun world, restarted alone); a step commits with the groups in the
    quorum, and a group that comes back heals from a live peer instead of stopping the others."""
    enabled: bool = False
    min_replicas: int = Field(1, ge=1)          # groups a step needs to commit; fewer: the step waits (quorum)
    # A quorum not formed in this long is asked again (the healthy groups wait for min_replicas; a group gives up
    # after QUORUM_TRIES of them in a row, ft/group.py); also how long a stranger in the quorum is borne.
    quorum_timeout_s: float = Field(60.0, gt=0)
    # The cross-group all-reduce, should_commit and a heal: a group hung or cut off (no reset) leaves the quorum
    # within this, not dist.timeout_s (torchtitan's ft timeout is 10 s too). Inside a group: dist.timeout_s.
    timeout_s: float = Field(10.0, gt=0)
    join_timeout_s: float = Field(60.0, gt=0)    # how long the Lighthouse waits for more groups before a quorum
    # The watchdog (ft/watchdog.py, issue 62 invariant 3): a group that commits no step within this (outside a
    # checkpoint, an evaluation, its quorum or a heal) records a `hang` event and SIGKILLs itself, so that its
    # heartbeat ends and the others form a quorum without it. None: ft.timeout_s + 3 x the median committed step
    # once 5 are known. Above ft.timeout_s: a healthy group waits that long on a hung peer's collective.
    step_deadline_s: float | None = Field(None, gt=0)
    # The same until this process's 5th committed step (1st with step_deadline_s): model build, compile.
    first_step_deadline_s: float = Field(300.0, gt=0)
    # Invariant 4 (the job ends when the run ends): once the run's final step is committed, the launcher gives the
    # groups still running this long to see the end and exit 0 themselves (a healthy one does within a step or a
    # quorum wait), then stops them: a frozen group must not hold the allocation (docs/fault-tolerance.md).
    end_grace_s: float = Field(30.0, ge=0)
    lighthouse: str | None = None               # HOST:PORT of a running Lighthouse; None: the launcher starts one
    # A group whose compute time is over the other groups' median x log.straggler_factor for this many committed
    # steps in a row leaves the quorum instead of pacing every step (0: never); its launcher starts it again after
    # straggler_backoff_s and it heals from a peer. The writer group is never dropped (no hand-over yet).
    straggler_steps: int = Field(0, ge=0)
    straggler_backoff_s: float = Field(60.0, ge=0)
    # Slurm: nodes allocated beyond the groups' (job.nodes), idle until a group loses a node; the group is then
    # relaunched on one (the job is submitted with --no-kill, so a lost node ends only its own steps).
    spare_nodes: int = Field(0, ge=0)

    @model_validator(mode="after")
    def _deadline(self):
        if self.step_deadline_s is not None and self.step_deadline_s <= self.timeout_s:
            raise ValueError(f"ft.step_deadline_s ({self.step_deadline_s:g}) must be above ft.timeout_s "
                             f"({self.timeout_s:g}): a healthy group waits ft.timeout_s on a hung peer's collective, "
                             "and its own watchdog must not fire meanwhile")
        return self

    @field_validator("lighthouse")
    @classmethod
    def _lighthouse(cls, v):
        m = METRICS_BIND_RE.fullmatch(v) if v is not None else None
        if v is not None and (m is None or not 0 < int(m["port"]) <= 65535):
            raise ValueError(f"ft.lighthouse {show_value(v)} must be HOST:PORT (e.g. head-node:29510)")
        return v


class JobConfig(Section):
    run: RunConfig = Field(default_factory=RunConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    log: LogConfig = Field(default_factory=LogConfig)
    dist: DistConfig = Field(default_factory=DistConfig)
    job: JobSpec = Field(default_factory=JobSpec)
    serve: ServeConfig = Field(default_factory=ServeConfig)   # read by `serve plan` only
    eval: EvalConfig | None = None       # downstream evaluation jobs per new checkpoint (issue 28)
    ft: FtConfig = Field(default_factory=FtConfig)            # per-step fault tolerance across replica groups (torchft)

    @model_validator(mode="after")
    def _cross(self):
        if self.data.seq_len > self.model.max_seq_len:
            raise ValueError(
                f"data.seq_len ({self.data.seq_len}) exceeds model.max_seq_len ({self.model.max_seq_len})")
        if self.parallel.tp > 1 and self.model.n_heads % self.parallel.tp:
            raise ValueError(f"parallel.tp ({self.parallel.tp}) must divide model.n_heads ({self.model.n_heads})")
        if self.parallel.tp > 1 and self.parallel.sequence_parallel and self.train.loss_chunks > 1:
            raise ValueError("train.loss_chunks > 1 with parallel.tp > 1 is not supported under sequence "
                             "parallelism: the head's input is sharded on the sequence (set train.loss_chunks=1 "
                             "or parallel.sequence_parallel=false)")
        low_bit_lora_checks(self)
        if self.parallel.tp > 1 and self.train.lora is not None:
            raise ValueError("train.lora with parallel.tp > 1 is not supported: shard with parallel.dp_shard")
        if self.train.float8 is not None:   # combinations not tested with float8 (train/float8.py)
            for bad, what in ((self.parallel.tp > 1, "parallel.tp > 1"), (self.parallel.pp > 1, "parallel.pp > 1"),
                              (self.train.lora is not None, "train.lora"),
                              (self.train.precision == "fp16", "train.precision=fp16")):
                if bad:
                    raise ValueError(f"train.float8 with {what} is not supported (untested): drop one of them")
        if self.parallel.tp > 1 and self.model.kv_heads % self.parallel.tp:
            raise ValueError(
                f"parallel.tp ({self.parallel.tp}) must divide the kv heads ({self.model.kv_heads})")
        p = self.parallel
        if self.ft.enabled:
            for bad, what in ((p.tp > 1, "parallel.tp > 1"), (p.pp > 1, "parallel.pp > 1")):
                if bad:   # torchft 0.2.0 replicates whole groups over a DDP-style all-reduce: no TP/PP inside yet
                    raise ValueError(f"ft.enabled with {what} is not supported yet: replica groups are data-parallel "
                                     "only (parallel.dp_replicate groups, dp_shard inside each)")
            if self.train.precision == "fp16":   # a step not committed would unscale its gradients twice
                raise ValueError("ft.enabled with train.precision=fp16 is not supported: a step that is not committed "
                                 "leaves the grad scaler unscaled but not updated, and its retry fails; use bf16")
            if p.dp_replicate > 0 and self.ft.min_replicas > p.dp_replicate:
                raise ValueError(f"ft.min_replicas ({self.ft.min_replicas}) is more than the replica groups "
                                 f"(parallel.dp_replicate = {p.dp_replicate})")
        if p.pp > 1:
            if p.pp_stages > self.model.n_layers:
                raise ValueError(f"parallel.pp x virtual stages ({p.pp_stages}) exceeds model.n_layers "
                                 f"({self.model.n_layers}): every stage needs a transformer block")
            if self.model.tie_embeddings:
                raise ValueError("model.tie_embeddings with parallel.pp > 1: the embedding and the head live on "
                                 "different stages (untie them)")
            if self.train.loss_chunks > 1:
                raise ValueError("train.loss_chunks > 1 with parallel.pp > 1 is not supported: the last stage "
                                 "computes the loss from whole logits (set train.loss_chunks=1)")
        return self
