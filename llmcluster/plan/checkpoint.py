"""Checkpoint size, write time, the Young/Daly interval, and the goodput it leaves.

Young (1974) / Daly (2006): with C the time to write a checkpoint and M the job's mean time between
failures (node MTBF / nodes), checkpointing every sqrt(2·C·M) minimises the expected waste
C/τ (writing) + (τ/2 + R)/M (work lost since the last checkpoint, plus the restart R, per failure).

With per-step fault tolerance (ft, torchft replica groups: G groups of N/G nodes) a failure stops one group, not
the job: that group restarts (R less the checkpoint read) and heals from a live peer (H: its replica's state
over its nodes' NICs) while the other G-1 keep committing steps, so the cluster loses a share f = 1/G of
(R - read + H) per failure, nothing since the last checkpoint (no rollback), and every group the step in flight plus
the time it takes to notice (failure_s: one rule for both paths, each path's own timeout). When the G-1
survivors are fewer than ft.min_replicas no step commits until the group is back: f = 1. Checkpoints are still
written at the Young/Daly interval (a full stop, the Lighthouse's death, still restarts from one).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from llmcluster.plan.comm import plan_links
from llmcluster.plan.spec import PlanSpec

# Bytes per parameter of a full training checkpoint: 16-bit weights + fp32 master, Adam m, v
# (BLOOM-176B: 2.3 TB, about 14 bytes/param); fsdp2 keeps fp32 params, so no separate master copy.
CHECKPOINT_BYTES = {"zero-paper": 14, "megatron": 14, "deepspeed": 14, "fsdp2": 12}
EXPORT_BYTES = 2  # bf16 weights only (BLOOM-176B: 329 GB)


@dataclass
class Checkpoint:
    size_bytes: float
    weights_bytes: float
    write_s: float
    read_s: float
    job_mtbf_s: float
    optimal_interval_s: float
    goodput: float
    badput: dict[str, float]   # the waste by cause, as fractions of wall time (`jobs goodput`'s keys)


def badput_model(write_s: float, read_s: float, restart_s: float, mtbf_s: float, interval_s: float,
                 eval_share: float = 0.0, failure_s: float = 0.0, straggler_share: float = 0.0) -> dict[str, float]:
    """The waste by cause, as fractions of wall time, under `jobs goodput`'s keys. Young/Daly: writing
    (C/τ), the work lost per failure (τ/2 per M) and the restart R per M, of which reading the checkpoint
    back is `checkpoint_restore` and the rest `startup`; per failure also `failure_s` (the step in flight and
    the time until the failure is noticed) per M; evaluation and stragglers as given shares."""
    return {"startup": max(0.0, restart_s - read_s) / mtbf_s, "checkpoint_restore": min(read_s, restart_s) / mtbf_s,
            "checkpoint_save": write_s / interval_s, "eval": eval_share, "lost_progress": interval_s / 2 / mtbf_s,
            "hang_or_straggler": straggler_share, "failure": failure_s / mtbf_s, "other": 0.0}


def failure_s(step_s: float, timeout_s: float) -> float:
    """What a failure costs every rank that waits on it: the step in flight (half a step on average) and the time to
    notice it. One rule for both paths: a hung rank is noticed when the collective waiting on it times out, which is
    `dist.timeout_s` for the restart path (the process group's: the job then stops and restarts) and `ft.timeout_s`
    with ft (the cross-group all-reduce's: the other groups then commit without it). A crash is noticed sooner (a
    closed connection); a hang is the bound, which is what a plan must hold."""
    return step_s / 2 + timeout_s


@dataclass
class FtRecovery:
    groups: int
    heal_s: float              # H: one group's replica state from a live peer
    share: float               # f: the share of the cluster a failure stops (1/G, or 1 below min_replicas)
    goodput: float
    badput: dict[str, float]   # `jobs goodput`'s keys: startup and heal (checkpoint_restore) per failure x f


def ft_recovery(plan: PlanSpec, ck: Checkpoint, step_s: float = 0.0) -> FtRecovery:
    """The badput of ck with per-group recovery instead of the restart path (see the module's docstring)."""
    c = plan.cluster
    groups = plan.dp_degrees[0]
    group_nodes = max(1, c.nodes // groups)
    heal = ck.size_bytes / (group_nodes * plan_links(plan).node_nic_GBps * 1e9)
    share = 1 / groups if groups - 1 >= plan.ft.min_replicas else 1.0
    m, restart = ck.job_mtbf_s, c.restart_minutes * 60
    badput = {**ck.badput, "startup": share * max(0.0, restart - ck.read_s) / m,
              "checkpoint_restore": share * heal / m, "lost_progress": 0.0,
              "failure": failure_s(step_s, plan.ft.timeout_s) / m}
    return FtRecovery(groups=groups, heal_s=heal, share=share, goodput=max(0.0, 1 - sum(badput.values())),
                      badput=badput)


def eval_share(plan: PlanSpec, step_s: float, forward_s: float) -> float:
    """In-training evaluation (the plan's `eval:` section, the trainer's log.eval_interval / eval_batches):
    `batches` forwards of one micro-batch every `interval_steps` steps, as a share of wall time."""
    e = plan.eval
    spent = e.batches * forward_s
    return spent / (e.interval_steps * step_s + spent)


def straggler_share(plan: PlanSpec) -> float:
    """The plan's, or the fitted share per doubling of the nodes that wait on each other at every step
    (one node: none), fitted on the end-to-end fit runs (calibration.fit_step_model)."""
    if plan.training.straggler_share is not None:
        return plan.training.straggler_share
    from llmcluster.plan.step_model import fitted

    return fitted().get("straggler_per_node_doubling", 0.0) * math.log2(plan.cluster.nodes)


def checkpoint(plan: PlanSpec, params: float, step_s: float = 0.0, forward_s: float = 0.0,
               size: float | None = None) -> Checkpoint:
    """`step_s`: the optimizer step's time and `forward_s` one micro-batch's forward (evaluation and the
    step in flight at a failure); 0 leaves those terms out. `size`: the training state's bytes when they are not
    pre-training's (a fine-tuning method's: plan/finetune.checkpoint_bytes)."""
    c = plan.cluster
    size = params * CHECKPOINT_BYTES[plan.parallel.memory_convention] if size is None else size
    write = size / (c.storage_write_GBps * 1e9)
    mtbf = c.node_mtbf_hours * 3600 / c.nodes
    tau = math.sqrt(2 * write * mtbf)
    read = size / (c.storage_read_GBps * 1e9)
    badput = badput_model(write, read, c.restart_minutes * 60, mtbf, tau,
                          eval_share=eval_share(plan, step_s, forward_s) if step_s else 0.0,
                          failure_s=failure_s(step_s, plan.dist.timeout_s), straggler_share=straggler_share(plan))
    return Checkpoint(size_bytes=size, weights_bytes=params * EXPORT_BYTES, write_s=write, read_s=read,
                      job_mtbf_s=mtbf, optimal_interval_s=tau, goodput=max(0.0, 1 - sum(badput.values())),
                      badput=badput)
