"""Host metrics of one node: CPU, memory, disk space and inodes of each storage area, GPUs present vs expected.

Read straight from /proc and statvfs on every scrape (what node_exporter does, without its hundreds of
series): a training node needs only these to explain a slow or failing job, and the disk/inode ratios are
what the storage alerts fire on. A full node_exporter can run next to this one; names do not collide.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from llmcluster.storage.layout import AREAS

CPU_MODES = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")


def read_cpu_seconds(proc_stat: Path = Path("/proc/stat")) -> dict[str, float]:
    """Seconds spent in each mode by all CPUs together since boot (first line of /proc/stat)."""
    ticks = os.sysconf("SC_CLK_TCK")
    with open(proc_stat) as f:
        fields = f.readline().split()
    assert fields[0] == "cpu", fields
    return {mode: int(v) / ticks for mode, v in zip(CPU_MODES, fields[1:])}


def read_meminfo(meminfo: Path = Path("/proc/meminfo")) -> dict[str, int]:
    """/proc/meminfo in bytes: {'MemTotal': ..., 'MemAvailable': ...}."""
    out = {}
    with open(meminfo) as f:
        for line in f:
            key, _, rest = line.partition(":")
            parts = rest.split()
            if parts:
                out[key] = int(parts[0]) * (1024 if parts[1:] == ["kB"] else 1)
    return out


class NodeCollector:
    def __init__(self, storage_root: Path | None, expected_gpus: int | None, gpus_present: Callable[[], int],
                 nvml_up: bool):
        self.storage_root = storage_root
        self.expected_gpus = expected_gpus
        self.gpus_present = gpus_present  # asked at every scrape: GPUs can disappear while we run
        self.nvml_up = nvml_up

    def areas(self) -> list[tuple[str, Path]]:
        if self.storage_root is None:
            return []
        return [(a, self.storage_root / a) for a in AREAS if (self.storage_root / a).is_dir()]

    def collect(self):
        cpu = CounterMetricFamily("llmcluster_node_cpu_seconds", "Seconds all CPUs spent in each mode.",
                                  labels=["mode"])
        for mode, secs in read_cpu_seconds().items():
            cpu.add_metric([mode], secs)
        yield cpu
        yield GaugeMetricFamily("llmcluster_node_cpus", "Online CPUs.", value=os.cpu_count() or 0)
        yield GaugeMetricFamily("llmcluster_node_load1", "1-minute load average.", value=os.getloadavg()[0])

        mem = read_meminfo()
        yield GaugeMetricFamily("llmcluster_node_memory_total_bytes", "Physical memory.",
                                value=mem.get("MemTotal", 0))
        yield GaugeMetricFamily("llmcluster_node_memory_available_bytes",
                                "Memory available to new processes without swapping (MemAvailable).",
                                value=mem.get("MemAvailable", mem.get("MemFree", 0)))

        size = GaugeMetricFamily("llmcluster_storage_size_bytes", "Size of the filesystem holding the "
                                 "storage area.", labels=["area", "path"])
        avail = GaugeMetricFamily("llmcluster_storage_avail_bytes", "Bytes an unprivileged user can still "
                                  "write there (what df shows as Avail).", labels=["area", "path"])
        files = GaugeMetricFamily("llmcluster_storage_files", "Inodes of the filesystem holding the area.",
                                  labels=["area", "path"])
        files_free = GaugeMetricFamily("llmcluster_storage_files_free", "Free inodes there.",
                                       labels=["area", "path"])
        for area, path in self.areas():
            try:
                st = os.statvfs(path)
            except OSError:
                continue  # unmounted NFS: the area disappears from the metrics, the dashboards show a gap
            labels = [area, str(path)]
            size.add_metric(labels, st.f_blocks * st.f_frsize)
            avail.add_metric(labels, st.f_bavail * st.f_frsize)
            if st.f_files:  # some filesystems (btrfs, many NFS servers) report no inode limit
                files.add_metric(labels, st.f_files)
                files_free.add_metric(labels, st.f_favail)
        yield from (size, avail, files, files_free)

        yield GaugeMetricFamily("llmcluster_node_gpus_present", "GPUs NVML can see on this node.",
                                value=self.gpus_present())
        if self.expected_gpus is not None:
            yield GaugeMetricFamily("llmcluster_node_gpus_expected", "GPUs this node should have "
                                    "(--expected-gpus).", value=self.expected_gpus)
        yield GaugeMetricFamily("llmcluster_node_nvml_up", "1 if NVML initialised, 0 if GPUs are absent "
                                "or the driver is not loaded.", value=1 if self.nvml_up else 0)

    def describe(self):
        return []
