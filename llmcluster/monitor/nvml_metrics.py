"""GPU metrics from NVML under dcgm-exporter's names and labels, so existing DCGM dashboards and alerts work.

dcgm-exporter needs the DCGM host engine; NVML ships with every driver. We read the same quantities through
`nvidia-ml-py` and publish them as dcgm-exporter would (names from its etc/default-counters.csv, including
the violation and ECC counters it leaves commented out by default; units as DCGM reports them: MiB, W, MHz,
microseconds of violation time, mJ). Labels: gpu, UUID, pci_bus_id, device, modelName, Hostname.

`nvml` is the `pynvml` module in production and a fake object with the same functions in the tests (there
is no GPU on a CI machine). A reading the GPU does not support (NVMLError_NotSupported, e.g. ECC on a
GeForce) is left out for that GPU instead of being exported as a made-up 0. Any other exception from one
reading (a binding that changed a struct, a driver returning a value the binding cannot convert) skips that
reading and counts in llmcluster_nvml_read_errors: one bad call must not fail the whole scrape, whose other
metrics (the node's, the GPU count) are what the alerts need most.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from typing import Any, Callable

from prometheus_client.core import Metric

# (name, prometheus type, help, reader(nvml, handle) -> number). Order = exposition order.
Reader = Callable[[Any, Any], float]


def _mem_temp(nv, h):
    fv = nv.nvmlDeviceGetFieldValues(h, [nv.NVML_FI_DEV_MEMORY_TEMP])[0]
    if fv.nvmlReturn != nv.NVML_SUCCESS:
        raise nv.NVMLError(fv.nvmlReturn)
    return fv.value.uiVal


def _memory(nv, h):
    """Framebuffer memory. v2 (driver >= R510) reports the driver's reserved memory apart; v1 counts it as
    used, so an idle H100 would show ~500 MiB used. v1 where v2 is missing: an older driver or binding."""
    try:
        return nv.nvmlDeviceGetMemoryInfo(h, version=nv.nvmlMemory_v2)
    except (AttributeError, TypeError, nv.NVMLError_FunctionNotFound, nv.NVMLError_NotSupported):
        return nv.nvmlDeviceGetMemoryInfo(h)


def _ecc(kind: str, counter: str) -> Reader:
    def read(nv, h):
        err = nv.NVML_MEMORY_ERROR_TYPE_CORRECTED if kind == "SBE" else nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED
        where = nv.NVML_VOLATILE_ECC if counter == "VOL" else nv.NVML_AGGREGATE_ECC
        return nv.nvmlDeviceGetTotalEccErrors(h, err, where)
    return read


def _violation(policy: str) -> Reader:
    # NVML reports nanoseconds of violation time; DCGM (and so every dashboard) uses microseconds.
    def read(nv, h):
        return nv.nvmlDeviceGetViolationStatus(h, getattr(nv, f"NVML_PERF_POLICY_{policy}")).violationTime / 1e3
    return read


def _throttle_reasons(nv, h):
    fn = getattr(nv, "nvmlDeviceGetCurrentClocksEventReasons", None) or nv.nvmlDeviceGetCurrentClocksThrottleReasons
    return fn(h)


GPU_FIELDS: list[tuple[str, str, str, Reader]] = [
    ("DCGM_FI_DEV_SM_CLOCK", "gauge", "SM clock frequency (in MHz).",
     lambda nv, h: nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM)),
    ("DCGM_FI_DEV_MEM_CLOCK", "gauge", "Memory clock frequency (in MHz).",
     lambda nv, h: nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_MEM)),
    ("DCGM_FI_DEV_MEMORY_TEMP", "gauge", "Memory temperature (in C).", _mem_temp),
    ("DCGM_FI_DEV_GPU_TEMP", "gauge", "GPU temperature (in C).",
     lambda nv, h: nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU)),
    ("DCGM_FI_DEV_POWER_USAGE", "gauge", "Power draw (in W).",
     lambda nv, h: nv.nvmlDeviceGetPowerUsage(h) / 1e3),
    ("DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION", "counter", "Total energy consumption since boot (in mJ).",
     lambda nv, h: nv.nvmlDeviceGetTotalEnergyConsumption(h)),
    ("DCGM_FI_DEV_PCIE_REPLAY_COUNTER", "counter", "Total number of PCIe retries.",
     lambda nv, h: nv.nvmlDeviceGetPcieReplayCounter(h)),
    ("DCGM_FI_DEV_GPU_UTIL", "gauge", "GPU utilization (in %).",
     lambda nv, h: nv.nvmlDeviceGetUtilizationRates(h).gpu),
    ("DCGM_FI_DEV_MEM_COPY_UTIL", "gauge", "Memory utilization (in %).",
     lambda nv, h: nv.nvmlDeviceGetUtilizationRates(h).memory),
    ("DCGM_FI_DEV_FB_FREE", "gauge", "Framebuffer memory free (in MiB).",
     lambda nv, h: _memory(nv, h).free / 2**20),
    ("DCGM_FI_DEV_FB_USED", "gauge", "Framebuffer memory used (in MiB).",
     lambda nv, h: _memory(nv, h).used / 2**20),
    ("DCGM_FI_DEV_FB_TOTAL", "gauge", "Framebuffer memory total (in MiB).",
     lambda nv, h: _memory(nv, h).total / 2**20),
    ("DCGM_FI_DEV_CLOCK_THROTTLE_REASONS", "gauge",
     "Current clock throttle reasons (bitmask of nvmlClocksEventReasons).", _throttle_reasons),
    ("DCGM_FI_DEV_POWER_VIOLATION", "counter", "Throttling duration due to power constraints (in us).",
     _violation("POWER")),
    ("DCGM_FI_DEV_THERMAL_VIOLATION", "counter", "Throttling duration due to thermal constraints (in us).",
     _violation("THERMAL")),
    ("DCGM_FI_DEV_SYNC_BOOST_VIOLATION", "counter", "Throttling duration due to sync-boost constraints (in us).",
     _violation("SYNC_BOOST")),
    ("DCGM_FI_DEV_BOARD_LIMIT_VIOLATION", "counter", "Throttling duration due to board limit constraints (in us).",
     _violation("BOARD_LIMIT")),
    ("DCGM_FI_DEV_LOW_UTIL_VIOLATION", "counter", "Throttling duration due to low utilization (in us).",
     _violation("LOW_UTILIZATION")),
    ("DCGM_FI_DEV_RELIABILITY_VIOLATION", "counter", "Throttling duration due to reliability constraints (in us).",
     _violation("RELIABILITY")),
    ("DCGM_FI_DEV_ECC_SBE_VOL_TOTAL", "counter", "Total number of single-bit volatile ECC errors.", _ecc("SBE", "VOL")),
    ("DCGM_FI_DEV_ECC_DBE_VOL_TOTAL", "counter", "Total number of double-bit volatile ECC errors.", _ecc("DBE", "VOL")),
    ("DCGM_FI_DEV_ECC_SBE_AGG_TOTAL", "counter", "Total number of single-bit persistent ECC errors.", _ecc("SBE", "AGG")),
    ("DCGM_FI_DEV_ECC_DBE_AGG_TOTAL", "counter", "Total number of double-bit persistent ECC errors.", _ecc("DBE", "AGG")),
    ("DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS", "counter", "Number of remapped rows for uncorrectable errors",
     lambda nv, h: nv.nvmlDeviceGetRemappedRows(h)[1]),
    ("DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS", "counter", "Number of remapped rows for correctable errors",
     lambda nv, h: nv.nvmlDeviceGetRemappedRows(h)[0]),
    ("DCGM_FI_DEV_ROW_REMAP_PENDING", "gauge", "Whether a row remap is pending (the GPU needs a reset)",
     lambda nv, h: nv.nvmlDeviceGetRemappedRows(h)[2]),
    ("DCGM_FI_DEV_ROW_REMAP_FAILURE", "gauge", "Whether remapping of rows has failed",
     lambda nv, h: nv.nvmlDeviceGetRemappedRows(h)[3]),
]
XID_METRIC = ("DCGM_FI_DEV_XID_ERRORS", "gauge", "Value of the last XID error encountered.")
ERROR_METRIC = ("llmcluster_nvml_read_errors", "Readings skipped because the NVML call raised something other "
                "than an NVML error, since start-up (labels: gpu, the metric that was skipped).")
GPU_LABELS = ("gpu", "UUID", "pci_bus_id", "device", "modelName", "Hostname")
GPU_METRIC_NAMES = [f[0] for f in GPU_FIELDS] + [XID_METRIC[0]]


def _exposed_type(typ: str) -> str:
    """prometheus_client's text format renames a counter family to NAME_total; DCGM's counters do not end
    in _total, and the name is what dashboards match. Expose them untyped (the TYPE line is only metadata
    to Prometheus; rate() works the same) rather than with a HELP/TYPE name that differs from the samples."""
    return "unknown" if typ == "counter" else typ


def _text(v) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


@dataclass
class Gpu:
    handle: Any
    labels: dict[str, str]


class GpuCollector:
    """A prometheus_client collector reading NVML on every scrape (like node_exporter, unlike DCGM's
    background polling: a scrape every 15 s costs a few hundred microseconds of NVML calls per GPU)."""

    def __init__(self, nvml: Any | None = None, hostname: str | None = None):
        self.hostname = hostname or socket.gethostname()
        self.gpus: list[Gpu] = []
        self.error: str | None = None      # why there are no GPU metrics, when there are none
        self._xid_last: dict[str, int] = {}  # UUID -> last XID seen
        self._events = None
        self.read_errors: dict[tuple[str, str], int] = {}   # (gpu, metric) -> non-NVML exceptions so far
        if nvml is None:
            try:
                import pynvml as nvml
            except ImportError as e:  # nvidia-ml-py is a dependency, but be explicit if it is missing
                self.nv, self.error = None, f"nvidia-ml-py not importable: {e}"
                return
        self.nv = nvml
        try:
            nvml.nvmlInit()
        except Exception as e:  # NVMLError_LibraryNotFound / DriverNotLoaded on a CPU node
            self.error = f"NVML unavailable: {e}"
            return
        for i in range(nvml.nvmlDeviceGetCount()):
            try:
                h = nvml.nvmlDeviceGetHandleByIndex(i)
                try:
                    minor = nvml.nvmlDeviceGetMinorNumber(h)
                except nvml.NVMLError:
                    minor = i
                labels = {"gpu": str(i), "UUID": _text(nvml.nvmlDeviceGetUUID(h)),
                          "pci_bus_id": _text(nvml.nvmlDeviceGetPciInfo(h).busId), "device": f"nvidia{minor}",
                          "modelName": _text(nvml.nvmlDeviceGetName(h)), "Hostname": self.hostname}
            except nvml.NVMLError:  # e.g. GPU_IS_LOST at start-up: it is not present, and counts as missing
                continue
            self.gpus.append(Gpu(h, labels))
            self._xid_last[labels["UUID"]] = 0
        self._watch_xids()

    def _watch_xids(self) -> None:
        """XIDs arrive as NVML events, not as a readable value: register once, drain on every scrape."""
        nv = self.nv
        try:
            self._events = nv.nvmlEventSetCreate()
        except nv.NVMLError:
            return
        for g in self.gpus:
            try:
                nv.nvmlDeviceRegisterEvents(g.handle, nv.nvmlEventTypeXidCriticalError, self._events)
            except nv.NVMLError:
                pass  # not supported on this GPU (or without root on some drivers): no XID for it

    def _drain_xids(self) -> None:
        if self._events is None:
            return
        nv = self.nv
        while True:
            try:
                ev = nv.nvmlEventSetWait_v2(self._events, 0)
            except nv.NVMLError:  # NVML_ERROR_TIMEOUT: nothing pending
                return
            try:
                self._xid_last[_text(nv.nvmlDeviceGetUUID(ev.device))] = int(ev.eventData)
            except nv.NVMLError:
                pass
            except Exception:
                self._count_error("all", XID_METRIC[0])

    @property
    def count(self) -> int:
        return len(self.gpus)

    def responding(self) -> int:
        """GPUs that answer now. A GPU that falls off the bus after start-up (XID 79) keeps its handle but
        fails every call: it must count as missing, or GPUCountBelowExpected would never fire for it."""
        n = 0
        for g in self.gpus:
            try:
                self.nv.nvmlDeviceGetMemoryInfo(g.handle)
                n += 1
            except self.nv.NVMLError:
                pass
            except Exception:   # not answering as NVML should: missing, and counted
                self._count_error(g.labels["gpu"], "llmcluster_node_gpus_present")
        return n

    def _count_error(self, gpu: str, metric: str) -> None:
        self.read_errors[(gpu, metric)] = self.read_errors.get((gpu, metric), 0) + 1

    def collect(self):
        if not self.gpus:
            return
        nv = self.nv
        self._drain_xids()
        for name, typ, doc, read in GPU_FIELDS:
            m = Metric(name, doc, _exposed_type(typ))
            for g in self.gpus:
                try:
                    value = float(read(nv, g.handle))
                except nv.NVMLError:
                    continue
                except Exception:   # skip this reading, keep the scrape (module docstring)
                    self._count_error(g.labels["gpu"], name)
                    continue
                m.add_sample(name, g.labels, value)
            if m.samples:
                yield m
        name, typ, doc = XID_METRIC
        m = Metric(name, doc, typ)
        for g in self.gpus:
            m.add_sample(name, g.labels, float(self._xid_last.get(g.labels["UUID"], 0)))
        yield m
        name, doc = ERROR_METRIC
        m = Metric(name, doc, "unknown")     # a counter, exposed as DCGM's are (see _exposed_type)
        for (gpu, metric), n in sorted(self.read_errors.items()):
            m.add_sample(name, {"gpu": gpu, "metric": metric, "Hostname": self.hostname}, float(n))
        if m.samples:
            yield m

    def describe(self):
        return []  # names depend on what the GPUs support; do not let the registry call collect() early

    def close(self) -> None:
        if self.nv is not None and self.error is None:
            try:
                if self._events is not None:
                    self.nv.nvmlEventSetFree(self._events)
                self.nv.nvmlShutdown()
            except Exception:
                pass
