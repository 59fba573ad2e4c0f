"""Across nodes: compare every node's figures, name the outliers, and drain them in Slurm.

A bad node rarely fails outright; it is the one whose matmul rate or copy bandwidth sits well below its
identical neighbours (a GPU stuck at low clocks, a PCIe link trained at x8, a bad DIMM). So each figure
is compared with the median over nodes: a node more than `tolerance` below it is an outlier. `--drain`
then does what a DeepOps-style prolog does: `scontrol update nodename=X state=drain reason=...`.
"""

from __future__ import annotations

import shutil
import statistics
import subprocess

from llmcluster.testing import test_hook
from llmcluster.validate.result import FAIL, PASS, WARN, CheckResult

SLOW_RANK_ENV = "LLMCLUSTER_VALIDATE_SLOW_RANK"   # test hook: this rank reports a fifth of its figures
SLOW_FACTOR = 0.2   # far outside run-to-run noise, so the test never depends on timing luck


def node_metrics(results: list[CheckResult]) -> dict[str, dict[str, float]]:
    """{figure: {node label: value}} for the figures worth comparing across nodes (higher is better)."""
    out: dict[str, dict[str, float]] = {}

    def put(metric: str, node: str, value) -> None:
        if isinstance(value, (int, float)) and value > 0:
            out.setdefault(metric, {})[node] = float(value)

    for r in results:
        d = r.data
        if r.check == "compute" and d.get("shapes"):
            dtype = d["shapes"][0]["dtype"]
            put(f"compute {dtype} TFLOP/s", r.node, max(s["tflops"] for s in d["shapes"] if s["dtype"] == dtype))
        elif r.check == "memory":
            put("memory copy GB/s", r.node, d.get("copy_GBps"))
        elif r.check == "pcie":
            put("pcie H2D pinned GB/s", r.node, d.get("H2D_pinned_GBps"))
        elif r.check == "storage":
            for a in d.get("areas", []):
                put(f"storage {a['area']} write GB/s", r.node, a.get("write_GBps"))
                put(f"storage {a['area']} read GB/s", r.node, a.get("read_GBps"))
    return out


def find_outliers(values: dict[str, float], tolerance: float) -> list[tuple[str, float, float]]:
    """(node, value, median) for each node more than `tolerance` below the median of all nodes."""
    if len(values) < 2:
        return []
    med = statistics.median(values.values())
    return [(n, v, med) for n, v in sorted(values.items()) if v < med * (1 - tolerance)]


def compare_nodes(results: list[CheckResult], tolerance: float) -> CheckResult:
    r = CheckResult("nodes")
    metrics = node_metrics(results)
    r.data = {"tolerance": tolerance, "metrics": metrics, "outliers": []}
    for metric, values in metrics.items():
        if len(values) < 2:    # one node (or one GPU): nothing to compare with
            continue
        outliers = find_outliers(values, tolerance)
        med = statistics.median(values.values())
        for node, v, _ in outliers:
            r.data["outliers"].append({"metric": metric, "node": node, "value": v, "median": med})
            r.add(f"{metric}: {node}", FAIL, f"{v:.4g}", f"{1 - v / med:.0%} below the median {med:.4g} "
                  f"of {len(values)} (tolerance {tolerance:.0%})")
        if not outliers:
            r.add(metric, PASS, f"median {med:.4g}", f"{len(values)} nodes within {tolerance:.0%}")
    return r


def nodes_to_drain(results: list[CheckResult], comparison: CheckResult) -> dict[str, str]:
    """{host: reason} for every host with a FAIL in its own checks or named as an outlier."""
    bad: dict[str, list[str]] = {}
    for r in results:
        if r.node and r.status == FAIL:
            bad.setdefault(host_of(r.node), []).append(f"{r.check}: {r.reason}")
    for o in comparison.data.get("outliers", []):
        bad.setdefault(host_of(o["node"]), []).append(
            f"{o['metric']} {o['value']:.4g} < median {o['median']:.4g}")
    return {h: "llmcluster validate: " + "; ".join(reasons) for h, reasons in bad.items()}


def host_of(label: str) -> str:
    return label.split(":")[0]


def drain_command(host: str, reason: str) -> list[str]:
    """The scontrol argv that drains `host` (the reason is one argument: no shell, no quoting to break)."""
    reason = " ".join(reason.split())[:200]
    return ["scontrol", "update", f"nodename={host}", "state=drain", f"reason={reason}"]


def drain(nodes: dict[str, str], run=subprocess.run) -> CheckResult:
    """Drain each node; `run` is injectable so tests can see the exact commands without a cluster."""
    r = CheckResult("drain")
    if not nodes:
        r.add("drain", PASS, "none", "no failing or outlier nodes")
        return r
    if run is subprocess.run and not shutil.which("scontrol"):
        for host, reason in nodes.items():
            r.add(f"drain {host}", WARN, detail=f"scontrol not on PATH; would drain: {reason}")
        return r
    for host, reason in sorted(nodes.items()):
        cmd = drain_command(host, reason)
        p = run(cmd, capture_output=True, text=True, timeout=30)
        ok = p.returncode == 0
        r.add(f"drain {host}", WARN if ok else FAIL, "drained" if ok else f"exit {p.returncode}",
              reason if ok else " ".join((p.stderr or p.stdout or "").split())[:160])
        r.data.setdefault("commands", []).append(cmd)
    return r


def inject_slowness(results: list[CheckResult], rank: int) -> None:
    """Test hook: if $LLMCLUSTER_VALIDATE_SLOW_RANK is this rank, scale its compared figures by SLOW_FACTOR."""
    if test_hook(SLOW_RANK_ENV) != str(rank):
        return
    for r in results:
        d = r.data
        for s in d.get("shapes", []):
            s["tflops"] *= SLOW_FACTOR
        for k in ("copy_GBps", "H2D_pinned_GBps"):
            if k in d:
                d[k] *= SLOW_FACTOR
        for a in d.get("areas", []):
            for k in ("write_GBps", "read_GBps"):
                if k in a:
                    a[k] *= SLOW_FACTOR
