"""The fine-tuning table as `plan FILE --finetune [--json]` prints it, and the one method a fine-tuning plan names
as plain `plan FILE` sizes it (its memory and step in place of pre-training's)."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from llmcluster.plan.finetune import detail, finetune_table, plan_method
from llmcluster.plan.memory import MemoryReport
from llmcluster.plan.spec import PlanSpec

GIB = 1024**3


def finetune_result(plan: PlanSpec, efficiency: float | None = None) -> dict[str, Any]:
    c, lora = plan.cluster, plan.training.lora
    return {"model": plan.model.name, "cluster": c.name, "gpu": c.gpu, "gpus": c.total_gpus,
            "seq_len": plan.model.seq_len, "micro_batch": plan.parallel.micro_batch,
            "global_batch": plan.global_batch, "activation_checkpoint": plan.parallel.activation_checkpoint,
            "lora_rank": lora.rank if lora else 8, "lora_targets": len(lora.targets) if lora else 7,
            "pcie_gen": c.pcie_gen or c.spec.pcie_gen, "pcie_lanes": c.pcie_lanes or c.spec.pcie_lanes,
            "pcie_h2d_GBps": c.pcie_h2d_GBps, "host_memory_gb": c.host_memory_gb,
            "rows": [asdict(r) for r in finetune_table(plan, efficiency)]}


def render_finetune(result: dict[str, Any]) -> None:
    r = result
    print(f"fine-tuning {r['model']} on {r['gpus']} x {r['gpu']} ({r['cluster']}): seq {r['seq_len']}, micro-batch "
          f"{r['micro_batch']}, global batch {r['global_batch']}, activation checkpointing {r['activation_checkpoint']}, "
          f"LoRA rank {r['lora_rank']} on {r['lora_targets']} projections, FSDP over all GPUs, PCIe Gen"
          f"{r['pcie_gen']} x{r['pcie_lanes']} ({r['pcie_h2d_GBps']:.0f} GB/s host->device)")
    print(f"{'method':<10} {'optimizer':<10} {'offload':<7} {'fits':<4} {'peak GB/GPU':>11} {'states GB':>9} "
          f"{'acts GB':>7} {'host GB/node':>12} {'PCIe GB/step':>12} {'step s':>8} {'tokens/s':>9}")
    gaps = []
    for row in r["rows"]:
        states = row["weights_gb"] + row["gradients_gb"] + row["optimizer_gb"]
        mark = "*" if row["trainer_gap"] else ""
        gaps += [row["trainer_gap"]] if row["trainer_gap"] and row["trainer_gap"] not in gaps else []
        print(f"{row['method']:<10} {row['optimizer']:<10} {'yes' if row['offload'] else 'no':<7} "
              f"{('yes' if row['fits'] else 'no') + mark:<4} {row['peak_gb']:>11.1f} {states:>9.1f} "
              f"{row['activations_gb']:>7.1f} {row['host_ram_gb']:>12.1f} {row['pcie_gb_per_step']:>12.1f} "
              f"{row['step_s']:>8.2f} {row['tokens_per_s']:>9,.0f}")
    for gap in gaps:
        print(f"* {gap}")


def plan_finetune(plan: PlanSpec, efficiency: float) -> tuple[dict[str, Any], MemoryReport, Any]:
    """The method the plan names, sized: (its row with the verdict, its memory per GPU as a MemoryReport, its
    StepTime), for analyse() to report in place of pre-training's layout."""
    f = plan_method(plan)
    row, timing = detail(plan, f, efficiency)
    w, g, o = row.weights_gb * 1e9, row.gradients_gb * 1e9, row.optimizer_gb * 1e9
    gathered, acts = row.gathered_gb * 1e9, row.activations_gb * 1e9
    allocated = w + g + o + gathered + acts
    mem = MemoryReport(weights=w + gathered, gradients=g, optimizer=o, activations=acts,
                       buffers=row.peak_gb * 1e9 - allocated, capacity=plan.cluster.spec.memory_bytes,
                       stage="only", activation_per_layer=acts / plan.model.n_layers)
    verdict = "fits" if row.fits else "DOES NOT FIT"
    host = (f", {row.host_ram_gb:,.1f} GB of host RAM a node of the cluster's {plan.cluster.host_memory_gb:g} GB"
            if row.offload and plan.cluster.host_memory_gb else "")
    reason = (f"{verdict}: {row.method} {row.optimizer}{' with offload' if row.offload else ''}: "
              f"{mem.total / GIB:,.1f} GiB per GPU (weights {mem.weights / GIB:,.1f}, gradients {g / GIB:,.1f}, "
              f"optimizer {o / GIB:,.1f}, activations {acts / GIB:,.1f}, buffers {mem.buffers / GIB:,.1f} GiB) of the "
              f"{plan.cluster.gpu}'s {mem.capacity / GIB:,.1f} GiB{host}"
              + ("" if row.fits else "; `--finetune` compares every method on this cluster"))
    return {**asdict(row), "reason": reason}, mem, timing.step

