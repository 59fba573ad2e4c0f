"""The JSON summaries of benchmarks/gpu_check.sh and gpu_check_multi.sh, and the multi-GPU loss parity.

    python benchmarks/gpu_check_summary.py summary WORK     # WORK/steps.tsv + figures -> WORK/summary.json
    python benchmarks/gpu_check_summary.py parity LOGS REF RUN [RUN...] --tol T [--figures FILE]

Each step of the shell scripts appends `name status seconds limit` to WORK/steps.tsv; a step's key figures
come from WORK/figures/<name>.json (the probes, parity) or from what the step left in storage (bench records,
the trainer's metrics.jsonl). Reading those files is all this does: no torch import, so it runs in a second.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path


STEP_RE = re.compile(r"^step (\d+)/\d+ loss ([0-9.]+)", re.M)   # the trainer's log line


def _json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def losses(logs: Path, run: str) -> dict[int, float]:
    """step -> loss from the trainer's metrics.jsonl (the training records; eval lines carry no 'loss')."""
    out = {}
    try:
        lines = (logs / run / "metrics.jsonl").read_text().splitlines()
    except OSError:
        return out
    for r in map(json.loads, filter(None, lines)):
        if "loss" in r and "step" in r:
            out[int(r["step"])] = float(r["loss"])
    return out


def _bench(storage: Path, run: str) -> dict | None:
    recs = [r for p in sorted((storage / "logs" / "bench").glob("*.json")) if (r := _json(p)) and r.get("run") == run]
    if not recs:
        return None
    r = recs[-1]
    keys = ("mfu", "peak_tflops", "peak_source", "device_name", "tokens_per_s", "step_time_s", "peak_memory_bytes",
            "model_params", "precision", "seq_len", "torch")
    return {k: r[k] for k in keys if k in r}


def _train(work: Path, step: str) -> dict | None:
    """From the step's own log (train and resume share a run, so its metrics.jsonl holds both): the steps it
    trained, their first and last loss, and where it resumed from."""
    log = work / f"{step}.log"
    text = log.read_text(errors="replace") if log.is_file() else ""
    ls = {int(m[1]): float(m[2]) for m in STEP_RE.finditer(text)}
    if not ls:
        return None
    fig = {"first_step": min(ls), "last_step": max(ls), "loss_first": ls[min(ls)], "loss_last": ls[max(ls)]}
    resumed = [ln.strip() for ln in text.splitlines() if ln.startswith("resumed from")]
    if resumed:
        fig["resumed"] = resumed[-1][:200]
    return fig


def summary(work: Path) -> dict:
    storage = work / "storage"
    steps = {}
    for line in (work / "steps.tsv").read_text().splitlines() if (work / "steps.tsv").is_file() else []:
        name, status, seconds, limit = line.split("\t")[:4]
        s = {"status": status, "seconds": int(seconds), "limit_s": int(limit)}
        fig = _json(work / "figures" / f"{name}.json")
        if fig is None and name.startswith("bench"):
            fig = _bench(storage, f"gpu-check-{name}")
        if fig is None:   # any step that trained: its steps and losses
            fig = _train(work, name)
        if fig is not None:
            s["figures"] = fig
        steps[name] = s
    failed = [n for n, s in steps.items() if s["status"] != "pass"]
    return {"ok": not failed, "failed": failed, "seconds": sum(s["seconds"] for s in steps.values()),
            "budget_s": sum(s["limit_s"] for s in steps.values()), "steps": steps}


def parity(logs: Path, ref: str, runs: list[str], tol: float) -> dict:
    """Each run's losses against the one-rank reference's, step by step (same seed, data and global batch)."""
    r0 = losses(logs, ref)
    out = {"reference": ref, "tol": tol, "runs": {}}
    for run in runs:
        got = losses(logs, run)
        common = sorted(set(got) & set(r0))
        diff = max((abs(got[s] - r0[s]) for s in common), default=None)
        out["runs"][run] = {"steps": common, "max_abs_diff": diff,
                            "ok": bool(common) and len(common) == len(r0) and diff is not None and diff <= tol}
    out["ok"] = bool(r0) and all(r["ok"] for r in out["runs"].values())
    return out


def main(argv: list[str]) -> int:
    if len(argv) == 2 and argv[0] == "summary":
        work = Path(argv[1])
        s = summary(work)
        (work / "summary.json").write_text(json.dumps(s, indent=1))
        print(f"summary: {work / 'summary.json'} ({len(s['steps'])} steps, {s['seconds']}s of a "
              f"{s['budget_s']}s budget{'; failed: ' + ', '.join(s['failed']) if s['failed'] else ''})")
        return 0
    if len(argv) >= 6 and argv[0] == "parity" and "--tol" in argv:
        i = argv.index("--tol")
        tol, rest = float(argv[i + 1]), argv[1:i] + argv[i + 2:]
        fig = None
        if "--figures" in rest:
            j = rest.index("--figures")
            fig, rest = Path(rest[j + 1]), rest[:j] + rest[j + 2:]
        r = parity(Path(rest[0]), rest[1], rest[2:], tol)
        if fig:
            fig.write_text(json.dumps(r, indent=1))
        for run, x in r["runs"].items():
            print(f"parity {run} vs {r['reference']}: {'ok' if x['ok'] else 'MISMATCH'} "
                  f"(steps {x['steps']}, max |Δloss| {x['max_abs_diff']}, tol {tol:g})")
        return 0 if r["ok"] else 1
    print(__doc__.split("\n\n")[1], file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
