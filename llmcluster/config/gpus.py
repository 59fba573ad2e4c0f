"""The one GPU and fabric table, read by plan, bench and the trainer (MFU), validate and `cluster init`.

Datasheet figures (dense, no sparsity): NVIDIA datasheets (A100, H100, H200, L40S) and the Ada whitepaper
(RTX 4090). Achieved figures: ml-engineering's MAMF finder (max achievable bf16 matmul), nccl-tests runs of 8 GPUs
in one node (all-reduce busbw, large messages; H100/H200 with NCCL_ALGO=Ring, NVLS reaches 475-482), PCIe host to
device copies (Gen4 x16 22-26 GB/s achieved; Gen5 x16 55 GB/s H2D on H200 nodes, nvbandwidth), Epoch AI's server
power / (GPUs x TDP) factors, and per-NIC achieved bandwidth of InfiniBand (nccl-tests issues #290 and #267, nccl
#412). Every figure and source is listed in docs/planning.md ("Sources"). GB/s, TFLOP/s, W.
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
    pcie_gen: int = 4
    pcie_h2d_GBps: float = 24     # achieved pinned host->device copy, one GPU
    allreduce_busbw_GBps: float = 22   # achieved all-reduce busbw inside one 8-GPU node (PCIe: 22)
    server_power_factor: float = 2.03  # server max power / (GPUs x TDP), Epoch AI; a DGX A100: 6.5 kW = 2.03 x 8 x 400 W

    @property
    def memory_bytes(self) -> int:
        return int(self.memory_gb * 1e9)

    def peak_tflops(self, precision: str) -> float:
        return {"bf16": self.bf16_tflops, "fp16": self.bf16_tflops, "tf32": self.tf32_tflops,
                "fp32": self.fp32_tflops, "fp8": self.fp8_tflops or self.bf16_tflops}[precision]


GPUS: dict[str, GPUSpec] = {g.name: g for g in (
    GPUSpec("A100-40GB", 40, 1555, 312, None, 156, 19.5, 400, 300, 271, 4, 24, 230, 2.03),
    GPUSpec("A100-80GB", 80, 2039, 312, None, 156, 19.5, 400, 300, 271, 4, 24, 230, 2.03),
    GPUSpec("H100", 80, 3350, 989, 1979, 495, 67, 700, 450, 794.5, 5, 55, 368, 1.82),
    GPUSpec("H200", 141, 4800, 989, 1979, 495, 67, 700, 450, 794.5, 5, 55, 368, 1.82),
    GPUSpec("RTX4090", 24, 1008, 165, 330, 82.6, 82.6, 450, None, None, 4, 24, 22),
    GPUSpec("L40S", 48, 864, 362, 733, 183, 91.6, 350, None, None, 4, 24, 22),
)}

PCIE_ALLREDUCE_BUSBW_GBPS = 22   # an NVLink GPU planned with intra_node: pcie (PCIe Gen4 x16 achieves 22-26 GB/s)


@dataclass(frozen=True)
class Fabric:
    line_gbit: float              # per NIC
    achieved_GBps: float          # what nccl-tests reach per NIC


# Inter-node fabrics. RoCE is assumed equal to InfiniBand at the same line rate; `none` is one node (no traffic).
FABRICS: dict[str, Fabric] = {
    "ib-hdr": Fabric(200, 24), "ib-ndr": Fabric(400, 46),
    "roce-200": Fabric(200, 24), "roce-400": Fabric(400, 46),
    "none": Fabric(0, 0),
}

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
