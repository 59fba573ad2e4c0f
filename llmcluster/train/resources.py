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
AC_MODES = ("none", "selective", "full")   # least recompute first


def host_available_bytes() -> int:
    """Memory new processes can have without swapping (MemAvailable; page cache counts as free)."""
    from llmcluster.monitor.node_metrics import read_meminfo

    try:
        mem = read_meminfo()
        return mem.get("MemAvailable", mem["MemFree"])
    except (OSError, KeyError):
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _estimate(cfg: JobConfig, dims) -> tuple[float, float, float] | None:
    """(all, activations, the planner's margin) per rank: see `needed_bytes`; the margin is the planner's own
    (hardware.gpu_reserved_gib for the CUDA context and workspaces, plus its allocator slack)."""
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
    return states + activations, activations, mem.buffers


def needed_bytes(cfg: JobConfig, dims) -> tuple[float, float] | None:
    """(all, activations) per rank by the planner's model of the resolved layout, as a lower bound: what the
    model counts that this job may not hold is left out. None when the planner cannot model the layout."""
    estimate = _estimate(cfg, dims)
    return None if estimate is None else estimate[:2]


def choose_activation_checkpoint(cfg: JobConfig, dims, free_bytes: float | None) -> tuple[str, str]:
    """`parallel.activation_checkpoint: auto`: (the mode, the line that says why). The least recompute whose
    step fits `free_bytes` (a GPU's free memory; None on a CPU) by the planner's memory model with its margin:
    none, else selective (every parallel.ac_every-th block), else full. Pure: the caller measures the memory.

    A CPU gets none: its activations live in host memory, which the fit check bounds, and recomputing them
    buys no speed there. When even full does not fit, full (the fit check then says what does not fit)."""
    if free_bytes is None:
        return "none", ("activation checkpointing auto -> none: on a CPU the activations live in host memory "
                        "(no device memory to save, and recomputing them buys no speed)")
    needs = {}
    for mode in AC_MODES:
        estimate = _estimate(cfg.model_copy(update={"parallel": cfg.parallel.model_copy(
            update={"activation_checkpoint": mode})}), dims)
        if estimate is None:
            return "none", ("activation checkpointing auto -> none: the planner's memory model does not cover "
                            "this layout; set parallel.activation_checkpoint to choose")
        needs[mode] = estimate[0] + estimate[2]
    chosen = next((m for m in AC_MODES if needs[m] <= free_bytes), "full")
    figures = f"the step needs {needs['none'] / GIB:,.1f} GiB without"
    if chosen == "full":
        figures += f", {needs['selective'] / GIB:,.1f} GiB selective"
    if chosen != "none":
        figures += f", {needs[chosen] / GIB:,.1f} GiB with"
    fits = "" if needs[chosen] <= free_bytes else " (does not fit even so)"
    return chosen, (f"activation checkpointing auto -> {chosen}: {figures}; {free_bytes / GIB:,.1f} GiB free"
                    f"{fits} (the planner's memory model with its margin)")


def resolve_activation_checkpoint(cfg: JobConfig, dims, device) -> str | None:
    """Collective: replace `auto` in cfg.parallel.activation_checkpoint with the mode chosen for the GPU with
    the least free memory of the job (every rank must apply the same checkpointing: one layout, one set of
    module names in the checkpoint); the line to print, or None when the config named a mode itself."""
    if cfg.parallel.activation_checkpoint != "auto":
        return None
    from llmcluster.checkpoint.verify import gather_obj

    free = None
    if device.type == "cuda":
        import torch

        free = min(gather_obj(torch.cuda.mem_get_info(device)[0]))
    cfg.parallel.activation_checkpoint, line = choose_activation_checkpoint(cfg, dims, free)
    return line


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
    head = (f"the job needs at least {need / GIB:,.1f} GiB per rank by the planner's memory model "
            f"(activations of train.micro_batch={cfg.train.micro_batch}: {activations / GIB:,.1f} GiB), "
            f"{have / GIB:,.1f} GiB {where}: ")
    if need - activations > have:   # no micro-batch makes it fit (issue 69: the advice said to lower it)
        return head + (f"the weights, gradients and optimizer states alone need {(need - activations) / GIB:,.1f} "
                       "GiB, so a smaller micro-batch cannot fit it: shard them over more devices or hosts "
                       "(parallel.dp_shard), train adapters only (train.lora, QLoRA), or a machine with more memory")
    return head + ("lower train.micro_batch (raise train.grad_accum to keep the global batch) or shard the job "
                   "over more devices")


def require_fit(cfg: JobConfig, dims, device, local_world: int) -> list[str]:
    """Collective: every rank refuses with the same line when any rank's share does not fit (a rank that
    went on alone would wait for the others in its first collective until dist.timeout_s). First resolves
    parallel.activation_checkpoint=auto (the fit depends on it); returns the notes to print at start."""
    from llmcluster.checkpoint.verify import first_error

    ac_line = resolve_activation_checkpoint(cfg, dims, device)
    error = first_error(fit_problem(cfg, dims, device, local_world))
    if error:
        raise UserError(error)
    return [ac_line] if ac_line else []
