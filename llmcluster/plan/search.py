"""`--search`: every tp/pp/zero/recompute/micro-batch for the plan's model and cluster, best first.

TP stays inside a node (its all-reduces are on the critical path) and divides the heads; PP divides the
layers; dp is the rest of the cluster. The global batch is kept (it is a training hyper-parameter, not a
systems knob), so a candidate must also divide it. Each candidate is costed with the same memory and
step-time model as a single plan; the efficiency is looked up once (it depends on model, GPU, recompute).
"""

from __future__ import annotations

from itertools import product

from pydantic import ValidationError

from llmcluster.errors import UserError
from llmcluster.plan.analyse import efficiency
from llmcluster.plan.calibration import CalRow
from llmcluster.plan.compute import step_time
from llmcluster.plan.memory import plan_memory
from llmcluster.plan.spec import PlanSpec

MICRO_BATCHES = (1, 2, 4, 8, 16)
RECOMPUTE = ("none", "selective", "full")


def _divisors(n: int, limit: int) -> list[int]:
    return [d for d in range(1, min(n, limit) + 1) if n % d == 0]


def search(plan: PlanSpec, bench: list[CalRow] | None = None, top: int = 10) -> list[dict]:
    m, c = plan.model, plan.cluster
    world = c.total_gpus
    global_batch = plan.parallel.global_batch
    base = plan.model_dump()
    tps = [t for t in _divisors(m.n_heads, c.gpus_per_node) if m.kv_heads % t == 0 or t % m.kv_heads == 0]
    pps = [q for q in _divisors(m.n_layers, world) if q <= 64]
    eff_cache: dict[str, float] = {}
    results = []
    for tp, pp, zero, recompute, micro in product(tps, pps, (0, 1, 2, 3), RECOMPUTE, MICRO_BATCHES):
        if world % (tp * pp):
            continue
        dp = world // (tp * pp)
        if zero and dp == 1:
            continue  # sharding over one rank is stage 0
        gb = global_batch or micro * dp * max(1, pp)  # enough micro-batches to fill a pipeline
        if gb % (micro * dp):
            continue
        par = {**base["parallel"], "tp": tp, "pp": pp, "dp": None, "zero": zero, "recompute": recompute,
               "micro_batch": micro, "global_batch": gb, "sequence_parallel": tp > 1,
               "pp_schedule": "1f1b", "virtual_stages": 1}
        try:
            cand = PlanSpec.model_validate({**base, "parallel": par})
        except ValidationError:
            continue
        mem = plan_memory(cand)
        if not mem.fits:
            continue
        if recompute not in eff_cache:
            eff_cache[recompute] = efficiency(cand, bench)[0]
        st = step_time(cand, eff_cache[recompute])
        results.append({"tp": tp, "pp": pp, "dp": dp, "zero": zero, "recompute": recompute,
                        "micro_batch": micro, "global_batch": gb, "memory_bytes": mem.total,
                        "tokens_per_s_per_gpu": st.tokens_per_s_per_gpu, "mfu": st.mfu,
                        "step_time_s": st.step_s})
    if not results:
        raise UserError(f"no tp/pp/zero/recompute/micro-batch combination fits {m.name or 'the model'} "
                        f"in {world} x {c.gpu}")
    results.sort(key=lambda r: (-r["tokens_per_s_per_gpu"], r["memory_bytes"]))
    return results[:top]
