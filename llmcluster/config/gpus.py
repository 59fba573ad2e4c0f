"""The one GPU and fabric table, read by plan, bench and the trainer (MFU), validate and `cluster init`.

Datasheet figures (dense, no sparsity): NVIDIA datasheets (A100, H100 SXM/PCIe/NVL, H200 SXM/NVL, L40S) and the Ada
whitepaper (RTX 4090). Achieved figures: ml-engineering's MAMF finder (max achievable bf16 matmul), nccl-tests runs
of 8 GPUs in one node (all-reduce busbw, large messages; H100/H200 with NCCL_ALGO=Ring, NVLS reaches 475-482), PCIe
host to device copies (Gen4 x16 22-26 GB/s achieved; Gen5 x16 55 GB/s H2D on H200 nodes, nvbandwidth), Epoch AI's
server power / (GPUs x TDP) factors, and per-NIC achieved bandwidth of InfiniBand (nccl-tests issues #290 and #267,
nccl #412). Every figure and source is listed in docs/planning.md ("Sources"). GB/s, TFLOP/s, W.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

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
    pcie_lanes: int = 16          # the link width pcie_h2d_GBps was achieved on

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
    # PCIe-card Hoppers: NVIDIA H100 datasheet (H100 PCIe, H100 NVL columns) and H200 NVL datasheet; the
    # datasheets print sparse tensor figures, halved here to dense (H100 PCIe bf16 1,513 -> 756, NVL 1,671 ->
    # 835). NVLink only as a bridge between 2 (H200 NVL: up to 4) cards, no NVSwitch: nvlink_gbps None, so plan
    # costs node-wide collectives over PCIe (22 GB/s) and provision installs no fabric manager for them.
    GPUSpec("H100-PCIe", 80, 2000, 756, 1513, 378, 51, 350, None, None, 5, 55, 22),
    GPUSpec("H100-NVL", 94, 3900, 835, 1671, 417, 60, 400, None, None, 5, 55, 22),
    GPUSpec("H200-NVL", 141, 4800, 835, 1671, 417, 60, 600, None, None, 5, 55, 22),
    GPUSpec("RTX4090", 24, 1008, 165, 330, 82.6, 82.6, 450, None, None, 4, 24, 22),
    GPUSpec("L40S", 48, 864, 362, 733, 183, 91.6, 350, None, None, 4, 24, 22),
)}

def pcie_h2d_GBps(gpu: GPUSpec, gen: int | None = None, lanes: int | None = None) -> float:
    """Achieved pinned host->device GB/s of one GPU on a Gen `gen` x `lanes` link (None: the table's link): the
    table's achieved figure scaled by the raw rate, which doubles with each PCIe generation (8, 16, 32, 64 GT/s a
    lane for Gen 3-6) and is linear in lanes (a consumer board's x8/x8 split halves it)."""
    gen, lanes = gen or gpu.pcie_gen, lanes or gpu.pcie_lanes
    return gpu.pcie_h2d_GBps * 2.0 ** (gen - gpu.pcie_gen) * lanes / gpu.pcie_lanes


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
    "h100-pcie": "H100-PCIe", "h100 pcie": "H100-PCIe", "h100-nvl": "H100-NVL", "h100 nvl": "H100-NVL",
    "h200-nvl": "H200-NVL", "h200 nvl": "H200-NVL",
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
    """Map a CUDA/NVML device name ('NVIDIA H200', 'NVIDIA A100-SXM4-80GB', 'NVIDIA H100 NVL', a MIG slice
    'NVIDIA A100-SXM4-80GB MIG 3g.40gb') to the table, or None (peak unknown)."""
    n = device_name.lower().split(" mig ")[0]     # the GPU's own name: a '3g.40gb' slice is no 40GB A100
    form = "-NVL" if "nvl" in n else "-PCIe" if "pcie" in n else ""
    gpu = None
    if "h200" in n:
        gpu = GPUS["H200" + ("-NVL" if form else "")]        # no H200 PCIe card but the NVL
    elif "h100" in n:
        gpu = GPUS["H100" + form]
    elif "a100" in n:
        gpu = GPUS["A100-40GB"] if "40g" in n else GPUS["A100-80GB"]
    elif "4090" in n:
        gpu = GPUS["RTX4090"]
    elif "l40s" in n:
        gpu = GPUS["L40S"]
    return for_device(gpu, device_name) if gpu else None


_MIG = re.compile(r"\bMIG\s+(\d)g\.(\d+)gb\b", re.I)
MIG_COMPUTE_SLICES = 7    # A100/H100/H200: 7 compute slices; memory slices scale with the profile's GB


def for_device(gpu: GPUSpec, device_name: str | None) -> GPUSpec | None:
    """`gpu` as `device_name` sees it: a MIG slice ('... MIG 3g.40gb') gets g/7 of the compute peaks and its
    share of memory and bandwidth (the profile's GB / the GPU's), never the whole GPU's; a MIG name whose
    profile cannot be read is None (peak unknown)."""
    if not device_name or "mig" not in device_name.lower().split():
        return gpu
    m = _MIG.search(device_name)
    if not m or not 0 < int(m.group(1)) <= MIG_COMPUTE_SLICES or not 0 < int(m.group(2)) <= gpu.memory_gb:
        return None
    c, mem = int(m.group(1)) / MIG_COMPUTE_SLICES, int(m.group(2)) / gpu.memory_gb
    return replace(gpu, name=f"{gpu.name} MIG {m.group(1)}g.{m.group(2)}gb", memory_gb=int(m.group(2)),
                   memory_bw_gbps=gpu.memory_bw_gbps * mem, bf16_tflops=gpu.bf16_tflops * c,
                   fp8_tflops=gpu.fp8_tflops * c if gpu.fp8_tflops else None, tf32_tflops=gpu.tf32_tflops * c,
                   fp32_tflops=gpu.fp32_tflops * c, mamf_bf16_tflops=gpu.mamf_bf16_tflops * c
                   if gpu.mamf_bf16_tflops else None, nvlink_gbps=None)
