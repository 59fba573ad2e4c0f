"""Energy measured on GPU ranks (issue 67): NVML's total-energy counter (millijoules since the driver loaded) read
when a rank starts training and again at each checkpoint and at its end; what it drew since is appended to the run's
records (storage/energy.py). Where NVML or the counter is not there (a CPU run, an older GPU: NotSupported) the
meter is off and nothing is written: the model card then says the energy was not measured."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from llmcluster.storage import energy


class EnergyMeter:
    def __init__(self, logs: Path, rank: int, gpu_uuid: str | None, nvml: Any | None = None):
        """`gpu_uuid`: the rank's GPU as CUDA names it (torch's device properties): NVML's indices are not CUDA's
        under CUDA_VISIBLE_DEVICES, its UUIDs are the same GPU's. None: no GPU, no meter."""
        self.logs, self.rank, self.handle, self.start_mj = logs, rank, None, None
        if not gpu_uuid:
            return
        try:
            if nvml is None:
                import pynvml as nvml
            nvml.nvmlInit()
            self.gpu = gpu_uuid if gpu_uuid.startswith(("GPU-", "MIG-")) else f"GPU-{gpu_uuid}"
            self.handle = nvml.nvmlDeviceGetHandleByUUID(self.gpu)
            self.nv = nvml
            self.start_mj = nvml.nvmlDeviceGetTotalEnergyConsumption(self.handle)
            self.since = time.time()
        except Exception:   # no NVML, no such counter on this GPU: measured nowhere, said by the card
            self.handle = self.start_mj = None

    @property
    def on(self) -> bool:
        return self.start_mj is not None

    def record(self, attempt: int | None = None) -> None:
        """Append the joules drawn since this rank started (a failed read skips this line, never the training)."""
        if not self.on:
            return
        try:
            joules = (self.nv.nvmlDeviceGetTotalEnergyConsumption(self.handle) - self.start_mj) / 1000
            energy.append(self.logs, self.rank, {"t": round(time.time(), 3), "since": round(self.since, 6),
                                                 "rank": self.rank, "joules": max(0.0, joules), "gpu": self.gpu,
                                                 **({"attempt": attempt} if attempt else {})})
        except Exception:   # a lost GPU, a full disk: this reading is missing, the next one has the total
            pass
