"""What the cluster is expected to deliver, from the cluster spec (`--cluster FILE|NAME`, else $LLMCLUSTER_CLUSTER,
else ./cluster.yaml; see docs/cluster.md): the GPU model and count from `hardware:`, the storage figures from
`storage:`, and the pass/warn fractions from its `validate:` section, e.g.

    hardware: {gpu: H200, gpus_per_node: 8}
    storage:
      areas:
        checkpoints: {write_GBps: 5, read_GBps: 10}
    validate:
      tolerance: 0.10            # a node this far below the median is an outlier
      min_busbw_GBps: 360        # all_reduce busbw at the largest size (8xH100/H200, NCCL_ALGO=Ring)

Thresholds are fractions of the expected figure: PASS at or above `pass_at`, WARN at or above `warn_at`,
FAIL below. The expected figures come from `llmcluster.config.gpus` (datasheets, ml-engineering MAMF) and
the PCIe figures below; the fractions are this project's defaults, tune them per site. With no cluster spec
anywhere, the GPU is whatever the node reports and its count is not checked.
"""

from __future__ import annotations

import os
import socket

from pydantic import BaseModel, ConfigDict, Field

from llmcluster.config.cluster import AREAS, Thresholds
from llmcluster.config.cluster_load import ResolvedCluster
from llmcluster.config.gpus import GPUSpec, for_device, gpu_spec, pcie_h2d_GBps



class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StorageExpect(_Section):
    write_GBps: float | None = Field(None, gt=0)
    read_GBps: float | None = Field(None, gt=0)
    files_per_s: float | None = Field(None, gt=0)


class ValidateSpec(Thresholds):
    """The thresholds plus the figures they are fractions of (None: not checked / the device's own)."""
    gpu: str | None = None
    gpus_per_node: int | None = Field(None, ge=0)
    storage: dict[str, StorageExpect] = {}
    pcie_gen: int | None = None           # hardware.pcie_gen / pcie_lanes: the nodes' link (None: the GPU table's)
    pcie_lanes: int | None = None
    cluster: str = ""                     # which spec this is, for the report: "seed (clusters/seed-a100.yaml)"

    def describe(self) -> str:
        """One line: what the nodes are checked against."""
        gpus = ("any GPUs" if self.gpus_per_node is None else "no GPUs (CPU-only)" if self.gpus_per_node == 0
                else f"{self.gpus_per_node} x {self.gpu or 'GPU'} per node")
        return f"expecting {gpus}; cluster {self.cluster or 'not given'}"

    def gpu_model(self, device_name: str | None) -> GPUSpec | None:
        """The expected GPU: the spec's, else the one the device reports (None for an unknown one)."""
        if self.gpu:
            return for_device(gpu_spec(self.gpu), device_name)     # a MIG slice: its share, not the whole GPU
        if device_name:
            from llmcluster.config.gpus import match_device_name
            return match_device_name(device_name)
        return None

    def pcie_expect_GBps(self, gpu: GPUSpec | None) -> float | None:
        """The pinned host->device GB/s a GPU should reach: validate.pcie_GBps, else the GPU table's achieved
        figure on the link the cluster spec names (a consumer board's x8/x8 split halves it; config/gpus.py)."""
        if self.pcie_GBps or gpu is None:
            return self.pcie_GBps
        return pcie_h2d_GBps(gpu, self.pcie_gen, self.pcie_lanes)


def from_cluster(resolved: ResolvedCluster) -> ValidateSpec:
    c = resolved.spec
    fields = c.thresholds.model_dump()
    if not resolved.is_default:           # the built-in default says nothing about this node's GPUs
        fields["gpu"] = c.hardware.gpu if c.hardware.spec is not None else None
        fields["gpus_per_node"] = _expected_gpus(c)
        fields["pcie_gen"], fields["pcie_lanes"] = c.hardware.pcie_gen, c.hardware.pcie_lanes
    storage = {}
    for area in AREAS:
        a = c.storage.area(area)
        if a.write_GBps or a.read_GBps or a.files_per_s:
            storage[area] = StorageExpect(write_GBps=a.write_GBps, read_GBps=a.read_GBps, files_per_s=a.files_per_s)
    return ValidateSpec(**fields, storage=storage, cluster=f"{c.name} ({resolved.source})")


def _expected_gpus(c) -> int | None:
    """GPUs this host should have: its `nodes.overrides` entry, else hardware.gpus_per_node; None (not judged)
    on the spec's Slurm head node, which runs `validate stack` as the provisioning gate without any GPU."""
    host = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
    if host and host in {c.scheduler.slurm.head_node, (c.scheduler.slurm.head_node or "").split(".")[0]}:
        return None
    return c.node_gpus(host)


def load_spec(ref: str | None) -> ValidateSpec:
    """The expectations of the resolved cluster spec (`ref`: a file or shipped name, None: the resolution order)."""
    from llmcluster.config.cluster_load import load_cluster

    return from_cluster(load_cluster(ref))
