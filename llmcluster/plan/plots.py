"""`--plot DIR`: memory breakdown per GPU, cumulative cost over months (cloud vs on-premise), and where a
step's time goes (the step model's terms, stacked); with `--finetune`, every fine-tuning method's peak GB a GPU
against the card's memory."""

from __future__ import annotations

from pathlib import Path
from typing import Any

FILES = ("memory.png", "cost.png", "step.png")   # what --plot DIR writes (checked before any work: paths.check_output_path)
FINETUNE_FILE = "finetune.png"                    # what --finetune --plot DIR writes


def plot(r: dict[str, Any], out_dir: str | Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    name = r["model"]["name"] or "model"

    per = r["memory"]["per_gpu_bytes"]
    parts = ("weights", "gradients", "optimizer", "activations", "buffers")
    fig, ax = plt.subplots(figsize=(6, 4))
    _stacked(ax, "per GPU", [(part, per[part] / 1024**3) for part in parts])
    ax.axhline(r["memory"]["gpu_capacity_bytes"] / 1024**3, color="black", linestyle="--", label="GPU memory")
    mem_path = _save(fig, ax, "GiB", f"{name}: memory per GPU", out / FILES[0])

    cs = r["cost"]
    be = cs["break_even_months"]
    horizon = int(min(120, max(36, 2 * be))) if be else 60
    months = list(range(horizon + 1))
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(months, [cs["cloud_usd_per_month"] * m / 1e6 for m in months], label="cloud")
    ax.plot(months, [(cs["onprem_capex_usd"] + cs["onprem_opex_usd_per_month"] * m) / 1e6 for m in months],
            label="on-premise")
    if be and be <= horizon:
        ax.axvline(be, color="grey", linestyle=":", label=f"break-even {be:.0f} months")
    ax.set_xlabel(f"months at {cs['utilisation']:.0%} utilisation")
    cost_path = _save(fig, ax, "cumulative cost (M$)", f"{name}: cloud vs on-premise", out / FILES[1])
    return [mem_path, cost_path, breakdown_plot(r, out)]


def breakdown_plot(r: dict[str, Any], out: Path) -> Path:
    """step.png: one optimizer step's time stacked by term (compute.breakdown_s, without the "compute" sum)."""
    import matplotlib.pyplot as plt

    from llmcluster.plan.report import BREAKDOWN

    b, step = r["compute"]["breakdown_s"], r["compute"]["step_time_s"]
    fig, ax = plt.subplots(figsize=(6, 4))
    _stacked(ax, "one optimizer step", [(f"{label} ({b[key] / step:.0%})", b[key]) for key, label in BREAKDOWN])
    return _save(fig, ax, "seconds", f"{r['model']['name'] or 'model'}: where the step time goes", out / FILES[2])


def finetune_plot(result: dict[str, Any], out_dir: str | Path) -> Path:
    """finetune.png: peak GB a GPU of each row of the fine-tuning table (plan/finetune_report.py), a bar each,
    against the card's capacity (log scale); a method over the card is red, one over the host's RAM orange."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rows = result["rows"]
    fig, ax = plt.subplots(figsize=(9, 4.5))
    labels = [" ".join([r["method"], r["optimizer"].replace("adamw", "AdamW").replace("AdamW8bit", "AdamW 8-bit"),
                        *(["offload"] if r["offload"] else [])]) for r in rows]
    over_card = [r["peak_gb"] > r["capacity_gb"] for r in rows]
    colors = ["tab:green" if r["fits"] else "tab:red" if over else "tab:orange" for r, over in zip(rows, over_card)]
    bars = ax.bar(range(len(rows)), [r["peak_gb"] for r in rows], color=colors)
    for bar, r, over in zip(bars, rows, over_card):
        bar.set_hatch("" if r["fits"] else "//" if over else "xx")
    ax.axhline(rows[0]["capacity_gb"], color="black", linestyle="--", label=f"{result['gpu']} memory")
    ax.set_yscale("log")
    ax.set_xticks(range(len(rows)), labels, rotation=60, ha="right", fontsize=7)
    return _save(fig, ax, "peak GB a GPU", f"{result['model'] or 'model'} on {result['gpus']} x {result['gpu']}: green "
                 "fits, red over the card, orange over the host's RAM", out / FINETUNE_FILE)


def _stacked(ax, bar: str, parts: list[tuple[str, float]]) -> None:
    """One bar of `parts` stacked bottom-up, each its own legend entry."""
    bottom = 0.0
    for label, value in parts:
        ax.bar([bar], [value], bottom=bottom, label=label)
        bottom += value


def _save(fig, ax, ylabel: str, title: str, path: Path) -> Path:
    import matplotlib.pyplot as plt

    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
