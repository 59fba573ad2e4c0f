"""`llmcluster eval --compare RUN[:STEP] ...`: the evaluations eval.jsonl holds, as one table across runs and
checkpoints (per run, step and endpoint, each task's newest scores), and with `--plot DIR` each score against the
tokens the model had trained on (its step where the checkpoint is gone)."""

from __future__ import annotations

import json
from pathlib import Path

from llmcluster.errors import UserError
from llmcluster.storage import eval_log
from llmcluster.storage.eval_log import EVAL_LOG
from llmcluster.storage.layout import Storage, check_run_name


def parse_spec(spec: str) -> tuple[str, int | None]:
    run, sep, step = spec.partition(":")
    if sep and not step.isdigit():
        raise UserError(f"--compare {spec!r}: give RUN or RUN:STEP (STEP a number)")
    return check_run_name(run), int(step) if sep else None


Z95 = 1.96   # a 95% confidence interval of a mean score: ± 1.96 × the stderr the harness reports


def rows(root: Path, specs: list[str]) -> list[dict]:
    """Per (run, step, endpoint) the specs select, the newest record, with each task's newest scores; in the
    order given, by step."""
    out: list[dict] = []
    for spec in specs:
        run, step = parse_spec(spec)
        newest: dict = {}
        for rec in eval_log.read(Storage(root).run_logs(run)):   # in the order written: a later evaluation of a task replaces it
            if step is None or rec.get("step") == step:
                key = (rec.get("step"), rec.get("endpoint"))
                tasks = {**newest.get(key, {}).get("tasks", {}), **rec["tasks"]}
                newest[key] = {**rec, "tasks": tasks}
        if not newest:
            raise UserError(f"--compare {spec}: no evaluation in {Storage(root).run_logs(run) / EVAL_LOG} "
                            f"(run `llmcluster eval --model {run}{f' --step {step}' if step is not None else ''}`)")
        out += sorted(newest.values(), key=lambda r: (r.get("step") is None, r.get("step") or 0))
    return out


def columns(recs: list[dict]) -> list[tuple[str, str]]:
    return sorted({(task, metric) for r in recs for task, t in r["tasks"].items() for metric in t.get("metrics", {})})


def table(recs: list[dict]):
    from rich.table import Table

    cols = columns(recs)
    t = Table(title="evaluations")
    for head in ("run", "step", "tokens", "via"):
        t.add_column(head, justify="right" if head in ("step", "tokens") else "left")
    for task, metric in cols:
        t.add_column(f"{task.removeprefix('llmc_')}\n{metric}", justify="right")
    for r in recs:
        cells = [r["run"], "?" if r.get("step") is None else str(r["step"]),
                 "" if r.get("tokens") is None else f"{r['tokens']:,}", r.get("endpoint") or r.get("backend", "")]
        for task, metric in cols:
            t_ = r["tasks"].get(task, {})
            v, se = t_.get("metrics", {}).get(metric), t_.get("stderr", {}).get(metric)
            cells.append("" if v is None else f"{v:.4f}" + (f" ± {Z95 * se:.4f}" if se is not None else ""))
        t.add_row(*cells)
    t.caption = "± : 95% confidence interval (1.96 × the harness's stderr): differences inside it are noise"
    return t


def plot(recs: list[dict], out_dir: Path) -> Path:
    """One panel per task metric, one line per run (and endpoint): score against tokens trained on."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = columns(recs)
    by_tokens = all(r.get("tokens") is not None for r in recs)
    fig, axes = plt.subplots(len(cols), 1, figsize=(6, 2.6 * len(cols)), squeeze=False)
    for ax, (task, metric) in zip(axes[:, 0], cols):
        series: dict[str, list] = {}
        for r in recs:
            t_ = r["tasks"].get(task, {})
            v, se = t_.get("metrics", {}).get(metric), t_.get("stderr", {}).get(metric)
            x = r.get("tokens") if by_tokens else r.get("step")
            if v is not None and x is not None:
                label = r["run"] + (f" @ {r['endpoint']}" if r.get("endpoint") else "")
                series.setdefault(label, []).append((x, v, Z95 * se if se is not None else 0.0))
        for label, pts in series.items():
            pts.sort()
            ax.errorbar([p[0] for p in pts], [p[1] for p in pts], yerr=[p[2] for p in pts], marker="o",
                        capsize=3, label=label)
        ax.set_title(f"{task}: {metric} (bars: 95% CI)", fontsize=9)
        ax.set_xlabel("tokens trained on" if by_tokens else "step")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    out_dir.mkdir(parents=True, exist_ok=True)
    out_dir.mkdir(exist_ok=True)
    path = out_dir / "eval_compare.png"
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def compare_cli(root: str | None, specs: list[str], as_json: bool = False, plot_dir: str | None = None) -> int:
    from llmcluster.console import console
    from llmcluster.config.cluster_load import storage_root
    from llmcluster.paths import check_output_path

    # before any work (issue 34 item 5): the one output-path check every --plot and --textfile goes through
    out_dir = check_output_path(plot_dir, "--plot", inside=("eval_compare.png",)) if plot_dir else None
    recs = rows(storage_root(root), specs)
    written = plot(recs, out_dir) if out_dir else None
    if as_json:
        print(json.dumps({"rows": recs, "plot": str(written) if written else None}, indent=1, allow_nan=False))
        return 0
    console().print(table(recs))
    if written:
        print(f"wrote {written}")
    return 0
