"""Render a serving plan as the planner's tables (plan/report.py's style)."""

from __future__ import annotations

from typing import Any

from llmcluster.plan.report import _console, _gib, _table


def render(r: dict[str, Any]) -> None:
    con = _console()
    mo, cl, sv, me, kv, th = r["model"], r["cluster"], r["serve"], r["memory"], r["kv"], r["throughput"]
    per = me["per_gpu_bytes"]
    con.print(f"[bold]{mo['name']}[/] ({mo['source']}): {_count(mo['params'])} params, {mo['attention']} "
              f"({mo['n_heads']} heads, {mo['n_kv_heads']} KV heads x {mo['head_dim']}), context {mo['context']:,} | "
              f"{cl['nodes']} x {cl['gpus_per_node']} {cl['gpu']} ({cl['name']})")
    quant = sv["quantization"] if sv["quantization"] != "none" else "no quantization"
    con.print(_table("Serving layout", [
        ("tensor parallel", f"{sv['tp']} ({sv['replicas']} replica{'s' if sv['replicas'] != 1 else ''} on the cluster)"),
        ("weights", f"{sv['dtype']}, {quant}; KV cache {sv['kv_cache_dtype']}"),
        ("max_model_len", f"{sv['max_model_len']:,} tokens"),
        ("max_num_seqs", f"{sv['max_num_seqs']} ({kv['full_length_seqs']} at full length fit at once)"),
        ("vLLM flags", " ".join(sv["vllm_args"])),
    ]))
    con.print(_table("Memory per GPU", [
        ("budget", f"{_gib(per['budget'])} (gpu_memory_utilization {sv['gpu_memory_utilization']:g})"),
        ("weights", _gib(per["weights"])),
        ("reserve", f"{_gib(per['reserve'])} (context, CUDA graphs, activations)"),
        ("KV cache", f"{_gib(per['kv_cache'])} = {kv['tokens_fit']:,} tokens at "
                     f"{kv['bytes_per_token_per_gpu'] / 1024:,.0f} KiB/token per GPU "
                     f"({kv['bytes_per_token'] / 1024:,.0f} KiB/token for the model)"),
    ]))
    con.print(_table("Bounds (per replica)", [
        ("decode, one sequence", f"{th['decode_tokens_per_s_bound']:,.0f} tokens/s (memory bandwidth)"),
        ("decode, full batch", f"{th['decode_batch_tokens_per_s_bound']:,.0f} tokens/s "
                               f"({th['cluster_decode_tokens_per_s_bound']:,.0f} on the cluster)"),
        ("prefill", f"{th['prefill_tokens_per_s_bound']:,.0f} tokens/s (compute); "
                    f"{th['ttft_bound_ms']:,.0f} ms for a {sv['max_model_len']:,}-token prompt"),
    ]))
    if "decode_efficiency" in th:
        con.print(f"calibrated: decode {th['decode_tokens_per_s_expected']:,.0f} tokens/s for one sequence, "
                  f"{th['decode_batch_tokens_per_s_expected']:,.0f} for a full batch "
                  f"({th['decode_efficiency']:.1%} of the bounds, {th['calibrated_from']})")
    for note in r["notes"]:
        con.print(f"note: {note}")


def _count(n: float) -> str:
    """3.15M, 6.74B: a parameter count readable at any size."""
    return f"{n / 1e9:,.2f}B" if n >= 1e9 else f"{n / 1e6:,.2f}M"
