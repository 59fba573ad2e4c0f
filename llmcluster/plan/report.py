"""Render an analysis as rich tables (and `--search` results, and the sensitivity grid)."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table

from llmcluster.console import console as piped_or_terminal

GB = 1e9
# compute.breakdown_s's terms, in the order a step spends them ("compute" is gemm + attention + memory_bound)
BREAKDOWN = (("gemm", "GEMM"), ("attention", "attention core"), ("memory_bound", "memory-bound ops"), ("optimizer", "optimizer + clipping"),
             ("tp_comm", "TP comm"), ("dp_comm", "DP comm (exposed)"), ("pp_bubble", "PP bubble"),
             ("pp_p2p", "PP sends"))


def _gib(b: float) -> str:
    return f"{b / 1024**3:,.1f} GiB"


def _tokens(n: float) -> str:
    """1.0e12 -> 1,000B; a fine-tuning run's 3.3e7 -> 33M (not 0B)."""
    return f"{n / 1e9:,.0f}B" if n >= 1e9 else f"{n / 1e6:,.0f}M"


def _dur(s: float) -> str:
    if s < 120:
        return f"{s:,.1f} s"
    if s < 7200:
        return f"{s / 60:,.1f} min"
    if s < 3 * 86400:
        return f"{s / 3600:,.1f} h"
    return f"{s / 86400:,.1f} days"


def _table(title: str, rows: list[tuple[str, str]]) -> Table:
    t = Table(show_header=False, box=None, pad_edge=False, title=f"[bold underline]{title}[/]",
              title_justify="left", min_width=len(title))
    t.add_column(style="bold", no_wrap=True)
    t.add_column()
    for k, v in rows:
        t.add_row(k, v)
    return t


def _console() -> Console:
    """Wide enough for the tables when stdout is a pipe or a file (rich assumes 80 columns there)."""
    return piped_or_terminal()


def render(r: dict[str, Any], console: Console | None = None) -> None:
    con = console or _console()
    mo, pa, me, co, ti = r["model"], r["parallel"], r["memory"], r["compute"], r["time"]
    ck, ne, pw, cs = r["checkpoint"], r["network"], r["power"], r["cost"]
    per = me["per_gpu_bytes"]
    con.print(f"[bold]{mo['name'] or 'model'}[/]: {mo['params'] / 1e9:,.2f}B params, "
              f"{mo['flops_per_token'] / 1e9:,.1f} GFLOP/token, seq {mo['seq_len']} | "
              f"{pa['world']} GPUs{_on(r.get('cluster'))}: tp {pa['tp']} x pp {pa['pp']} x dp {pa['dp']} "
              f"(dp_replicate {pa['dp_replicate']} x dp_shard {pa['dp_shard']}), ZeRO-{pa['zero']}, "
              f"micro-batch {pa['micro_batch']} x {pa['grad_accum']} accum = {pa['global_batch']} seqs, "
              f"AC {pa['activation_checkpoint']}"
              + (f", {pa['pp_schedule']} stages of {'/'.join(map(str, sorted(set(pa['stage_layers']))))} "
                 "blocks per rank" if pa["pp"] > 1 else ""))
    if pa["trainer_gaps"]:
        con.print(f"llmcluster train cannot run this layout: {'; '.join(pa['trainer_gaps'])}")
    else:
        con.print("train it: " + " ".join(f"--set {o}" for o in pa["set"]))
    fit = "[green]fits[/]" if me["fits"] else "[red]DOES NOT FIT[/]"
    con.print(_table(f"Memory per GPU ({pa['memory_convention']} convention, {me['peak_stage']} stage)", [
        ("weights", _gib(per["weights"])), ("gradients", _gib(per["gradients"])),
        ("optimizer", _gib(per["optimizer"])), ("activations", _gib(per["activations"])),
        ("buffers", _gib(per["buffers"])),
        ("total", f"{_gib(per['total'])} of {_gib(me['gpu_capacity_bytes'])}: {fit}")]))
    b = co["breakdown_s"]
    con.print(_table("Compute", [
        ("step time", f"{co['step_time_s']:,.2f} s per optimizer step"),
        *((f"  {label}", f"{b[key]:,.3f} s ({b[key] / co['step_time_s']:.1%})") for key, label in BREAKDOWN),
        ("GEMM shape efficiency", f"{co['gemm_efficiency']:.1%} of the GPU's achievable matmul rate"),
        ("tokens/s per GPU", f"{co['tokens_per_s_per_gpu']:,.0f}"),
        ("model TFLOP/s per GPU", f"{co['tflops_per_gpu']:,.1f}"),
        ("MFU", f"{co['mfu']:.1%}"),
        ("efficiency from", co["efficiency_source"]),
        ("training", f"{_tokens(ti['tokens'])} tokens: {ti['days']:,.1f} days, "
                     f"{ti['gpu_hours']:,.0f} GPU-hours (goodput {ti['goodput']:.1%}: steps + badput below)")]))
    con.print(_table("Badput (jobs goodput's buckets)", [
        (k, f"{v:.2%} ({_dur(ti['badput_s'][k])})") for k, v in ti["badput"].items()]))
    con.print(_table("Checkpoint", [
        ("full training state", f"{ck['size_bytes'] / GB:,.1f} GB, written in {_dur(ck['write_s'])}"),
        ("weights only (bf16)", f"{ck['weights_bytes'] / GB:,.1f} GB"),
        ("job MTBF", _dur(ck["job_mtbf_s"])),
        ("optimal interval (Young/Daly)", _dur(ck["optimal_interval_s"]))]))
    if (ft := r.get("ft")) is not None:
        con.print(_table(f"Fault tolerance ({ft['groups']} replica groups, torchft"
                         f"{'' if ft['enabled'] else ': ft.enabled to use it'})", [
            ("goodput, restart path (Young/Daly)", f"{ft['goodput_restart']:.2%}"),
            ("goodput, per-group recovery (ft)", f"{ft['goodput_ft']:.2%}"),
            ("a failure stops", f"{ft['failure_share']:.0%} of the cluster for its restart + heal"
                                + ("" if ft["failure_share"] < 1 else " (fewer survivors than ft.min_replicas)")),
            ("heal from a live peer", _dur(ft["heal_s"]))]))
    sw = ne["switches"]
    con.print(_table("Network (rail-optimised fat-tree)", [
        ("rails x endpoints", f"{ne['rails']} x {ne['endpoints'] // ne['rails']} ({ne['tiers']} tier)"),
        ("switches", f"{sw['total']} (leaf {sw['leaf']}, spine {sw['spine']}, core {sw['core']})"),
        ("cables / transceivers", f"{ne['cables']:,} / {ne['transceivers']:,}"),
        ("bisection bandwidth", f"{ne['bisection_bandwidth_gbps'] / 1000:,.1f} Tb/s")]))
    con.print(_table("Power and cooling", [
        ("IT power (max)", f"{pw['it_kw']:,.1f} kW ({pw['node_kw']:.2f} kW/node; {pw['avg_it_kw']:,.1f} kW training)"),
        ("facility power", f"{pw['facility_kw']:,.1f} kW (PUE {pw['pue']})"),
        ("heat", f"{pw['btu_per_h']:,.0f} BTU/h"),
        ("racks", f"{pw['racks']} x {pw['nodes_per_rack']} nodes, {pw['rack_kw']:.1f} kW/rack: "
                  + ("[yellow]liquid cooling[/]" if pw["liquid_cooling"] else "air-cooled"))]))
    be = cs["break_even_months"]
    con.print(_table(f"Cost (prices of {cs['prices_date']})", [
        ("this run on the cloud", f"${cs['cloud_usd']:,.0f} at ${cs['cloud_usd_per_gpu_hour']:.2f}/GPU-h"),
        ("this run on-premise", f"${cs['onprem_run_usd']:,.0f} (capex share + opex)"),
        ("on-premise capex", f"${cs['onprem_capex_usd']:,.0f}"),
        ("on-premise opex", f"${cs['onprem_opex_usd_per_month']:,.0f}/month"),
        ("break-even", f"{be:,.1f} months" if be is not None else "never (cloud is cheaper per month)")]))
    sens = Table(title="Break-even months by utilisation (rows) and cloud price (columns)", title_justify="left")
    sens.add_column("utilisation")
    cols = next(iter(cs["sensitivity_break_even_months"].values())).keys()
    for k in cols:
        sens.add_column(k, justify="right")
    for u, row in cs["sensitivity_break_even_months"].items():
        sens.add_row(f"{float(u):.0%}", *(f"{v:,.0f}" if v is not None else "never" for v in row.values()))
    con.print(sens)
    con.print(f"[bold]Advice:[/] {cs['advice']}")
    sv = cs["serving"]
    if sv["fits"]:
        con.print(f"[bold]Serving[/] ({sv['layout']}, {sv['tokens_per_s_bound']:,.0f} tokens/s at the decode bound): "
                  f"capex ${sv['capex_usd_per_million_tokens']:,.3f} + power ${sv['power_usd_per_million_tokens']:,.3f}"
                  f" per million tokens; {sv['advice']}")
    else:
        con.print(f"[bold]Serving:[/] {sv['advice']}")


def render_search(results: list[dict], console: Console | None = None) -> None:
    t = Table(title="Best configurations that fit, by predicted tokens/s per GPU", title_justify="left")
    for col in ("#", "tp", "pp", "dp_rep", "dp_shard", "ZeRO", "AC", "micro", "accum", "mem/GPU", "tok/s/GPU",
                "MFU", "step"):
        t.add_column(col, justify="right")
    for i, r in enumerate(results, 1):
        pp = f"{r['pp']}" + (f" i{r['pp_virtual_stages']}" if r["pp_schedule"] == "interleaved_1F1B" else "")
        t.add_row(str(i), str(r["tp"]), pp, str(r["dp_replicate"]), str(r["dp_shard"]), str(r["zero"]),
                  r["activation_checkpoint"], str(r["micro_batch"]), str(r["grad_accum"]),
                  _gib(r["memory_bytes"]), f"{r['tokens_per_s_per_gpu']:,.0f}", f"{r['mfu']:.1%}",
                  f"{r['step_time_s']:.2f} s")
    con = console or _console()
    con.print(t)
    for i, r in enumerate(results, 1):  # copyable: `llmcluster train --config ... <this line>`
        con.print(f"{i}: " + " ".join(f"--set {o}" for o in r["set"]), soft_wrap=True, highlight=False)


def _on(c: dict | None) -> str:
    """' on seed (8 x 4 A100-80GB)': which cluster the plan was made on."""
    if not c:
        return ""
    return f" on {c['name'] or 'the cluster'} ({c['nodes']} x {c['gpus_per_node']} {c['gpu']})"
