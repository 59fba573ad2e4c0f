"""The attention term from published kernel rates (plan/attention.py), the communication terms as the frameworks
run them (plan/compute.py), and the validation-only runs (plan/validation.py) at the errors docs/planning.md
reports (issue 56: goals, not gates; the test pins where the model stands)."""

from __future__ import annotations

import pytest

from llmcluster.plan import attention, validation
from llmcluster.plan.compute import step_time
from llmcluster.plan.spec import ModelSpec, ParallelSpec, PlanCluster, PlanSpec


def plan(gpu="A100-80GB", seq=2048, head_dim=128, nodes=1, **par) -> PlanSpec:
    heads = 32
    m = ModelSpec(n_layers=4, d_model=heads * head_dim, n_heads=heads, ffn_hidden=4 * heads * head_dim,
                  vocab_size=32000, seq_len=seq)
    return PlanSpec(model=m, cluster=PlanCluster(gpu=gpu, nodes=nodes),
                    parallel=ParallelSpec(**{"micro_batch": 1, **par}))


def test_kernel_rates_are_the_published_figures_between_and_beyond_them():
    rate = attention.rate_tflops
    # flash2_a100_fwd_bwd_benchmark.png (d): causal, head dim 128: 155 at 2k, 173 at 4k, 189 at 16k
    assert rate("fa2", "A100-80GB", 312, 128, 2048) == pytest.approx(155)
    assert rate("fa2", "A100-40GB", 312, 128, 4096) == pytest.approx(173)
    assert rate("fa2", "A100-80GB", 312, 128, 65536) == pytest.approx(189)     # held beyond 16k
    assert rate("fa2", "A100-80GB", 312, 128, 2896) == pytest.approx((155 + 173) / 2, rel=1e-3)  # log-midpoint
    assert rate("fa2", "A100-80GB", 312, 96, 2048) == pytest.approx((140 + 155) / 2)   # head dim 64..128
    assert rate("fa2", "H200", 989, 128, 8192) == pytest.approx(308)           # H100's figure
    assert rate("math", "H100", 989, 128, 2048) == pytest.approx(145)
    # FlashAttention-3 on H100: FA2's fwd+bwd x FA3/FA2 forward (flash3_fp16_fwd.png (d): 521 / 298 at 2k)
    assert rate("fa3", "H100", 989, 128, 2048) == pytest.approx(265 * 521 / 298)
    # a GPU without figures: A100's scaled by bf16 peak
    assert rate("fa2", "L40S", 362, 128, 2048) == pytest.approx(155 * 362 / 312)


def test_attention_flops_causal_for_flash_and_whole_for_math():
    flash, math_ = plan(), plan(flash_attention=False)
    assert attention.kernel(flash) == "fa2" and attention.kernel(math_) == "math"
    assert attention.forward_flops_per_token(flash) == 4 * 2048 * 4096 / 2
    assert attention.forward_flops_per_token(math_) == 4 * 2048 * 4096
    # full AC adds one forward; Korthikanti's attention recompute too, not on top of full AC
    base = attention.attention_seconds_per_token_layer(flash)
    assert attention.attention_seconds_per_token_layer(plan(activation_checkpoint="full")) == \
        pytest.approx(base * 4.5 / 3.5)
    assert attention.attention_seconds_per_token_layer(plan(attention_recompute=True)) == pytest.approx(base * 4.5 / 3.5)
    # the term grows with the sequence faster than the GEMMs: its share of the step rises
    short, long = step_time(plan(seq=2048), 0.87), step_time(plan(seq=32768), 0.87)
    assert long.attention_s / long.step_s > 3 * short.attention_s / short.step_s


def test_tp_overlap_hides_tp_behind_the_gemms():
    off = step_time(plan(tp=8, dp_shard=1), 0.87)
    on = step_time(plan(tp=8, dp_shard=1, tp_overlap=True), 0.87)
    assert off.tp_s > 0
    assert on.tp_s == pytest.approx(max(0.0, off.tp_s - off.gemm_s))
    assert on.step_s == pytest.approx(off.step_s - off.tp_s + on.tp_s)


def test_pipeline_sends_are_scattered_over_the_tp_ranks():
    """Each TP rank sends its 1/tp slice; without SP the receiver all-gathers it over NVLink: far less than
    the whole activation over the inter-node link."""
    kw = dict(nodes=2, tp=8, pp=2, dp_shard=1, global_batch=8)
    sp, no_sp = step_time(plan(**kw), 0.87), step_time(plan(sequence_parallel=False, **kw), 0.87)
    act = 2 * 2048 * 4096
    whole = 2 * 8 * act / 24e9   # what sending the whole activation over one HDR NIC share would cost
    assert sp.p2p_s < no_sp.p2p_s < whole / 4


def test_korthikanti_table5_errors_as_documented():
    """docs/planning.md, "Fit and validation": step time against Table 5 (steady iterations). The goal is mean
    |err| <= 3.5% and worst <= 8.9% (calculon's 3.65% / 8.9%); the planner reaches 2.3% / +5.9% with
    Megatron's fused kernels (fused_kernels), the worst the 22B full-recompute row (TP all-reduces without SP).
    Without them (the fitted eager memory_passes) it is 4.1% / +12.1%."""
    errors = {e["run"]: e["error"] for e in validation.validation_errors() if e["run"].startswith("Korthikanti")}
    assert len(errors) == 8
    mean = sum(abs(x) for x in errors.values()) / 8
    worst = max(errors.values(), key=abs)
    assert mean == pytest.approx(0.0245, abs=0.003) and mean <= 0.035
    assert worst == pytest.approx(0.059, abs=0.005) and abs(worst) <= 0.089
    assert errors["Korthikanti gpt-22b, 8x A100-80GB, TP 8 PP 1, full recompute"] == worst


def test_foundry_long_sequences_as_documented():
    """llm-foundry's 16k-64k rows, never fitted: FlashAttention-2's published rate is faster than the rows
    imply at 32k-64k (the planner is optimistic there)."""
    errors = {e["run"]: e["error"] for e in validation.validation_errors() if e["run"].startswith("MPT")}
    assert len(errors) == 32
    assert errors["MPT-7b seq 16384, 8x A100-80GB"] == pytest.approx(-0.086, abs=0.01)
    assert errors["MPT-7b seq 65536, 8x A100-80GB"] == pytest.approx(-0.312, abs=0.01)
    assert errors["MPT-7b seq 65536, 8x H100"] == pytest.approx(-0.319, abs=0.01)
    assert errors["MPT-350m seq 65536, 8x A100-80GB"] == pytest.approx(-0.378, abs=0.01)
    assert max(errors.values()) < 0   # every row: the planner is optimistic


def test_layout_band_spans_tp_2_4_8_where_they_fit():
    band = {b["run"].split(",")[0]: b for b in validation.layout_band()}
    assert set(band) == {"LLaMA-7B", "LLaMA-13B", "LLaMA-33B", "LLaMA-65B", "Llama-2-7B", "Llama-2-13B",
                         "Llama-2-70B"}
    b = band["Llama-2-7B"]
    assert b["assumed_tp"] == 2 and set(b["band"]) == {2, 4, 8}
    assert b["band"][2] == pytest.approx(b["error"])
    assert b["band"][2] < b["band"][4] < b["band"][8]   # narrower TP shards, more TP traffic: slower
    assert set(band["Llama-2-70B"]["band"]) == {8}   # TP 2 and 4 do not fit 70B in 80 GB


def test_fused_kernels_move_the_byte_table_once():
    from llmcluster.plan import step_model

    eager, fused = plan(tp=8, dp_shard=1), plan(tp=8, dp_shard=1, fused_kernels=True)
    a = step_model.step_terms(eager, 1e9, 0.87)
    b = step_model.step_terms(fused, 1e9, 0.87)
    assert b.memory_s == pytest.approx(a.memory_s / step_model.fitted()["memory_passes"])
    assert (b.gemm_s, b.attention_s, b.optimizer_s) == (a.gemm_s, a.attention_s, a.optimizer_s)


def test_dp_overlap_hides_the_zero1_all_gather_under_the_first_forward():
    """ZeRO-1 over 16 nodes: off, the parameter all-gather waits whole; with dp_overlap only what exceeds the
    first forward, plus one bucket of each collective, is exposed."""
    kw = dict(nodes=16, tp=2, dp_shard=1, dp_replicate=-1, zero=1, global_batch=256, micro_batch=2)
    off = step_time(plan(**kw), 0.87)
    on = step_time(plan(dp_overlap=True, **kw), 0.87)
    assert 0 < on.dp_s < off.dp_s
    assert on.step_s - on.dp_s == pytest.approx(off.step_s - off.dp_s)


def test_the_tables_script_prints_every_run_and_the_band(capsys, monkeypatch):
    monkeypatch.setattr("sys.argv", ["validation"])
    validation.main()
    out = capsys.readouterr().out
    assert out.count("| validate | Korthikanti") == 8 and out.count("| fit |") == 21
    assert "| BLOOM-176B, 366B tokens, 384x A100-80GB | goodput |" in out.replace("| validate ", "")
    assert "| run (`tp: fit`) | assumed TP | error | TP 2 | TP 4 | TP 8 |" in out
