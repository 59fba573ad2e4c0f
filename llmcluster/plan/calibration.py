"""Where the step model's constants come from: published runs, or `llmcluster bench` records of this cluster.

`fit_step_model` fits the shape curve's `d_half` and the GEMM residual on the *fit* runs only: llm-foundry's
MPT table (data/calibration.yaml), torchtitan's Llama-3 rows, OPT-175B, TinyLlama and LLaMA-1
(data/published_runs.yaml); `published_errors` then predicts every run, fit and validation (Llama-2
7B/13B/70B, BLOOM-176B, which no fitted constant sees), as docs/planning.md reports. Bench records of
the user's own cluster (`--calibrate`) replace the fitted residual by the nearest record's; so does the summary
of gpu_check's performance mode (`perf_rows`): its full-depth step extrapolated from the per-layer slope, with
the GEMM ceiling it measured at the model's shapes in place of the modelled matmul rate.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from llmcluster.config.gpus import match_device_name
from llmcluster.errors import UserError
from llmcluster.plan.compute import flops_per_token, params, step_time
from llmcluster.plan.spec import PlanCluster, ModelSpec, ParallelSpec, PlanSpec
from llmcluster.plan.step_model import RESIDUAL_FAMILY, achievable_tflops, block_gemm_efficiency, fitted, fitted_residual
from llmcluster.plan.tables import calibration, published_runs

# Where a GPU without rows of its own borrows them: same compute die, or the other memory size.
FAMILY = {"H200": "H100", "H100": "H200", "A100-40GB": "A100-80GB", "A100-80GB": "A100-40GB"}


@dataclass(frozen=True)
class CalRow:
    label: str
    gpu: str
    params: float
    seq: int
    gpus: int
    mfu: float          # fraction
    efficiency: float   # inverted through our step-time model
    source: str
    recompute: str = "none"
    ceiling_tflops: float | None = None   # a measured bf16 GEMM rate at the row's shapes (performance summary)


def foundry_plan(row: list) -> PlanSpec:
    model, seq, gpus, gpu, _mfu, _hfu, micro, accum, _tps, ckpt, n_params = row
    cal = calibration()
    shape = cal["shapes"][model]
    return PlanSpec(
        # NumParams counts MPT's learned position embeddings (max_seq_len x d_model, a lookup like the token
        # embedding: no matmul FLOPs); they grow with the sequence (7B at 64k: 260M), so they are left out
        model=ModelSpec(name=f"mpt-{model}", **shape, ffn_hidden=4 * shape["d_model"], ffn_type="gelu",
                        vocab_size=50368, seq_len=seq, tie_embeddings=True,
                        params=n_params - seq * shape["d_model"]),
        cluster=PlanCluster(gpu=gpu, nodes=max(1, gpus // 8), gpus_per_node=min(8, gpus),
                            fabric=cal["fabric"][gpu]),
        parallel=ParallelSpec(dp_shard=-1, activation_checkpoint="full" if ckpt else "none", micro_batch=micro,
                              global_batch=micro * accum * gpus, memory_convention="fsdp2"))


_BENCH_KEYS = ("model_params", "tokens_per_s_per_device", "mfu", "device_name", "world_size", "seq_len")


def bench_rows(paths: list[str]) -> list[CalRow]:
    """`llmcluster bench` records: their MFU, raised to hardware FLOPs when activations were
    recomputed and divided by the busy share of a pipelined step (the step-time model adds the bubble
    itself), is taken as the efficiency (a one-node bench leaves little communication exposed).
    A performance summary of gpu_check (`"mode": "perf"`) gives its rows through `perf_rows`."""
    rows = []
    for path in paths:
        try:
            rec = json.loads(Path(path).read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise UserError(f"--calibrate {path}: cannot read a bench record: {e}") from None
        if isinstance(rec, dict) and rec.get("mode") == "perf":
            rows += perf_rows(rec, path)
            continue
        missing = [k for k in _BENCH_KEYS if not isinstance(rec, dict) or k not in rec]
        if missing:
            raise UserError(f"--calibrate {path}: not a bench record (missing {', '.join(missing)})")
        spec = match_device_name(str(rec["device_name"]))
        if spec is None:
            raise UserError(f"--calibrate {path}: unknown device '{rec['device_name']}'")
        par = rec.get("parallel") or {}
        ckpt = str(par.get("activation_checkpoint", "none"))
        share = {"none": 0.0, "full": 1.0}.get(ckpt, 1 / float(par.get("ac_every") or 2))
        bubble = float(rec.get("pipeline_bubble") or 0.0)
        eff = float(rec["mfu"]) * (1 + share / 3) / (1.0 - bubble)
        rows.append(CalRow(f"bench {Path(path).name}", spec.name, float(rec["model_params"]),
                           int(rec["seq_len"]), int(rec["world_size"]), float(rec["mfu"]), min(eff, 1.0),
                           f"bench {path}", ckpt))
    return rows


def depth_fit(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least squares y = a + b·x over (x, y) points at two or more distinct x: (a, b)."""
    n = len(points)
    mx, my = sum(x for x, _ in points) / n, sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    b = sum((x - mx) * (y - my) for x, y in points) / sxx
    return my - b * mx, b


def perf_figures(layers: dict) -> dict | None:
    """The layer-scaling figures of a performance summary's `layers` step: step time (and peak memory) against
    depth over the runs without activation checkpointing, fitted as fixed + per-layer; the per-layer MFU (one
    block's FLOPs per token over its slope) and the model at full depth (`model.n_layers`) extrapolated.
    None with fewer than two depths; no MFU where the step time did not grow with depth (a noisy CPU)."""
    pts = [(d["layers"], d["step_s"]) for d in layers.get("depths", []) if d.get("ac") == "none" and d.get("step_s")]
    if len({x for x, _ in pts}) < 2:
        return None
    fixed, per_layer = depth_fit(pts)
    model = dict(layers["model"])
    full = int(model.pop("n_layers"))
    spec = lambda n: ModelSpec(**model, n_layers=n)  # noqa: E731
    layer_flops = flops_per_token(spec(2)) - flops_per_token(spec(1))   # one block's, per token
    tokens, peak = layers["tokens_per_step"], (layers.get("peak_tflops") or 0) * 1e12
    out = {"depths": sorted({x for x, _ in pts}), "fixed_s": fixed, "per_layer_s": per_layer,
           "layer_flops_per_token": layer_flops}
    mem = [(d["layers"], d["peak_memory_gib"]) for d in layers["depths"]
           if d.get("ac") == "none" and d.get("peak_memory_gib") is not None]
    if len({x for x, _ in mem}) >= 2:
        out["memory_fixed_gib"], out["memory_per_layer_gib"] = depth_fit(mem)
        out["memory_full_depth_gib"] = out["memory_fixed_gib"] + full * out["memory_per_layer_gib"]
    if per_layer <= 0 or not peak:
        out["note"] = ("the step time did not grow with depth: no per-layer figures" if per_layer <= 0 else
                       "no peak FLOP/s for this device: no MFU")
        return out
    step = fixed + full * per_layer
    out.update(per_layer_tflops=layer_flops * tokens / per_layer / 1e12,
               per_layer_mfu=layer_flops * tokens / per_layer / peak,
               full_depth={"n_layers": full, "step_s": step, "params": params(spec(full)),
                           "mfu": flops_per_token(spec(full)) * tokens / step / peak})
    return out


def perf_rows(rec: dict, path: str) -> list[CalRow]:
    """The performance summary's full-depth extrapolation as a calibration row: its MFU (no recompute, so
    the efficiency as it stands) and the bf16 GEMM ceiling the `gemm` step measured at the same shapes."""
    steps = rec.get("steps") or {}
    layers = (steps.get("layers") or {}).get("figures") or {}
    if "model" not in layers or "device_name" not in layers:
        raise UserError(f"--calibrate {path}: the performance summary has no layers figures (the step "
                        f"{(steps.get('layers') or {}).get('status', 'did not run')})")
    fig = perf_figures(layers)
    full = (fig or {}).get("full_depth")
    if full is None:
        why = (fig or {}).get("note", "step times at fewer than two depths without activation checkpointing")
        raise UserError(f"--calibrate {path}: no per-layer slope in the performance summary ({why})")
    spec = match_device_name(str(layers["device_name"]))
    if spec is None:
        raise UserError(f"--calibrate {path}: unknown device '{layers['device_name']}'")
    gemm = (steps.get("gemm") or {})
    ceiling = (gemm.get("figures") or {}).get("ceiling_tflops") if gemm.get("status") == "pass" else None
    depths = "/".join(map(str, fig["depths"]))
    return [CalRow(f"performance summary: {full['n_layers']} layers from L={depths}", spec.name, full["params"],
                   int(layers["model"]["seq_len"]), 1, full["mfu"], min(full["mfu"], 1.0), f"perf {path}", "none",
                   ceiling)]


def _distance(row: CalRow, params: float, seq: int, gpus: int, recompute: str) -> float:
    # Recomputation changes the kernel mix (bigger micro-batches, an extra forward): match it first.
    return (abs(math.log(params / row.params)) + 0.5 * abs(math.log(seq / row.seq))
            + 0.25 * abs(math.log(gpus / row.gpus)) + (0.0 if _full(row.recompute) == _full(recompute) else 2.0))


def _full(recompute: str) -> bool:
    """Selective recompute only repeats the attention scores: kernel-wise it is a run without one."""
    return recompute == "full"


def pick_efficiency(plan: PlanSpec, rows: list[CalRow] | tuple[CalRow, ...]) -> tuple[float, str]:
    """(GEMM residual, where it came from) for this plan: the nearest bench record on the same GPU (or its
    family), its efficiency (a share of peak) turned into a residual on this plan's achievable, shape-limited
    matmul rate (conservative: the record's memory-bound time is in its MFU and is counted again), or on the
    GEMM ceiling the record measured on this GPU; else the fitted residual."""
    gpu = plan.cluster.gpu
    for candidate in (gpu, FAMILY.get(gpu)):
        same = [r for r in rows if r.gpu == candidate]
        if same:
            best = min(same, key=lambda r: _distance(r, params(plan.model), plan.model.seq_len, plan.world,
                                                        plan.parallel.activation_checkpoint))
            borrowed = "" if candidate == gpu else f" (borrowed from {candidate})"
            shape = achievable_tflops(plan) * block_gemm_efficiency(plan.model, plan.parallel.tp, fitted()["d_half"])
            measured = ""
            if best.ceiling_tflops and candidate == gpu:   # measured on this GPU: the rate the residual is on
                shape, measured = best.ceiling_tflops, f", GEMM ceiling {best.ceiling_tflops:.0f} TFLOP/s measured"
            residual = min(1.0, best.efficiency * plan.cluster.spec.peak_tflops(plan.parallel.precision) / shape)
            return residual, f"{best.source}: {best.label}, MFU {best.mfu:.1%}{measured}{borrowed}"
    f = fitted()
    residual, family = fitted_residual(gpu)
    return residual, (f"step model fitted on {f['fit_runs']} published runs (docs/planning.md): "
                      f"{family} residual {residual:.2f}, shape d_half {f['d_half']:g}")


# ---------------------------------------------------------------------------------------------------
# Published runs: fit and validation


@dataclass(frozen=True)
class Run:
    label: str
    role: str          # fit | validate
    source: str
    measure: str       # tokens_per_s_per_gpu | tflops_per_gpu | gpu_hours | seconds_per_step
    published: float
    plan: PlanSpec
    basis: str = "steps"   # steps: steady training throughput; goodput: wall clock over the run (badput in)


def runs(role: str | None = None) -> list[Run]:
    """llm-foundry's rows (fit, tokens/s per GPU) and data/published_runs.yaml's, as plans."""
    from llmcluster.paths import locate_shipped
    from llmcluster.plan.load import load_plan

    out = [Run(f"MPT-{r[0]} seq {r[1]}, {r[2]}x {r[3]}", "fit", "llm-foundry benchmarking README",
               "tokens_per_s_per_gpu", float(r[8]), foundry_plan(r)) for r in calibration()["rows"]]
    for r in published_runs()["runs"]:
        measure = next(k for k in ("tokens_per_s_per_gpu", "tflops_per_gpu", "gpu_hours") if k in r)
        if "plan_file" in r:
            plan = load_plan(locate_shipped("plans", r["plan_file"], "plan"), r.get("set"))
        else:
            plan = _inline_plan(r["plan"])
        out.append(Run(r["label"], r["role"], r["source"], measure, float(r[measure]), plan, r.get("basis", "steps")))
    return [r for r in out if role is None or r.role == role]


def _inline_plan(d: dict) -> PlanSpec:
    """A run's plan; `tp: fit` is the layout rule for runs that do not state their TP degree: the smallest
    TP >= 2 dividing the heads at which the plan fits in memory (data/published_runs.yaml)."""
    from llmcluster.plan.memory import plan_memory

    def make(par: dict) -> PlanSpec:
        return PlanSpec(model=ModelSpec(**d["model"]), cluster=PlanCluster(**d["cluster"]),
                        parallel=ParallelSpec(**par), training=d.get("training", {}))

    if d["parallel"].get("tp") != "fit":
        return make(d["parallel"])
    heads = ModelSpec(**d["model"]).kv_heads
    for tp in (t for t in (2, 4, 8) if heads % t == 0):
        plan = make({**d["parallel"], "tp": tp})
        if plan_memory(plan).fits or tp == 8:
            return plan
    raise UserError(f"published run {d['model']['name']}: no TP degree divides its {heads} kv heads")


def predict(run: Run, residual: float) -> float:
    """The run's published measure as the planner predicts it at this residual, on the run's basis: GPU-hours
    of steady steps alone (`basis: steps`: tokens over the step throughput) or of the whole run (`goodput`:
    steps plus the modelled restarts, checkpoints, evaluation and stragglers)."""
    from llmcluster.plan.analyse import run_checkpoint, run_goodput, run_wall_s

    st = step_time(run.plan, residual)
    if run.measure == "tokens_per_s_per_gpu":
        return st.tokens_per_s_per_gpu
    if run.measure == "tflops_per_gpu":
        return st.tflops_per_gpu
    if run.measure == "seconds_per_step":
        return st.step_s
    if run.basis == "steps":
        return run.plan.training.tokens / st.tokens_per_s_per_gpu / 3600
    goodput = run_goodput(run.plan, run_checkpoint(run.plan, st))[0]
    return run_wall_s(run.plan, st, goodput) / 3600 * run.plan.world


def _error(run: Run, residual: float) -> float:
    """Signed relative error of the predicted *time* (GPU-hours, or 1 / throughput) against the published."""
    p = predict(run, residual)
    return p / run.published - 1 if run.measure in ("gpu_hours", "seconds_per_step") else run.published / p - 1


GRID = {"d_half": tuple(range(0, 1025, 32)), "memory_passes": (1.0, 1.5, 2.0, 2.5, 3.0, 4.0),
        "residual": tuple(x / 100 for x in range(50, 101)), "straggler": tuple(x / 1000 for x in range(0, 31))}


def fit_loss(fit: list[Run], d_half: float, memory_passes: float, residual: dict[str, float],
             straggler: float = 0.0) -> float:
    from llmcluster.plan import step_model

    step_model._OVERRIDE = {"d_half": d_half, "memory_passes": memory_passes,
                            "straggler_per_node_doubling": straggler}
    try:
        return sum(math.log1p(_error(r, residual[RESIDUAL_FAMILY[r.plan.cluster.gpu]])) ** 2 for r in fit)
    finally:
        step_model._OVERRIDE = None


def fit_step_model(grid: dict = GRID) -> dict:
    """Least squares on log time over the fit runs only: the shape curve's d_half and the memory-bound
    passes (all GPUs) and a GEMM residual per GPU family (RESIDUAL_FAMILY), without stragglers; then the
    straggler share per node doubling on the end-to-end (GPU-hours) fit runs, the only ones it touches. A
    grid, not an optimiser: every point reproducible (tests/test_plan_step_model.py checks
    data/step_model.yaml)."""
    fit = runs("fit")
    families = sorted({RESIDUAL_FAMILY[r.plan.cluster.gpu] for r in fit})
    best = None
    for d_half in grid["d_half"]:
        for passes in grid["memory_passes"]:
            total, residual = 0.0, {}
            for fam in families:  # the residuals are separable: each family's runs see only their own
                mine = [r for r in fit if RESIDUAL_FAMILY[r.plan.cluster.gpu] == fam]
                loss, residual[fam] = min((fit_loss(mine, d_half, passes, {fam: x}), x) for x in grid["residual"])
                total += loss
            if best is None or total < best[0]:
                best = (total, d_half, passes, residual)
    _, d_half, passes, residual = best
    end_to_end = [r for r in fit if r.basis == "goodput"]   # none today: the fit's GPU-hours are steps only
    straggler = min(grid["straggler"], key=lambda x: fit_loss(end_to_end, d_half, passes, residual, x))
    return {"d_half": d_half, "memory_passes": passes, "residual": residual,
            "straggler_per_node_doubling": straggler, "fit_runs": len(fit)}


def run_error(r: Run) -> dict:
    """One run predicted with the fitted constants: its error on its basis and where the step goes."""
    residual = fitted_residual(r.plan.cluster.gpu)[0]
    st = step_time(r.plan, residual)
    return {"run": r.label, "role": r.role, "source": r.source, "measure": r.measure, "basis": r.basis,
            "published": r.published, "predicted": predict(r, residual), "error": _error(r, residual),
            "mfu": st.mfu, "breakdown_s": st.breakdown()}


def published_errors() -> list[dict]:
    """Every published run predicted with the fitted constants: the planner's known error (docs/planning.md)."""
    return [run_error(r) for r in runs()]
