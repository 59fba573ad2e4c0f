"""GPU datasheet figures (dense, no sparsity), shared by plan, bench (MFU), validate and monitor.

Source: NVIDIA datasheets (A100, H100, H200, L40S) and the Ada whitepaper (RTX 4090), as transcribed in
the project's planning facts (docs/planning.md). Bandwidths in GB/s, compute in TFLOP/s, power in W.
"""

from __future__ import annotations

from dataclasses import dataclass

from llmcluster.errors import UserError


@dataclass(frozen=True)
class GPUSpec:
    name: str
    memory_gb: float              # decimal GB as the datasheet states it
    memory_bw_gbps: float         # HBM/GDDR GB/s
    bf16_tflops: float            # dense; fp16 is the same on all of these
    fp8_tflops: float | None
    tf32_tflops: float
    fp32_tflops: float
    power_w: float
    nvlink_gbps: float | None     # per direction, GB/s; None = PCIe only
    mamf_bf16_tflops: float | None = None  # max achievable matmul (ml-engineering MAMF finder)

    @property
    def memory_bytes(self) -> int:
        return int(self.memory_gb * 1e9)

    def peak_tflops(self, precision: str) -> float:
        return {"bf16": self.bf16_tflops, "fp16": self.bf16_tflops, "tf32": self.tf32_tflops,
                "fp32": self.fp32_tflops, "fp8": self.fp8_tflops or self.bf16_tflops}[precision]


GPUS: dict[str, GPUSpec] = {g.name: g for g in (
    GPUSpec("A100-40GB", 40, 1555, 312, None, 156, 19.5, 400, 300, 271),
    GPUSpec("A100-80GB", 80, 2039, 312, None, 156, 19.5, 400, 300, 271),
    GPUSpec("H100", 80, 3350, 989, 1979, 495, 67, 700, 450, 794.5),
    GPUSpec("H200", 141, 4800, 989, 1979, 495, 67, 700, 450, 794.5),
    GPUSpec("RTX4090", 24, 1008, 165, 330, 82.6, 82.6, 450, None, None),
    GPUSpec("L40S", 48, 864, 362, 733, 183, 91.6, 350, None, None),
)}

_ALIASES = {
    "a100": "A100-80GB", "a100-80": "A100-80GB", "a100-80gb": "A100-80GB", "a100-sxm4-80gb": "A100-80GB",
    "a100-40": "A100-40GB", "a100-40gb": "A100-40GB", "a100-sxm4-40gb": "A100-40GB",
    "h100": "H100", "h100-sxm": "H100", "h100-80gb": "H100", "h100 80gb hbm3": "H100",
    "h200": "H200", "h200-sxm": "H200", "h200-141gb": "H200",
    "rtx4090": "RTX4090", "rtx-4090": "RTX4090", "4090": "RTX4090", "geforce rtx 4090": "RTX4090",
    "l40s": "L40S",
}


def gpu_spec(name: str) -> GPUSpec:
    """Look a GPU up by table name or common alias; a clear error for an unknown one."""
    key = name.strip()
    if key in GPUS:
        return GPUS[key]
    alias = _ALIASES.get(key.lower().replace("_", "-"))
    if alias:
        return GPUS[alias]
    raise UserError(f"unknown GPU '{name}': expected one of {', '.join(GPUS)}")


def match_device_name(device_name: str) -> GPUSpec | None:
    """Map a CUDA/NVML device name ('NVIDIA H200', 'NVIDIA A100-SXM4-80GB') to the table, or None."""
    n = device_name.lower()
    if "h200" in n:
        return GPUS["H200"]
    if "h100" in n:
        return GPUS["H100"]
    if "a100" in n:
        return GPUS["A100-40GB"] if "40g" in n else GPUS["A100-80GB"]
    if "4090" in n:
        return GPUS["RTX4090"]
    if "l40s" in n:
        return GPUS["L40S"]
    return None
