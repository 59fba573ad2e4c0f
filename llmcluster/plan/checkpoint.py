"""Checkpoint size, write time, the Young/Daly interval, and the goodput it leaves.

Young (1974) / Daly (2006): with C the time to write a checkpoint and M the job's mean time between
failures (node MTBF / nodes), checkpointing every sqrt(2·C·M) minimises the expected waste
C/τ (writing) + (τ/2 + R)/M (work lost since the last checkpoint, plus the restart R, per failure).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

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


def badput_model(write_s: float, read_s: float, restart_s: float, mtbf_s: float, interval_s: float) -> dict[str, float]:
    """Young/Daly's waste by cause, as fractions of wall time, under `jobs goodput`'s keys: writing
    (C/τ), the work lost per failure (τ/2 per M) and the restart R per M, of which reading the checkpoint
    back is `checkpoint_restore` and the rest `startup`."""
    return {"startup": max(0.0, restart_s - read_s) / mtbf_s, "checkpoint_restore": min(read_s, restart_s) / mtbf_s,
            "checkpoint_save": write_s / interval_s, "eval": 0.0, "lost_progress": interval_s / 2 / mtbf_s,
            "hang_or_straggler": 0.0, "failure": 0.0, "other": 0.0}


def checkpoint(plan: PlanSpec, params: float) -> Checkpoint:
    c = plan.cluster
    size = params * CHECKPOINT_BYTES[plan.parallel.memory_convention]
    write = size / (c.storage_write_GBps * 1e9)
    mtbf = c.node_mtbf_hours * 3600 / c.nodes
    tau = math.sqrt(2 * write * mtbf)
    read = size / (c.storage_read_GBps * 1e9)
    badput = badput_model(write, read, c.restart_minutes * 60, mtbf, tau)
    return Checkpoint(size_bytes=size, weights_bytes=params * EXPORT_BYTES, write_s=write, read_s=read,
                      job_mtbf_s=mtbf, optimal_interval_s=tau, goodput=max(0.0, 1 - sum(badput.values())),
                      badput=badput)
