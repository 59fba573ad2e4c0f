"""Helpers for the monitor tests (no tests here): a fake NVML, a PromQL metric-name extractor, exported names."""

from __future__ import annotations

import json
import re
import time
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import pynvml
import yaml
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

REPO = Path(__file__).resolve().parents[1]
MONITORING = REPO / "monitoring"
DASHBOARDS = sorted((MONITORING / "grafana").glob("*.json"))
GiB = 2**30


class FakeNVML:
    """Stands in for the `pynvml` module: a CI machine has no GPU and no libnvidia-ml, so NVML itself cannot
    run here. Same function names and signatures as pynvml, pynvml's own constants and error classes, and
    readings chosen per GPU. The real path runs in benchmarks/gpu_check.sh when a GPU machine is lent."""

    def __init__(self, gpus: list[dict], init_error: Exception | None = None):
        self.gpus, self.init_error = gpus, init_error
        self.events: list[SimpleNamespace] = []
        self.registered: list[int] = []
        self.shutdown = False

    def __getattr__(self, name):  # constants (NVML_*, nvmlEventType*) and error classes come from pynvml
        if name.startswith("nvml") and not name.startswith(("nvmlEventType", "nvmlMemory_v")):
            raise AttributeError(name)  # a function the fake lacks must fail loudly, never reach real NVML
        return getattr(pynvml, name)

    def _read(self, h, key):
        v = self.gpus[h][key]
        if isinstance(v, Exception):
            raise v
        return v

    def nvmlInit(self):
        if self.init_error:
            raise self.init_error

    def nvmlShutdown(self): self.shutdown = True
    def nvmlDeviceGetCount(self): return len(self.gpus)
    def nvmlDeviceGetHandleByIndex(self, i): return i
    def nvmlDeviceGetMinorNumber(self, h): return self.gpus[h]["minor"]
    def nvmlDeviceGetUUID(self, h): return self.gpus[h]["uuid"]
    def nvmlDeviceGetName(self, h): return self.gpus[h]["name"]
    def nvmlDeviceGetPciInfo(self, h): return SimpleNamespace(busId=self.gpus[h]["bus"])
    def nvmlDeviceGetClockInfo(self, h, clock):
        return self._read(h, "sm_mhz" if clock == pynvml.NVML_CLOCK_SM else "mem_mhz")
    def nvmlDeviceGetTemperature(self, h, sensor):
        assert sensor == pynvml.NVML_TEMPERATURE_GPU
        return self._read(h, "temp")
    def nvmlDeviceGetFieldValues(self, h, fields):
        assert fields == [pynvml.NVML_FI_DEV_MEMORY_TEMP]
        return [SimpleNamespace(nvmlReturn=pynvml.NVML_SUCCESS, value=SimpleNamespace(uiVal=self._read(h, "mem_temp")))]
    def nvmlDeviceGetPowerUsage(self, h): return self._read(h, "power_mw")
    def nvmlDeviceGetTotalEnergyConsumption(self, h): return self._read(h, "energy_mj")
    def nvmlDeviceGetPcieReplayCounter(self, h): return self._read(h, "pcie_replay")
    def nvmlDeviceGetUtilizationRates(self, h):
        return SimpleNamespace(gpu=self._read(h, "util"), memory=self._read(h, "mem_util"))
    def nvmlDeviceGetMemoryInfo(self, h, version=None):
        total, used = self._read(h, "fb_total"), self._read(h, "fb_used")
        if version is None:      # v1: the driver's reserved memory counts as used
            return SimpleNamespace(total=total, used=used, free=total - used)
        assert version == pynvml.nvmlMemory_v2
        reserved = self._read(h, "fb_reserved")     # an exception here plays an old driver without _v2
        return SimpleNamespace(version=version, total=total, reserved=reserved, used=used - reserved,
                               free=total - used)
    def nvmlDeviceGetCurrentClocksEventReasons(self, h): return self._read(h, "throttle")
    def nvmlDeviceGetViolationStatus(self, h, policy):
        return SimpleNamespace(violationTime=self._read(h, "violation_ns")[policy])
    def nvmlDeviceGetTotalEccErrors(self, h, err, counter):
        return self._read(h, "ecc")[(err, counter)]
    def nvmlDeviceGetRemappedRows(self, h): return self._read(h, "remapped")
    def nvmlEventSetCreate(self): return "event-set"
    def nvmlEventSetFree(self, s): pass
    def nvmlDeviceRegisterEvents(self, h, types, s):
        assert types == pynvml.nvmlEventTypeXidCriticalError and s == "event-set"
        self.registered.append(h)
    def nvmlEventSetWait_v2(self, s, timeout_ms):
        if not self.events:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_TIMEOUT)
        return self.events.pop(0)


def fake_gpu(i: int, **over) -> dict:
    """An H100-like GPU's readings in NVML's own units (mW, ns, bytes)."""
    C, U = pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED, pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED
    V, A = pynvml.NVML_VOLATILE_ECC, pynvml.NVML_AGGREGATE_ECC
    g = {"minor": i, "uuid": f"GPU-0000000{i}-aaaa-bbbb-cccc-dddddddddddd", "name": "NVIDIA H100 80GB HBM3",
         "bus": f"00000000:{0x18 + i:02X}:00.0", "sm_mhz": 1980, "mem_mhz": 2619, "temp": 45 + i,
         "mem_temp": 50 + i, "power_mw": 350123, "energy_mj": 123456789, "pcie_replay": 0, "util": 97,
         "mem_util": 40, "fb_total": 80 * GiB, "fb_used": 60 * GiB, "fb_reserved": 0, "throttle": 0x40 | 0x4,
         "violation_ns": {p: (p + 1) * 2_000_000_000 for p in range(6)},
         "ecc": {(C, V): 3, (U, V): 0, (C, A): 5, (U, A): 1}, "remapped": (2, 1, 0, 0)}
    g.update(over)
    return g


# ---- what our exporters publish -------------------------------------------------------------------
def families(text: str) -> dict[str, list]:
    out: dict[str, list] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out.setdefault(s.name, []).append(s)
    return out


def exported_metric_names(storage_root: Path) -> set[str]:
    """Every sample name `monitor serve` (with every GPU reading supported) and TrainMetrics publish."""
    from llmcluster.monitor.exporter import build_registry
    from llmcluster.monitor.train_metrics import TrainMetrics

    registry, _, _ = build_registry(storage_root, 8, nvml=FakeNVML([fake_gpu(0)]), hostname="n1")
    names = set(families(generate_latest(registry).decode()))
    tm = TrainMetrics("names", 0, None)
    tm.step(1, 2.0, 1e-3, 100.0, 0.3, 0.1)
    tm.rank_step_times([0.1, 0.2])
    tm.checkpoint(1, 1.0, time.time() - 5)
    tm.checkpoint(2, 1.0, time.time())
    tm.bad_step()
    tm.straggler(1)
    tm.ft_groups(2)
    names |= set(families(generate_latest(tm.registry).decode()))
    return names


def recording_rule_names() -> set[str]:
    doc = yaml.safe_load((MONITORING / "recording.yml").read_text())
    return {r["record"] for g in doc["groups"] for r in g["rules"]}


PROMETHEUS_BUILTINS = {"up", "ALERTS", "scrape_duration_seconds"}
# vLLM's own metrics, as a real vLLM 0.32 (CPU) served them: the serving rules and dashboard read these
VLLM_METRICS = {ln.strip() for ln in (REPO / "tests" / "data" / "vllm-metric-names.txt").read_text().splitlines()
                if ln.strip() and not ln.startswith("#")}


# ---- PromQL: which metric names does an expression read? ----------------------------------------------
_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless",
             "offset", "inf", "nan"}


def promql_metric_names(expr: str) -> set[str]:
    """Metric names in a PromQL expression: identifiers that are not functions, keywords, label names in
    matchers or grouping clauses, durations or numbers. Enough for the rules and dashboards we ship."""
    e = re.sub(r'"(?:\\.|[^"\\])*"', '""', expr)
    e = re.sub(r"\{[^}]*\}", "", e)
    e = re.sub(r"\[[^\]]*\]", "", e)
    e = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", e)
    names = set()
    for m in re.finditer(r"(?<![\w.$])[A-Za-z_:][\w:]*", e):
        if e[m.end():].lstrip().startswith("(") or m.group(0).lower() in _KEYWORDS:
            continue
        names.add(m.group(0))
    return names


def dashboard_queries(path: Path) -> list[str]:
    """Every PromQL expression of a dashboard: panel targets and the templating queries' metrics."""
    d = json.loads(path.read_text())
    exprs = [t["expr"] for p in d["panels"] for t in p.get("targets", [])]
    for v in d["templating"]["list"]:
        if v["type"] == "query":
            q = v["query"]["query"] if isinstance(v["query"], dict) else v["query"]
            m = re.fullmatch(r"label_values\((.+),\s*\w+\)", q)
            assert m, q
            exprs.append(m.group(1))
    return exprs


def http_get_json(url: str, timeout: float = 5.0) -> dict:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read().decode())
