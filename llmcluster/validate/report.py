"""Reports: the terminal tables, the JSON file (every measurement + the environment), the PNG plots."""

from __future__ import annotations

import json
import os
import platform
import socket
import statistics
import sys
import time
from pathlib import Path

from llmcluster.validate.result import STYLE, CheckResult, fmt_bytes, worst


def environment() -> dict:
    """Enough to reproduce or compare a run: host, software versions, the NCCL/Slurm settings in force."""
    from llmcluster import __version__

    env = {"time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "host": socket.gethostname(),
           "llmcluster": __version__, "python": platform.python_version(), "platform": platform.platform(),
           "argv": sys.argv, "cpus": os.cpu_count(),
           "env": {k: v for k, v in sorted(os.environ.items())
                   if k.startswith(("NCCL_", "SLURM_JOB", "SLURM_NNODES", "SLURM_NTASKS", "CUDA_VISIBLE",
                                    "OMP_NUM_THREADS", "UCX_", "MASTER_", "WORLD_SIZE"))}}
    if "torch" in sys.modules:        # only if a check already paid for importing it
        import torch
        env["torch"] = torch.__version__
        env["torch_cuda"] = torch.version.cuda
        if torch.cuda.is_available():
            env["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
            env["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    return env


def report_doc(results: list[CheckResult], extra: dict | None = None) -> dict:
    """The JSON report: `--json` prints it, `--report FILE` writes it."""
    doc = {"status": worst(r.status for r in results), "environment": environment(),
           "checks": [r.to_dict() for r in results]}
    coll = next((r for r in results if r.check == "collectives"), None)
    if coll is not None:   # the nccl-tests-shaped list at top level, as tools and the issue expect it
        doc["results"] = coll.data.get("results", [])
    doc.update(extra or {})
    return doc


def write_json(path: Path, results: list[CheckResult], extra: dict | None = None) -> None:
    doc = report_doc(results, extra)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(doc, indent=2, default=str))
    tmp.replace(path)


def print_summary(results: list[CheckResult], console=None) -> None:
    from rich.table import Table

    from llmcluster.console import console as piped_or_terminal

    console = console or piped_or_terminal()
    for r in results:
        if r.check == "collectives" and r.data.get("results"):
            console.print(collectives_table(r.data))
        t = Table(title=f"{r.check}{' @ ' + r.node if r.node else ''}: [{STYLE[r.status]}]{r.status}[/]",
                  title_justify="left", show_edge=False, pad_edge=False)
        t.add_column("item")
        t.add_column("status")
        t.add_column("value")
        t.add_column("detail", overflow="fold")
        for i in r.items:
            t.add_row(i.name, f"[{STYLE[i.status]}]{i.status}[/]", i.value, i.detail)
        console.print(t)
    overall = worst(r.status for r in results)
    console.print(f"[bold]validate: [{STYLE[overall]}]{overall}[/][/] "
                  + ", ".join(f"{r.check}{'@' + r.node if r.node else ''}={r.status}" for r in results))


def collectives_table(data: dict):
    """The nccl-tests layout: one line per op and size, out-of-place then in-place columns."""
    from rich.table import Table

    t = Table(title=f"collectives: {data.get('backend')} x {data.get('world_size')} ranks "
                    f"(busbw: nccl-tests factors; {data.get('iters')} iters, {data.get('warmup')} warm-up)",
              title_justify="left", show_edge=False, pad_edge=False)
    for col in ("op", "size", "count"):
        t.add_column(col, justify="right" if col != "op" else "left")
    for place in ("out-of-place", "in-place"):
        for col in ("time us", "algbw GB/s", "busbw GB/s", "#wrong"):
            t.add_column(f"{place}\n{col}" if col == "time us" else col, justify="right")
    rows: dict[tuple[str, int], dict] = {}
    for row in data["results"]:
        rows.setdefault((row["op"], row["bytes"]), {})[row["inplace"]] = row
    for (op, nbytes), by_place in rows.items():
        cells = [op, fmt_bytes(nbytes), str(next(iter(by_place.values()))["count"])]
        for inplace in (False, True):
            x = by_place.get(inplace)
            cells += ([f"{x['time_us']:.1f}", f"{x['algbw_GBps']:.2f}", f"{x['busbw_GBps']:.2f}",
                       f"[bold red]{x['wrong']}[/]" if x["wrong"] else "0"] if x else ["n/a", "", "", ""])
        t.add_row(*cells)
    return t


def write_plots(directory: Path, results: list[CheckResult]) -> list[Path]:
    """busbw vs message size per collective (nccl-tests curves) and per-node bars for each compared figure."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    directory.mkdir(parents=True, exist_ok=True)
    written = []
    coll = next((r for r in results if r.check == "collectives" and r.data.get("results")), None)
    if coll:
        fig, ax = plt.subplots(figsize=(8, 5))
        series: dict[str, list] = {}
        for row in coll.data["results"]:
            key = f"{row['op']}{' (in-place)' if row['inplace'] else ''}"
            series.setdefault(key, []).append((row["bytes"], row["busbw_GBps"]))
        for key, pts in series.items():
            pts.sort()
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=key)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("message size (bytes)")
        ax.set_ylabel("busbw (GB/s)")
        ax.set_title(f"busbw vs size: {coll.data.get('backend')}, {coll.data.get('world_size')} ranks")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
        written.append(_save(fig, directory / "collectives_busbw.png"))
    nodes = next((r for r in results if r.check == "nodes"), None)
    metrics = nodes.data.get("metrics", {}) if nodes else {}
    if metrics:
        tol = nodes.data["tolerance"]
        outliers = {(o["metric"], o["node"]) for o in nodes.data["outliers"]}
        fig, axes = plt.subplots(len(metrics), 1, figsize=(max(6, len(next(iter(metrics.values()))) * 0.6 + 3),
                                                           2.6 * len(metrics)), squeeze=False)
        for ax, (metric, values) in zip(axes[:, 0], metrics.items()):
            names = sorted(values)
            colors = ["tab:red" if (metric, n) in outliers else "tab:blue" for n in names]
            ax.bar(names, [values[n] for n in names], color=colors)
            med = statistics.median(values.values())
            ax.axhline(med, color="k", lw=1, label="median")
            ax.axhline(med * (1 - tol), color="tab:red", lw=1, ls="--", label=f"median - {tol:.0%}")
            ax.set_ylabel(metric, fontsize=8)
            ax.tick_params(axis="x", labelrotation=45, labelsize=7)
        axes[0, 0].legend(fontsize=7)
        written.append(_save(fig, directory / "nodes.png"))
    return written


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt
    plt.close(fig)
    return path
