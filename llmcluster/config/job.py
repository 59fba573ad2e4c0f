"""The `job` section: how a run is placed on the cluster (nodes, GPUs, scheduler settings).

Owned by the launch capability; the trainer ignores it.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class JobSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    nodes: int = Field(1, ge=1)
    gpus_per_node: int = Field(0, ge=0)          # 0 = CPU
    procs_per_node: int | None = Field(None, ge=1)  # None: = GPUs, or 1 on CPU
    cpus_per_node: int | None = Field(None, ge=1)
    mem_per_node: str | None = None              # e.g. "480G"
    time: str = "72:00:00"
    partition: str | None = None
    image: str | None = None
    max_requeues: int = Field(3, ge=0)
