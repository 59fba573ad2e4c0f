"""`plan --calibrate` on gpu_check's performance summary (issue 36): the per-depth step times fitted into a
per-layer slope, extrapolated to full depth, and the measured GEMM ceiling in place of the modelled matmul rate.
The summary is hand-written with round numbers, so every expected figure below can be checked by hand."""

from __future__ import annotations

import json

import pytest
import yaml

from conftest import assert_one_line_error, run_cli

# Llama-3-8B's widths, at the depths the performance mode runs (full depth 32).
MODEL = {"d_model": 4096, "n_heads": 32, "n_kv_heads": 8, "ffn_hidden": 14336, "vocab_size": 128256,
         "rope_theta": 500000, "seq_len": 4096, "n_layers": 32}


def summary(step_s: dict[int, float], ceiling: float | None = 700.0, memory: bool = True) -> dict:
    depths = [{"layers": 2, "ac": "selective", "step_s": 0.5}]   # AC runs are not in the slope
    depths += [{"layers": n, "ac": "none", "step_s": t, "peak_memory_gib": (10 + 2 * n) if memory else None}
               for n, t in step_s.items()]
    steps = {"layers": {"status": "pass", "figures": {
        "model": MODEL, "device_name": "NVIDIA H200", "peak_tflops": 989.0, "tokens_per_step": 8192,
        "depths": depths}}}
    if ceiling:
        steps["gemm"] = {"status": "pass", "figures": {"ceiling_tflops": ceiling}}
    return {"mode": "perf", "device": "gpu", "steps": steps}


def plan_file(tmp_path):
    plan = {"model": {k: v for k, v in MODEL.items() if k != "rope_theta"}, "cluster": "h200-8x",
            "parallel": {"dp_shard": -1, "activation_checkpoint": "none", "micro_batch": 2, "global_batch": 64},
            "training": {"tokens": 1e9}}
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump(plan))
    return path


def plan_compute(tmp_path, *extra) -> dict:
    p = run_cli("plan", plan_file(tmp_path), "--json", *extra, check=True)
    return json.loads(p.stdout)["compute"]


# One block's parameters: q, o (d·d each), k, v (d·kv each, kv = 8 heads x 128), gate, up, down (d·f), 2 norms.
BLOCK = 2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336 + 2 * 4096      # 218,112,000
LAYER_FLOPS = 6 * BLOCK + 12 * 4096 * 4096                                    # 6N + 12·H·Q·T per token


def test_the_layer_slope_and_the_full_depth_extrapolation_by_hand():
    from llmcluster.plan.calibration import perf_figures

    # step = 0.05 s + 0.02 s per layer, memory = 10 GiB + 2 GiB per layer
    fig = perf_figures(summary({2: 0.09, 4: 0.13, 8: 0.21})["steps"]["layers"]["figures"])
    assert fig["fixed_s"] == pytest.approx(0.05) and fig["per_layer_s"] == pytest.approx(0.02)
    assert fig["layer_flops_per_token"] == LAYER_FLOPS == 1_509_998_592
    assert fig["per_layer_mfu"] == pytest.approx(LAYER_FLOPS * 8192 / 0.02 / 989e12)       # 62.5%
    # 32 blocks + the final norm + the untied head (4096 x 128256); the input embedding is not a matmul
    n = 32 * BLOCK + 4096 + 4096 * 128256
    full = fig["full_depth"]
    assert full["step_s"] == pytest.approx(0.05 + 32 * 0.02)
    assert full["mfu"] == pytest.approx((6 * n + 12 * 32 * 4096 * 4096) * 8192 / 0.69 / 989e12)   # 61.8%
    assert full["params"] == n + 4096 * 128256 == 8_030_261_248                   # Llama-3-8B
    assert fig["memory_per_layer_gib"] == pytest.approx(2) and fig["memory_full_depth_gib"] == pytest.approx(74)


def test_plan_calibrate_reads_the_performance_summary(tmp_path):
    path = tmp_path / "summary.json"
    path.write_text(json.dumps(summary({2: 0.09, 4: 0.13, 8: 0.21})))
    before = plan_compute(tmp_path)
    after = plan_compute(tmp_path, "--calibrate", str(path))
    mfu = (6 * (32 * BLOCK + 4096 + 4096 * 128256) + 12 * 32 * 4096 * 4096) * 8192 / 0.69 / 989e12
    # the full-depth MFU as a share of peak, on the measured 700 TFLOP/s instead of the modelled rate
    assert after["efficiency"] == pytest.approx(mfu * 989 / 700)                  # 0.873
    assert "perf " in after["efficiency_source"] and "GEMM ceiling 700 TFLOP/s measured" in after["efficiency_source"]
    assert after["efficiency"] != before["efficiency"]
    # without a ceiling: the modelled rate, as for a bench record (the residual differs)
    path.write_text(json.dumps(summary({2: 0.09, 4: 0.13, 8: 0.21}, ceiling=None)))
    modelled = plan_compute(tmp_path, "--calibrate", str(path))
    assert "GEMM ceiling" not in modelled["efficiency_source"]
    assert modelled["efficiency"] != pytest.approx(after["efficiency"])


@pytest.mark.parametrize("steps, needle", [
    ({8: 0.21}, "fewer than two depths"),                   # cut short after one depth: no slope
    ({2: 0.2, 8: 0.1}, "did not grow with depth"),          # noise: no per-layer figures
])
def test_a_summary_without_a_slope_is_refused_in_one_line(tmp_path, steps, needle):
    path = tmp_path / "summary.json"
    path.write_text(json.dumps(summary(steps)))
    assert_one_line_error(run_cli("plan", plan_file(tmp_path), "--calibrate", path), "--calibrate", needle)
