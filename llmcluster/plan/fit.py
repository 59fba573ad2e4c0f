"""Fit before launch: the planner's memory estimate for a job config on its GPUs (no torch).

The job config is turned into the plan the trainer would run (the same keys, the `fsdp2` byte convention
of FSDP2 with fp32 master weights, SwiGLU Llama dims) and costed per GPU by `plan_memory`; when it does
not fit, `search` names the fastest layout of the same model and global batch that does.
"""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import ValidationError

from llmcluster.config.schema import JobConfig
from llmcluster.errors import UserError
from llmcluster.plan.memory import plan_memory
from llmcluster.plan.spec import PlanSpec

GIB = 1024**3


@dataclass(frozen=True)
class Fit:
    needed_bytes: float          # per GPU, the peak pipeline stage
    available_bytes: float       # per GPU
    alternative: dict | None     # the best fitting search candidate (with its `set`), if any
    finetune: bool = False       # the job names a fine-tuning method: no pre-training layout is searched

    @property
    def fits(self) -> bool:
        return self.needed_bytes <= self.available_bytes

    def line(self) -> str:
        head = (f"the job needs {self.needed_bytes / GIB:.1f} GiB per GPU, {self.available_bytes / GIB:.1f} GiB "
                "available")
        if self.fits:
            return head + ": fits"
        alt = ("; best fitting alternative: " + " ".join(f"--set {o}" for o in self.alternative["set"])
               + f" ({self.alternative['memory_bytes'] / GIB:.1f} GiB)") if self.alternative else \
            "; `llmcluster plan CONFIG --cluster NAME --finetune` compares the fine-tuning methods" if self.finetune \
            else "; no layout of this model and global batch fits"
        return head + alt


def job_plan(cfg: JobConfig, gpu: str, cluster: dict | None = None) -> PlanSpec:
    """The plan of what `llmcluster train` runs for `cfg` on `job.nodes` x `job.procs` GPUs of type `gpu` (or on
    `cluster`, a PlanCluster's fields: the cluster spec's figures), with the job's fine-tuning method
    (train.lora, train.optimizer, parallel.fsdp_offload) and its tokens (steps x global batch x sequence)."""
    m, p, t, job = cfg.model, cfg.parallel, cfg.train, cfg.job
    data = {
        "model": {"name": cfg.run.name, "n_layers": m.n_layers, "d_model": m.d_model, "n_heads": m.n_heads,
                  "n_kv_heads": m.n_kv_heads, "ffn_hidden": m.ffn_hidden, "vocab_size": m.vocab_size,
                  "seq_len": cfg.data.seq_len, "tie_embeddings": m.tie_embeddings},
        "cluster": cluster or {"gpu": gpu, "nodes": job.nodes, "gpus_per_node": job.procs},
        "parallel": {"dp_replicate": p.dp_replicate, "dp_shard": p.dp_shard, "tp": p.tp, "pp": p.pp,
                     "pp_schedule": p.pp_schedule, "pp_virtual_stages": p.pp_virtual_stages,
                     # auto: the trainer's choice is at best full (train/resources.py), so a job that
                     # full makes fit is not refused before it starts
                     "activation_checkpoint": "full" if p.activation_checkpoint == "auto"
                     else p.activation_checkpoint, "ac_every": p.ac_every,
                     "fsdp_reshard_after_forward": p.fsdp_reshard_after_forward, "micro_batch": t.micro_batch,
                     "grad_accum": t.grad_accum, "precision": t.precision, "memory_convention": "fsdp2"},
    }
    if p.tp == 1 and p.pp == 1:   # the fine-tuning model plans FSDP alone; with TP or PP: pre-training's (more)
        data["training"] = {"lora": t.lora.model_dump() if t.lora else None, "optimizer": t.optimizer}
        data["parallel"]["fsdp_offload"] = p.fsdp_offload
    try:
        plan = PlanSpec.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        raise UserError(f"fit check: {err['msg'].removeprefix('Value error, ')}") from None
    tokens = t.steps * plan.global_batch * plan.model.seq_len
    return plan.model_copy(update={"training": plan.training.model_copy(update={"tokens": float(tokens)})})


def needed_bytes(plan: PlanSpec) -> float:
    """Peak bytes a GPU: the fine-tuning method the plan names (plan/finetune.py), else pre-training's layout."""
    if plan.finetune:
        from llmcluster.plan.finetune import finetune_row, plan_method

        return finetune_row(plan, plan_method(plan)).peak_gb * 1e9
    return plan_memory(plan).total


def job_fit(cfg: JobConfig, gpu: str, gpu_memory_bytes: float | None = None) -> Fit:
    """Needed vs available memory per GPU for the job, and the best fitting alternative when it does not fit.
    `gpu_memory_bytes` overrides the GPU table's capacity (e.g. a MIG slice, or what nvidia-smi reports)."""
    plan = job_plan(cfg, gpu)
    needed = needed_bytes(plan)
    available = gpu_memory_bytes or plan.cluster.spec.memory_bytes
    alternative = None
    if needed > available and not plan.finetune:   # search ranks pre-training layouts only
        from llmcluster.plan.search import search

        base = plan.model_copy(update={"parallel": plan.parallel.model_copy(
            update={"global_batch": plan.global_batch, "grad_accum": None})})
        try:
            fitting = [c for c in search(base, top=1000) if c["memory_bytes"] <= available]
        except UserError:
            fitting = []
        alternative = fitting[0] if fitting else None
    return Fit(needed, available, alternative, plan.finetune)


def require_fit(cfg: JobConfig, gpu: str, gpu_memory_bytes: float | None = None) -> Fit:
    """`launch`'s check: a UserError (one line, exit 2) when the job will not fit."""
    fit = job_fit(cfg, gpu, gpu_memory_bytes)
    if not fit.fits:
        raise UserError(f"will not fit: {fit.line()} (--force launches anyway)")
    return fit
