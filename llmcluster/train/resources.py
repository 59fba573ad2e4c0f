"""Will the job fit this host or GPU? Asked before the trainer allocates anything (data, model, run folders).

The figure is the planner's memory model (plan/memory.py through plan/fit.py's `job_plan`, the layout this
world resolves to): weights, gradients, optimizer states and the activations of one micro-batch per rank.
Its activations count 16-bit values (CPU may compute in fp32), no allocator overhead, and what a job does not
hold is left out (`needed_bytes`): a lower bound, so a start is refused only when even that does not fit, never
on a guess that it might not.
Without the check a micro-batch of 10^9 sequences died in a 60 GiB numpy allocation, one traceback per rank.
"""

from __future__ import annotations

import os

from llmcluster.config.schema import JobConfig
from llmcluster.errors import UserError
from llmcluster.plan.fit import job_plan
from llmcluster.plan.memory import GIB, logits_bytes, plan_memory

# The planner needs a GPU type for its cluster; only its capacity differs between types, and the capacity
# compared against here is the memory this process can actually have.
_ANY_GPU = "h100"


def host_available_bytes() -> int:
    """Memory new processes can have without swapping (MemAvailable; page cache counts as free)."""
    from llmcluster.monitor.node_metrics import read_meminfo

    try:
        mem = read_meminfo()
        return mem.get("MemAvailable", mem["MemFree"])
    except (OSError, KeyError):
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def needed_bytes(cfg: JobConfig, dims) -> tuple[float, float] | None:
    """(all, activations) per rank by the planner's model of the resolved layout, as a lower bound: what the
    model counts that this job may not hold is left out. None when the planner cannot model the layout."""
    job = cfg.job.model_copy(update={"nodes": 1, "gpus_per_node": dims.world_size, "procs_per_node": None})
    parallel = cfg.parallel.model_copy(update={"dp_replicate": dims.dp_replicate, "dp_shard": dims.dp_shard})
    try:
        plan = job_plan(cfg.model_copy(update={"job": job, "parallel": parallel}), _ANY_GPU)
        mem = plan_memory(plan)
    except (UserError, ValueError, ArithmeticError):   # a layout the planner does not model: no estimate
        return None
    # Left out: the GPU's reserve and allocator slack (estimates, and nothing on a CPU); under LoRA the full
    # model's gradients and optimizer states (the adapters' are small); with train.loss_chunks the whole
    # logits (computed a slice at a time).
    states = mem.weights if cfg.train.lora else mem.weights + mem.gradients + mem.optimizer
    activations = mem.activations
    if cfg.train.loss_chunks > 1 and mem.stage != "first":
        activations -= logits_bytes(plan.model, plan.model.seq_len, cfg.train.micro_batch, cfg.parallel.tp)
    return states + activations, activations


def fit_problem(cfg: JobConfig, dims, device, local_world: int) -> str | None:
    """The line saying a rank's share of the job cannot fit where it runs; None when it can (or is unknown)."""
    estimate = needed_bytes(cfg, dims)
    if estimate is None:
        return None
    need, activations = estimate
    if device.type == "cuda":
        import torch

        have, where = torch.cuda.mem_get_info(device)[0], f"free on {device}"
    else:   # the ranks of this host share its memory
        have = host_available_bytes() / local_world
        where = "available on this host" + (f" per rank ({local_world} ranks)" if local_world > 1 else "")
    if need <= have:
        return None
    return (f"the job needs at least {need / GIB:,.1f} GiB per rank by the planner's memory model "
            f"(activations of train.micro_batch={cfg.train.micro_batch}: {activations / GIB:,.1f} GiB), "
            f"{have / GIB:,.1f} GiB {where}: lower train.micro_batch (raise train.grad_accum to keep the global "
            "batch) or use more ranks")


def require_fit(cfg: JobConfig, dims, device, local_world: int) -> None:
    """Collective: every rank refuses with the same line when any rank's share does not fit (a rank that
    went on alone would wait for the others in its first collective until dist.timeout_s)."""
    from llmcluster.checkpoint.verify import first_error

    error = first_error(fit_problem(cfg, dims, device, local_world))
    if error:
        raise UserError(error)
