"""Where the compute efficiency comes from: published runs, or `llmcluster bench` records of this cluster.

A published row (llm-foundry's MPT table) is turned into a plan of the same model, cluster and
parallelism, and `compute.efficiency_for_mfu` finds the efficiency at which our step-time model gives the
published MFU. A new plan takes the efficiency of the nearest row on the same GPU (by model size, then
sequence length, then GPU count). `loo_errors` predicts every row from the others: that is the planner's
known error against published runs (docs/planning.md).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from llmcluster.config.gpus import match_device_name
from llmcluster.errors import UserError
from llmcluster.plan.compute import efficiency_for_mfu, step_time
from llmcluster.plan.spec import PlanCluster, ModelSpec, ParallelSpec, PlanSpec
from llmcluster.plan.tables import calibration

# Where a GPU without rows of its own borrows them: same compute die, or the other memory size.
FAMILY = {"H200": "H100", "H100": "H200", "A100-40GB": "A100-80GB", "A100-80GB": "A100-40GB"}
EPOCH_MEDIAN_MFU = 0.375  # Epoch AI: median MFU over 33 published training runs


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


def foundry_plan(row: list) -> PlanSpec:
    model, seq, gpus, gpu, _mfu, _hfu, micro, accum, _tps, ckpt, n_params = row
    cal = calibration()
    shape = cal["shapes"][model]
    return PlanSpec(
        model=ModelSpec(name=f"mpt-{model}", **shape, ffn_hidden=4 * shape["d_model"], ffn_type="gelu",
                        vocab_size=50368, seq_len=seq, tie_embeddings=True, params=n_params),
        cluster=PlanCluster(gpu=gpu, nodes=max(1, gpus // 8), gpus_per_node=min(8, gpus),
                            fabric=cal["fabric"][gpu]),
        parallel=ParallelSpec(dp_shard=-1, activation_checkpoint="full" if ckpt else "none", micro_batch=micro,
                              global_batch=micro * accum * gpus, memory_convention="fsdp2"))


@lru_cache(maxsize=1)
def foundry_rows() -> tuple[CalRow, ...]:
    rows = []
    for row in calibration()["rows"]:
        model, seq, gpus, gpu, mfu = row[:5]
        plan = foundry_plan(row)
        rows.append(CalRow(f"MPT-{model} seq {seq}, {gpus}x {gpu}", gpu, row[10], seq, gpus, mfu / 100,
                           efficiency_for_mfu(plan, mfu / 100), "llm-foundry", plan.parallel.activation_checkpoint))
    return tuple(rows)


_BENCH_KEYS = ("model_params", "tokens_per_s_per_device", "mfu", "device_name", "world_size", "seq_len")


def bench_rows(paths: list[str]) -> list[CalRow]:
    """`llmcluster bench` records: their MFU, raised to hardware FLOPs when activations were
    recomputed and divided by the busy share of a pipelined step (the step-time model adds the bubble
    itself), is taken as the efficiency (a one-node bench leaves little communication exposed)."""
    rows = []
    for path in paths:
        try:
            rec = json.loads(Path(path).read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise UserError(f"--calibrate {path}: cannot read a bench record: {e}") from None
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


def _distance(row: CalRow, params: float, seq: int, gpus: int, recompute: str) -> float:
    # Recomputation changes the kernel mix (bigger micro-batches, an extra forward): match it first.
    return (abs(math.log(params / row.params)) + 0.5 * abs(math.log(seq / row.seq))
            + 0.25 * abs(math.log(gpus / row.gpus)) + (0.0 if _full(row.recompute) == _full(recompute) else 2.0))


def _full(recompute: str) -> bool:
    """Selective recompute only repeats the attention scores: kernel-wise it is a run without one."""
    return recompute == "full"


def pick_efficiency(plan: PlanSpec, rows: list[CalRow] | tuple[CalRow, ...]) -> tuple[float, str]:
    """(efficiency, where it came from) for this plan."""
    from llmcluster.plan.compute import params

    gpu = plan.cluster.gpu
    for candidate in (gpu, FAMILY.get(gpu)):
        same = [r for r in rows if r.gpu == candidate]
        if same:
            best = min(same, key=lambda r: _distance(r, params(plan.model), plan.model.seq_len, plan.world,
                                                        plan.parallel.activation_checkpoint))
            borrowed = "" if candidate == gpu else f" (borrowed from {candidate})"
            return best.efficiency, f"{best.source}: {best.label}, MFU {best.mfu:.1%}{borrowed}"
    return (efficiency_for_mfu(plan, EPOCH_MEDIAN_MFU),
            f"no calibration for {gpu}: Epoch AI's median MFU {EPOCH_MEDIAN_MFU:.1%}")


def loo_errors() -> list[dict]:
    """Each llm-foundry row predicted from the others (leave-one-out): the planner's known error."""
    rows = foundry_rows()
    out = []
    for i, (raw, row) in enumerate(zip(calibration()["rows"], rows)):
        plan = foundry_plan(raw)
        eff, source = pick_efficiency(plan, rows[:i] + rows[i + 1:])
        predicted = step_time(plan, eff).mfu
        out.append({"run": row.label, "published_mfu": row.mfu, "predicted_mfu": predicted,
                    "error_pp": 100 * (predicted - row.mfu), "from": source})
    return out
