"""One plan in, one answer out: memory, compute, time, checkpoint, network, power, cost (a JSON-able dict)."""

from __future__ import annotations

from typing import Any

from llmcluster.plan.calibration import CalRow, pick_efficiency
from llmcluster.plan.checkpoint import checkpoint, ft_recovery
from llmcluster.plan.comm import plan_links
from llmcluster.plan.compute import StepTime, efficiency_for_mfu, flops_per_token, params, step_time
from llmcluster.plan.cost import cost
from llmcluster.plan.memory import count_params, plan_memory
from llmcluster.plan.network import fat_tree
from llmcluster.plan.power import power
from llmcluster.plan.spec import PlanSpec


def efficiency(plan: PlanSpec, bench: list[CalRow] | None = None) -> tuple[float, str]:
    if plan.training.mfu is not None:
        return efficiency_for_mfu(plan, plan.training.mfu), f"training.mfu = {plan.training.mfu:.1%} (given)"
    return pick_efficiency(plan, bench or [])  # no bench records: the fitted residual


def job_overrides(plan: PlanSpec) -> list[str]:
    """The `--set` overrides (dotted job-config keys) that make `llmcluster train` run this layout."""
    p = plan.parallel
    r, s = plan.dp_degrees
    out = [f"parallel.dp_replicate={r}", f"parallel.dp_shard={s}", f"parallel.tp={p.tp}", f"parallel.pp={p.pp}"]
    if p.tp > 1 and not p.sequence_parallel:
        out.append("parallel.sequence_parallel=false")
    if p.pp > 1:
        out.append(f"parallel.pp_schedule={p.pp_schedule}")
        if p.pp_schedule == "interleaved_1F1B":
            out.append(f"parallel.pp_virtual_stages={p.virtual_stages}")
    if plan.ft.enabled:
        out += ["ft.enabled=true", f"ft.min_replicas={plan.ft.min_replicas}"]
    out.append(f"parallel.activation_checkpoint={p.activation_checkpoint}")
    if p.activation_checkpoint == "selective":
        out.append(f"parallel.ac_every={p.ac_every}")
    if s > 1:
        out.append(f"parallel.fsdp_reshard_after_forward={str(p.fsdp_reshard_after_forward).lower()}")
    out += [f"train.micro_batch={p.micro_batch}", f"train.grad_accum={plan.micro_batches}"]
    return out


def analyse(plan: PlanSpec, bench: list[CalRow] | None = None) -> dict[str, Any]:
    m, c, p = plan.model, plan.cluster, plan.parallel
    n = params(m)
    mem = plan_memory(plan)
    eff, eff_source = efficiency(plan, bench)
    st = step_time(plan, eff)
    tuned = None
    if plan.finetune:   # the method the plan names (training.lora, optimizer, fsdp_offload): its memory and step
        from llmcluster.plan.finetune_report import plan_finetune

        tuned, mem, st = plan_finetune(plan, eff)
    ck = run_checkpoint(plan, st)
    groups = plan.dp_degrees[0]    # what ft would give, shown whenever the replicas could be groups of whole nodes
    ft = ft_recovery(plan, ck, st.step_s) if plan.ft.enabled or (groups > 1 and c.nodes % groups == 0) else None
    goodput, badput = run_goodput(plan, ck, ft)
    wall_s = run_wall_s(plan, st, goodput)
    gpu_hours = wall_s / 3600 * plan.world
    tree = fat_tree(c)
    links = plan_links(plan)
    pr_pue = _pue(plan)
    pw = power(c, pr_pue)
    co = cost(plan, pw, gpu_hours, wall_s / 86400)
    return {
        "fits": tuned["fits"] if tuned else mem.fits, "reason": tuned["reason"] if tuned else fit_reason(mem, c.gpu),
        "finetune": tuned,
        "model": {"name": m.name, "params": n, "flops_per_token": flops_per_token(m),
                  "n_layers": m.n_layers, "d_model": m.d_model, "seq_len": m.seq_len,
                  "params_from_dims": count_params(m).total},
        "cluster": {"name": c.name, "gpu": c.gpu, "nodes": c.nodes, "gpus_per_node": c.gpus_per_node,
                    "fabric": c.fabric, "nics_per_node": c.nics},
        "parallel": {"dp_replicate": plan.dp_degrees[0], "dp_shard": plan.dp_degrees[1], "tp": p.tp,
                     "pp": p.pp, "pp_schedule": p.pp_schedule, "pp_virtual_stages": p.virtual_stages,
                     "stage_layers": plan.stage_layer_counts, "dp": plan.dp, "zero": plan.zero_stage,
                     "world": plan.world, "micro_batch": p.micro_batch, "global_batch": plan.global_batch,
                     "grad_accum": plan.micro_batches, "activation_checkpoint": p.activation_checkpoint,
                     "ac_every": p.ac_every, "fsdp_reshard_after_forward": p.fsdp_reshard_after_forward,
                     "memory_convention": p.memory_convention, "trainer_gaps": plan.trainer_gaps(),
                     "set": job_overrides(plan)},
        "memory": {"per_gpu_bytes": {"weights": mem.weights, "gradients": mem.gradients,
                                     "optimizer": mem.optimizer, "activations": mem.activations,
                                     "buffers": mem.buffers, "total": mem.total},
                   "gpu_capacity_bytes": mem.capacity, "fits": mem.fits, "peak_stage": mem.stage,
                   "activation_per_layer_bytes": mem.activation_per_layer},
        "compute": {"step_time_s": st.step_s, "tokens_per_s_per_gpu": st.tokens_per_s_per_gpu,
                    "tflops_per_gpu": st.tflops_per_gpu, "mfu": st.mfu, "efficiency": eff,
                    "efficiency_source": eff_source,
                    "gemm_efficiency": st.gemm_efficiency,
                    # per optimizer step; the terms add up to step_time_s
                    # ("compute" = gemm + attention + memory_bound)
                    "breakdown_s": {"compute": st.compute_s, **st.breakdown()},
                    "links_GBps": {"tp": links.tp.busbw_GBps, "dp": links.dp.busbw_GBps,
                                   "pp": links.pp.busbw_GBps}},
        "time": {"tokens": plan.training.tokens, "goodput": goodput, "wall_s": wall_s,
                 "days": wall_s / 86400, "gpu_hours": gpu_hours,
                 "gpu_hours_include": ["steps", *(k for k, v in badput.items() if v > 0)],
                 "productive_gpu_hours": gpu_hours * goodput, "badput": badput,
                 "badput_s": {k: v * wall_s for k, v in badput.items()}},
        "checkpoint": {"size_bytes": ck.size_bytes, "weights_bytes": ck.weights_bytes, "write_s": ck.write_s,
                       "read_s": ck.read_s, "job_mtbf_s": ck.job_mtbf_s,
                       "optimal_interval_s": ck.optimal_interval_s},
        # per-step fault tolerance: the goodput of the restart path and of per-group recovery, side by side
        "ft": None if ft is None else {
            "enabled": plan.ft.enabled, "groups": ft.groups, "min_replicas": plan.ft.min_replicas,
            "heal_s": ft.heal_s, "failure_share": ft.share, "goodput_restart": ck.goodput, "goodput_ft": ft.goodput,
            "badput_ft": ft.badput},
        "network": {"rails": tree.rails, "tiers": tree.tiers, "endpoints": tree.endpoints,
                    "switches": {"leaf": tree.leaf, "spine": tree.spine, "core": tree.core, "total": tree.total},
                    "cables": tree.cables, "transceivers": tree.transceivers,
                    "bisection_bandwidth_gbps": tree.bisection_bandwidth_gbps},
        "power": {"node_kw": pw.node_kw, "it_kw": pw.it_kw, "avg_it_kw": pw.avg_it_kw,
                  "facility_kw": pw.facility_kw, "pue": pr_pue, "btu_per_h": pw.btu_per_h,
                  "nodes_per_rack": pw.nodes_per_rack, "racks": pw.racks, "rack_kw": pw.rack_kw,
                  "liquid_cooling": pw.liquid_cooling},
        "cost": {"prices_date": co.prices.date, "cloud_usd_per_gpu_hour": co.prices.cloud_usd_per_gpu_hour,
                 "cloud_usd": co.cloud_usd, "onprem_capex_usd": co.onprem_capex_usd,
                 "onprem_opex_usd_per_month": co.onprem_opex_usd_per_month, "onprem_run_usd": co.onprem_run_usd,
                 "cloud_usd_per_month": co.cloud_usd_per_month, "break_even_months": co.break_even_months,
                 "utilisation": co.prices.utilisation,
                 "sensitivity_break_even_months": {f"{u:g}": {f"{k:g}x": v for k, v in row.items()}
                                                   for u, row in co.sensitivity.items()},
                 "advice": co.advice, "serving": co.serving},
    }


def fit_reason(mem, gpu: str) -> str:
    """Why the plan's own layout fits or not, in one line (`plan`'s first line when it does not: exit 3)."""
    gib = 1024 ** 3
    verdict = "fits" if mem.fits else "DOES NOT FIT"
    parts = ", ".join(f"{k} {v / gib:,.1f}" for k, v in (("weights", mem.weights), ("gradients", mem.gradients),
                                                          ("optimizer", mem.optimizer), ("activations", mem.activations),
                                                          ("buffers", mem.buffers)))
    return (f"{verdict}: {mem.total / gib:,.1f} GiB per GPU ({mem.stage} stage: {parts} GiB) of the {gpu}'s "
            f"{mem.capacity / gib:,.1f} GiB" + ("" if mem.fits else "; `--search` ranks layouts that fit"))


def run_checkpoint(plan: PlanSpec, st: StepTime):
    """The checkpoint/badput model with this step: evaluation runs forwards of one micro-batch (a third of
    its compute without recomputation), a failure loses the step in flight."""
    forward = st.compute_s / (1 + plan.parallel.recomputed_share / 3) / 3 / plan.micro_batches
    size = None
    if plan.finetune:   # the method's own state: an NF4 run's adapters and their optimizer, not 12 bytes a parameter
        from llmcluster.plan.finetune import checkpoint_bytes

        size = checkpoint_bytes(plan)
    return checkpoint(plan, params(plan.model), st.step_s, forward, size)


def run_goodput(plan: PlanSpec, ck, ft=None) -> tuple[float, dict[str, float]]:
    """(goodput, badput by `jobs goodput`'s keys); a goodput given in the plan leaves its waste unexplained;
    with ft.enabled, per-group recovery's (`ft`, from ft_recovery) instead of the restart path's."""
    if plan.training.goodput:
        return plan.training.goodput, {**dict.fromkeys(ck.badput, 0.0), "other": 1 - plan.training.goodput}
    if plan.ft.enabled and ft is not None:
        return ft.goodput, ft.badput
    return ck.goodput, ck.badput


def run_wall_s(plan: PlanSpec, st: StepTime, goodput: float) -> float:
    return plan.training.tokens / (st.tokens_per_s_per_gpu * plan.world * goodput)


def _pue(plan: PlanSpec) -> float:
    from llmcluster.plan.cost import resolve_prices

    return resolve_prices(plan).pue
