"""`--search`: the layouts `llmcluster train` can run for the plan's model and cluster, best first.

Every candidate is a job-config layout (parallel.dp_replicate / dp_shard / tp / pp / pp_schedule /
activation_checkpoint / fsdp_reshard_after_forward, train.micro_batch / grad_accum; parallel.sequence_parallel
as the plan says: off is never faster nor smaller, only asked for to match a Megatron run) and carries `set`, the
`--set` overrides that make the trainer run it. TP stays inside a node (its all-reduces are on the critical
path) and divides the kv heads (the trainer shards K and V by head); PP needs no divisibility (stages are
split by layer count, config/stages.py) but at most one stage per block; data parallelism is DDP (without
TP or PP), FSDP (resharding after forward or not: ZeRO-3 or ZeRO-2-like) or HSDP (sharded inside a node,
replicated across). The global batch is kept (a training hyper-parameter, not a systems knob). Each
candidate is costed with the trainer's byte convention (`fsdp2`) and the same memory and step-time model as
a single plan; the GEMM residual is looked up once per activation-checkpointing mode and TP degree.
"""

from __future__ import annotations

from itertools import product

from pydantic import ValidationError

from llmcluster.errors import UserError
from llmcluster.plan.analyse import efficiency, job_overrides
from llmcluster.plan.calibration import CalRow
from llmcluster.plan.compute import step_time
from llmcluster.plan.memory import plan_memory
from llmcluster.plan.spec import PlanSpec

MICRO_BATCHES = (1, 2, 4, 8, 16)
CHECKPOINTING = ("none", "selective", "full")


def _divisors(n: int, limit: int) -> list[int]:
    return [d for d in range(1, min(n, limit) + 1) if n % d == 0]


def _data_parallel(dp: int, tp: int, pp: int, gpus_per_node: int) -> list[tuple[int, int, bool]]:
    """(dp_replicate, dp_shard, reshard_after_forward) layouts the trainer runs for `dp` ranks."""
    if dp == 1:
        return [(1, 1, True)]
    out = [(1, dp, True), (1, dp, False)]
    if tp == 1 and pp == 1:
        out.append((dp, 1, True))  # DDP
    inside = gpus_per_node // tp  # HSDP: shard over the data-parallel ranks of one node
    if 1 < inside < dp and dp % inside == 0:
        out += [(dp // inside, inside, True), (dp // inside, inside, False)]
    # With pp > 1 the trainer never reshards after forward (ZeRO-2-like): the True twin would be the same
    # layout, a row that differs from its neighbour in no column the table shows.
    return [o for o in out if not (pp > 1 and o[1] > 1 and o[2])]


def _schedules(pp: int, n_layers: int) -> list[tuple[str, int]]:
    if pp == 1:
        return [("1F1B", 1)]
    return [("1F1B", 1)] + ([("interleaved_1F1B", 2)] if 2 * pp <= n_layers else [])


def search(plan: PlanSpec, bench: list[CalRow] | None = None, top: int = 10) -> list[dict]:
    m, c = plan.model, plan.cluster
    world = c.total_gpus
    global_batch = plan.parallel.global_batch
    base = plan.model_dump()
    tps = [t for t in _divisors(m.n_heads, c.gpus_per_node) if m.kv_heads % t == 0]
    pps = [q for q in range(1, min(64, m.n_layers) + 1) if world % q == 0]
    eff_cache: dict[tuple[str, int], float] = {}
    results = []
    for tp, pp in product(tps, pps):
        if world % (tp * pp):
            continue
        dp = world // (tp * pp)
        for (r, s, reshard), (sched, v), ac, micro in product(
                _data_parallel(dp, tp, pp, c.gpus_per_node), _schedules(pp, m.n_layers), CHECKPOINTING,
                MICRO_BATCHES):
            gb = global_batch or micro * dp * max(1, pp)  # enough micro-batches to fill a pipeline
            if gb % (micro * dp):
                continue
            accum = gb // (micro * dp)
            par = {**base["parallel"], "dp_replicate": r, "dp_shard": s, "tp": tp, "pp": pp, "pp_schedule": sched,
                   "pp_virtual_stages": v if sched == "interleaved_1F1B" else None, "activation_checkpoint": ac,
                   "ac_every": 2, "fsdp_reshard_after_forward": reshard, "micro_batch": micro,
                   "grad_accum": accum, "global_batch": gb, "zero": None, "memory_convention": "fsdp2",
                   "sequence_parallel": base["parallel"]["sequence_parallel"]}
            try:
                cand = PlanSpec.model_validate({**base, "parallel": par})
            except ValidationError:
                continue
            if cand.trainer_gaps():
                continue
            mem = plan_memory(cand)
            if not mem.fits:
                continue
            if (ac, tp) not in eff_cache:  # a bench record's residual depends on the TP shard's shape
                eff_cache[ac, tp] = efficiency(cand, bench)[0]
            st = step_time(cand, eff_cache[ac, tp])
            results.append({"dp_replicate": r, "dp_shard": s, "tp": tp, "pp": pp, "pp_schedule": sched,
                            "pp_virtual_stages": v, "dp": dp, "zero": cand.zero_stage,
                            "activation_checkpoint": ac, "fsdp_reshard_after_forward": reshard,
                            "micro_batch": micro, "grad_accum": accum, "global_batch": gb,
                            "memory_bytes": mem.total, "tokens_per_s_per_gpu": st.tokens_per_s_per_gpu,
                            "mfu": st.mfu, "step_time_s": st.step_s, "set": job_overrides(cand)})
    if not results:
        raise UserError(f"no layout the trainer can run fits {m.name or 'the model'} in {world} x {c.gpu}")
    results.sort(key=lambda r: (-r["tokens_per_s_per_gpu"], r["memory_bytes"]))
    return results[:top]
