"""Validation-only published runs (plan/data/validation_runs.yaml): Korthikanti et al. 2022's Table 5 and
llm-foundry's long-sequence rows, predicted with the fitted constants and never read by the fit
(calibration.fit_step_model reads calibration.yaml and published_runs.yaml only).

Each error is on the basis the source measured: seconds per iteration (Korthikanti) and tokens/s per GPU
(llm-foundry) are steady training steps, so the step time alone is compared. docs/planning.md reports them
beside calibration.published_errors' rows, and the layout band of Meta's runs (`layout_band`).
"""

from __future__ import annotations

from llmcluster.plan.calibration import Run, _error, _inline_plan, foundry_plan, run_error, runs
from llmcluster.plan.spec import ModelSpec, ParallelSpec, PlanCluster, PlanSpec
from llmcluster.plan.step_model import fitted_residual
from llmcluster.plan.tables import published_runs, validation_runs as _data


def korthikanti_plan(row: list, mode: str) -> PlanSpec:
    """One Table 5 configuration: `full` (full recompute, TP without SP) or `seqsel` (the attention core
    recomputed, sequence parallelism)."""
    d = _data()["korthikanti"]
    name, layers, hidden, heads, tp, pp, interleave, gpus, batch = row[:9]
    par = {**d["parallel"], "tp": tp, "pp": pp, "global_batch": batch,
           "pp_schedule": "interleaved_1F1B" if interleave > 1 else "1F1B", "pp_virtual_stages": interleave}
    par.update({"activation_checkpoint": "full", "sequence_parallel": False} if mode == "full" else
               {"activation_checkpoint": "none", "attention_recompute": True, "sequence_parallel": True})
    return PlanSpec(model=ModelSpec(name=name, n_layers=layers, d_model=hidden, n_heads=heads,
                                    ffn_hidden=4 * hidden, **d["model"]),
                    cluster=PlanCluster(**d["cluster"], nodes=max(1, gpus // 8), gpus_per_node=min(8, gpus)),
                    parallel=ParallelSpec(**par))


def validation_runs() -> list[Run]:
    d = _data()
    k = d["korthikanti"]
    out = []
    for row in k["rows"]:
        for mode, secs in (("full", row[9]), ("seqsel", row[10])):
            label = f"Korthikanti {row[0]}, {row[7]}x A100-80GB, TP {row[4]} PP {row[5]}, " + \
                    ("full recompute" if mode == "full" else "selective recompute + SP")
            out.append(Run(label, "validate", k["source"], "seconds_per_step", float(secs),
                           korthikanti_plan(row, mode)))
    f = d["foundry_long"]
    out += [Run(f"MPT-{r[0]} seq {r[1]}, {r[2]}x {r[3]}", "validate", f["source"], "tokens_per_s_per_gpu",
                float(r[8]), foundry_plan(r)) for r in f["rows"]]
    return out


def validation_errors() -> list[dict]:
    return [run_error(r) for r in validation_runs()]


def layout_band(tps: tuple[int, ...] = (2, 4, 8)) -> list[dict]:
    """Meta's runs (`tp: fit` in published_runs.yaml) at every TP degree that fits and divides the kv heads:
    the error at the assumed layout beside the range the unpublished layout allows."""
    from llmcluster.plan.memory import plan_memory

    assumed = {r.label: r for r in runs()}
    out = []
    for raw in published_runs()["runs"]:
        if raw.get("plan", {}).get("parallel", {}).get("tp") != "fit":
            continue
        run = assumed[raw["label"]]
        errors = {}
        for tp in tps:
            try:
                plan = _inline_plan({**raw["plan"], "parallel": {**raw["plan"]["parallel"], "tp": tp}})
            except ValueError:
                continue
            if plan_memory(plan).fits:
                errors[tp] = _error(Run(run.label, run.role, run.source, run.measure, run.published, plan,
                                        run.basis), fitted_residual(plan.cluster.gpu)[0])
        out.append({"run": run.label, "role": run.role, "assumed_tp": run.plan.parallel.tp,
                    "error": _error(run, fitted_residual(run.plan.cluster.gpu)[0]), "band": errors})
    return out


def _fmt(e: dict) -> tuple[str, str]:
    unit = {"tokens_per_s_per_gpu": ("tok/s/GPU", "{:,.0f}"), "tflops_per_gpu": ("TFLOP/s/GPU", "{:,.0f}"),
            "gpu_hours": ("GPU-h", "{:,.0f}"), "seconds_per_step": ("s/step", "{:,.2f}")}[e["measure"]]
    return f"{unit[1].format(e['published'])} {unit[0]}", unit[1].format(e["predicted"])


def _where(b: dict) -> str:
    total = sum(b.values())
    top = sorted(((v / total, k) for k, v in b.items() if v / total >= 0.005), reverse=True)
    return ", ".join(f"{k} {x:.0%}" for x, k in top)


def markdown() -> str:
    """docs/planning.md's validation tables: every run with its error on its basis, the summary by group,
    Meta's layout band."""
    from llmcluster.plan.calibration import published_errors

    rows = published_errors() + validation_errors()
    out = ["| role | run | basis | published | planner | error | MFU | where the step goes |",
           "|---|---|---|---|---|---|---|---|"]
    for e in rows:
        pub, pred = _fmt(e)
        out.append(f"| {e['role']} | {e['run']} | {e['basis']} | {pub} | {pred} | {e['error']:+.1%} | "
                   f"{e['mfu']:.1%} | {_where(e['breakdown_s'])} |")
    out += ["", "| run (`tp: fit`) | assumed TP | error | TP 2 | TP 4 | TP 8 |", "|---|---|---|---|---|---|"]
    for b in layout_band():
        cells = [f"{b['band'][t]:+.1%}" if t in b["band"] else "does not fit / divide" for t in (2, 4, 8)]
        out.append(f"| {b['run']} | {b['assumed_tp']} | {b['error']:+.1%} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def main() -> None:
    """`python -m llmcluster.plan.validation [--fit]`: the tables docs/planning.md shows; with --fit, the fit
    rerun from its own rows (what it reads listed) beside plan/data/step_model.yaml."""
    import sys

    from llmcluster.plan.calibration import fit_step_model
    from llmcluster.plan.step_model import fitted

    if "--fit" in sys.argv:
        print("fit reads plan/data/calibration.yaml (rows) and plan/data/published_runs.yaml (role: fit):")
        print("\n".join(f"  {r.label}" for r in runs("fit")))
        print("refit:", fit_step_model(), "\nstored:", fitted())
    print(markdown())


if __name__ == "__main__":
    main()
