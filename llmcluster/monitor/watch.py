"""`llmcluster monitor watch`: `nvidia-smi dmon` plus the training job, for operators without Grafana.

Reads the same /metrics endpoints Prometheus scrapes (node exporters and trainer ports, or dcgm-exporter)
and draws them as rich tables, refreshed in place. CPU busy % needs two readings of the CPU counters, so
the first frame (and `--once`) shows the load average only.
"""

from __future__ import annotations

import math
import sys
import time
import urllib.request
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families
from rich.console import Group
from rich.table import Table

from llmcluster.console import console as piped_or_terminal

from llmcluster.errors import UserError

# nvmlClocksEventReasons bits that mean "slowed down by something wrong", as nvidia-smi names them.
THROTTLE_BITS = {0x4: "sw-power", 0x8: "hw-slowdown", 0x20: "sw-thermal", 0x40: "hw-thermal",
                 0x80: "power-brake"}


@dataclass
class Snapshot:
    target: str
    error: str | None = None
    at: float = 0.0
    # metric name -> [(labels, value)]
    samples: dict[str, list[tuple[dict[str, str], float]]] = field(default_factory=dict)

    def get(self, name: str, **match: str) -> list[tuple[dict[str, str], float]]:
        return [(lb, v) for lb, v in self.samples.get(name, []) if all(lb.get(k) == x for k, x in match.items())]

    def one(self, name: str, **match: str) -> float | None:
        found = self.get(name, **match)
        return found[0][1] if found else None


def scrape(target: str, timeout: float = 3.0) -> Snapshot:
    url = target if target.startswith("http") else f"http://{target}/metrics"
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            text = r.read().decode()
    except (OSError, ValueError) as e:
        return Snapshot(target, error=str(getattr(e, "reason", e)))
    snap = Snapshot(target, at=time.time())
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            snap.samples.setdefault(s.name, []).append((s.labels, s.value))
    return snap


def _f(v: float | None, fmt: str = "{:.0f}", missing: str = "-") -> str:
    if v is None:
        return missing
    if isinstance(v, float) and math.isnan(v):
        return "NaN"
    return fmt.format(v)


def _throttle(mask: float | None) -> str:
    if mask is None:
        return "-"
    names = [n for bit, n in THROTTLE_BITS.items() if int(mask) & bit]
    return ",".join(names) or "none"


def _cpu_busy(now: Snapshot, prev: Snapshot | None) -> float | None:
    if prev is None or prev.error or now.error:
        return None
    def totals(s):
        rows = s.get("llmcluster_node_cpu_seconds_total")
        return sum(v for _, v in rows), sum(v for lb, v in rows if lb.get("mode") in ("idle", "iowait"))
    (t1, i1), (t0, i0) = totals(now), totals(prev)
    return None if t1 <= t0 else 100 * (1 - (i1 - i0) / (t1 - t0))


def render(snaps: list[Snapshot], prev: dict[str, Snapshot]) -> Group:
    nodes = Table(title="nodes", title_justify="left")
    for c in ("target", "cpu %", "load1", "mem used", "GPUs", "NVML"):
        nodes.add_column(c, justify="left" if c == "target" else "right")
    gpus = Table(title="GPUs", title_justify="left")
    for c in ("host", "gpu", "model", "util %", "mem %", "temp C", "mem C", "power W", "FB used GiB",
              "SM MHz", "XID", "throttle"):
        gpus.add_column(c, justify="left" if c in ("host", "model", "throttle") else "right")
    disks = Table(title="storage", title_justify="left")
    for c in ("target", "area", "used %", "avail GiB", "inodes used %"):
        disks.add_column(c, justify="left" if c in ("target", "area") else "right")
    train = Table(title="training", title_justify="left")
    for c in ("target", "run", "rank", "step", "loss", "tokens/s", "MFU %", "step s", "ckpt age",
              "bad", "straggler"):
        train.add_column(c, justify="left" if c in ("target", "run") else "right")

    for s in snaps:
        if s.error:
            nodes.add_row(s.target, f"[red]DOWN[/red] {s.error}", "", "", "", "")
            continue
        if "llmcluster_node_cpus" in s.samples:
            total, avail = s.one("llmcluster_node_memory_total_bytes"), s.one("llmcluster_node_memory_available_bytes")
            mem = f"{(total - avail) / 2**30:.1f}/{total / 2**30:.1f} GiB" if total and avail is not None else "-"
            present, expected = s.one("llmcluster_node_gpus_present"), s.one("llmcluster_node_gpus_expected")
            gpu_col = _f(present) + ("" if expected is None else f"/{expected:.0f}")
            if expected is not None and present is not None and present < expected:
                gpu_col = f"[red]{gpu_col}[/red]"
            nodes.add_row(s.target, _f(_cpu_busy(s, prev.get(s.target)), "{:.0f}"),
                          _f(s.one("llmcluster_node_load1"), "{:.2f}"), mem, gpu_col,
                          "up" if s.one("llmcluster_node_nvml_up") else "absent")
        for lb, util in s.get("DCGM_FI_DEV_GPU_UTIL"):
            key = {"UUID": lb.get("UUID", "")}
            temp = s.one("DCGM_FI_DEV_GPU_TEMP", **key)
            xid = s.one("DCGM_FI_DEV_XID_ERRORS", **key)
            fb_used = s.one("DCGM_FI_DEV_FB_USED", **key)  # MiB, as DCGM reports it
            gpus.add_row(lb.get("Hostname", s.target), lb.get("gpu", "?"), lb.get("modelName", ""), _f(util),
                         _f(s.one("DCGM_FI_DEV_MEM_COPY_UTIL", **key)),
                         _f(temp) if temp is None or temp < 84 else f"[red]{temp:.0f}[/red]",
                         _f(s.one("DCGM_FI_DEV_MEMORY_TEMP", **key)),
                         _f(s.one("DCGM_FI_DEV_POWER_USAGE", **key)),
                         _f(None if fb_used is None else fb_used / 1024, "{:.1f}"),
                         _f(s.one("DCGM_FI_DEV_SM_CLOCK", **key)),
                         _f(xid) if not xid else f"[red]{xid:.0f}[/red]",
                         _throttle(s.one("DCGM_FI_DEV_CLOCK_THROTTLE_REASONS", **key)))
        for lb, size in s.get("llmcluster_storage_size_bytes"):
            key = {"area": lb["area"]}
            avail = s.one("llmcluster_storage_avail_bytes", **key)
            files, ffree = s.one("llmcluster_storage_files", **key), s.one("llmcluster_storage_files_free", **key)
            used = None if avail is None or not size else 100 * (1 - avail / size)
            iused = None if files is None or ffree is None else 100 * (1 - ffree / files)
            disks.add_row(s.target, lb["area"], _pct(used), _f(None if avail is None else avail / 2**30, "{:.1f}"),
                          _pct(iused))
        # every training process from its start (start_timestamp is set at once; step only after the first one)
        for lb, _start in s.get("llmcluster_train_start_timestamp_seconds"):
            key = {"run": lb["run"], "rank": lb["rank"]}
            step = s.one("llmcluster_train_step", **key)
            mfu = s.one("llmcluster_train_mfu", **key)
            straggler = s.one("llmcluster_train_straggler_rank", **key)
            train.add_row(s.target, lb["run"], lb["rank"], _f(step, missing="starting"), _f(s.one("llmcluster_train_loss", **key), "{:.4f}"),
                          _f(s.one("llmcluster_train_tokens_per_second", **key)),
                          _f(None if mfu is None else 100 * mfu, "{:.1f}"),
                          _f(s.one("llmcluster_train_step_time_seconds", **key), "{:.3f}"),
                          _f(s.one("llmcluster_train_checkpoint_age_seconds", **key), "{:.0f}s"),
                          _f(s.one("llmcluster_train_bad_steps_total", **key)),
                          "-" if straggler is None or straggler < 0 else f"[yellow]rank {straggler:.0f}[/yellow]")
    parts = [t for t in (nodes, gpus, disks, train) if t.row_count]
    return Group(*parts) if parts else Group("no targets answered")


def _pct(v: float | None) -> str:
    if v is None:
        return "-"
    s = f"{v:.1f}"
    return f"[red]{s}[/red]" if v >= 85 else f"[yellow]{s}[/yellow]" if v >= 70 else s


def watch(targets: list[str], interval: float, once: bool) -> int:
    if not targets:
        raise UserError("--targets is empty")
    for t in targets:   # HOST:PORT each, before any scrape (`--targets garbage` was a DOWN row, not an error)
        from llmcluster.monitor.serve_targets import scrape_target

        host, _, port = t.rpartition(":")
        if not port.isdigit():
            raise UserError(f"--targets: {t!r} is not HOST:PORT (e.g. 127.0.0.1:9400)")
        scrape_target(host, int(port), "--targets")
    if interval <= 0:
        raise UserError(f"--interval must be > 0 (got {interval})")
    console = piped_or_terminal()
    prev: dict[str, Snapshot] = {}
    if once:
        snaps = [scrape(t) for t in targets]
        console.print(render(snaps, prev))
        down = [s.target for s in snaps if s.error]
        if down:   # a check (`--once` in a script): a DOWN target is a failure, said in one line after the tables
            print(f"monitor watch: {len(down)} of {len(snaps)} target(s) DOWN: {', '.join(down)}", file=sys.stderr)
        return 1 if down else 0
    from rich.live import Live

    with Live(console=console, auto_refresh=False, screen=False) as live:
        while True:
            snaps = [scrape(t) for t in targets]
            live.update(render(snaps, prev), refresh=True)
            prev = {s.target: s for s in snaps if not s.error}
            time.sleep(interval)
