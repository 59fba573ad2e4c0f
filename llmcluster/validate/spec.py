"""What the cluster is expected to deliver: `--cluster SPEC` (YAML), with defaults per GPU model.

The file is either this schema at top level, or a larger cluster YAML with a `validate:` section (only
that section is read), e.g.

    validate:
      gpu: H200                  # expected model (default: whatever the node reports)
      gpus_per_node: 8
      tolerance: 0.10            # a node this far below the median is an outlier
      min_busbw_GBps: 360        # all_reduce busbw at the largest size (8xH100/H200, NCCL_ALGO=Ring)
      storage:
        checkpoints: {write_GBps: 5, read_GBps: 10}

Thresholds are fractions of the expected figure: PASS at or above `pass_at`, WARN at or above `warn_at`,
FAIL below. The expected figures come from `llmcluster.config.gpus` (datasheets, ml-engineering MAMF) and
the PCIe figures below; the fractions are this project's defaults, tune them per site.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from llmcluster.config.gpus import GPUSpec, gpu_spec

# Achieved host->device bandwidth, pinned, one GPU (planning facts §1: PCIe Gen4 x16 ≈ 22–26 GB/s
# achieved; Gen5 x16 55 GB/s H2D on H200 nodes, nvbandwidth).
PCIE_ACHIEVED_GBPS = {"A100-40GB": 24, "A100-80GB": 24, "RTX4090": 24, "L40S": 24, "H100": 55, "H200": 55}
MAX_GPU_TEMP_C = 84          # GCM/Imbue gate (planning facts §2)


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StorageExpect(_Section):
    write_GBps: float | None = Field(None, gt=0)
    read_GBps: float | None = Field(None, gt=0)
    files_per_s: float | None = Field(None, gt=0)


class ValidateSpec(_Section):
    gpu: str | None = None
    gpus_per_node: int | None = Field(None, ge=0)
    tolerance: float = Field(0.10, gt=0, lt=1)
    # compute: bf16 matmul vs the MAMF figure (or 80% of the datasheet peak when none is published)
    compute_pass_at: float = Field(0.90, gt=0, le=1.5)
    compute_warn_at: float = Field(0.75, gt=0, le=1.5)
    # memory: device copy (read + write bytes) vs the datasheet HBM bandwidth
    memory_pass_at: float = Field(0.75, gt=0, le=1.5)
    memory_warn_at: float = Field(0.60, gt=0, le=1.5)
    # pcie: pinned copies vs PCIE_ACHIEVED_GBPS (or pcie_GBps)
    pcie_GBps: float | None = Field(None, gt=0)
    pcie_pass_at: float = Field(0.80, gt=0, le=1.5)
    pcie_warn_at: float = Field(0.50, gt=0, le=1.5)
    # collectives: all_reduce busbw at the largest size; None = report only
    min_busbw_GBps: float | None = Field(None, gt=0)
    # thermal
    max_temp_c: float = Field(MAX_GPU_TEMP_C, gt=0)
    max_clock_drop: float = Field(0.10, gt=0, lt=1)
    storage: dict[str, StorageExpect] = {}

    def gpu_model(self, device_name: str | None) -> GPUSpec | None:
        """The expected GPU: the spec's, else the one the device reports (None for an unknown one)."""
        if self.gpu:
            return gpu_spec(self.gpu)
        if device_name:
            from llmcluster.config.gpus import match_device_name
            return match_device_name(device_name)
        return None


def load_spec(path: str | None) -> ValidateSpec:
    if not path:
        return ValidateSpec()
    from llmcluster.config.load import read_yaml, validate

    data = read_yaml(path, what="cluster spec")
    if isinstance(data.get("validate"), dict):
        data = data["validate"]
    spec = validate(data, ValidateSpec, source=str(path))
    if spec.gpu:
        gpu_spec(spec.gpu)   # an unknown model is a one-line error now, not a crash mid-run
    return spec
