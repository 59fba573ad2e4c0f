"""`llmcluster serve plan` against hand-computed figures: Llama-3.1-8B and -70B (GQA, their config.json written here)
on the shipped 2 x RTX 4090 box (24 GB, 1,008 GB/s), the presets' KV bytes, and bad input as one line, exit 2.

The reserve per GPU is 1 GiB (hardware.gpu_reserved_gib) + 0.5 GiB CUDA graphs + one 2,048-token prefill chunk's
widest tensors in bf16 + 256 sequences' fp32 logits; the KV cache is whole 16-token blocks."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, assert_one_line_error, cli_inprocess, run_cli

GIB = 1024**3
BUDGET = 0.9 * 24e9                       # gpu_memory_utilization x the RTX 4090's 24 GB


def llama31(path: Path, size: str, **extra) -> Path:
    """The config.json of Meta's Llama-3.1-8B / -70B (no weights: the plan needs none)."""
    dims = {"8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32),
            "70b": dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64)}
    path.mkdir(parents=True, exist_ok=True)
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_key_value_heads": 8,
           "head_dim": 128, "vocab_size": 128256, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
           "rope_theta": 500000.0, "hidden_act": "silu", "tie_word_embeddings": False, "torch_dtype": "bfloat16",
           "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                            "original_max_position_embeddings": 8192},
           **dims[size], **extra}
    (path / "config.json").write_text(json.dumps(cfg))
    return path


def plan(capsys, model, *args, cluster="rtx4090-box"):
    proc = cli_inprocess(capsys, "serve", "plan", "--model", model, "--cluster", cluster, "--json", *args)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def reserve(d, heads, kv, ffn, tp, vocab=128256):
    width = 2 * d + (heads + 2 * kv) * 128 / tp + 2 * ffn / tp
    return GIB + GIB / 2 + 2048 * width * 2 + 256 * vocab * 4


# Llama-3.1-8B: per layer q, o 2·4096² + k, v 2·4096·1024 + MLP 3·4096·14336 = 218,103,808 matmul weights;
# 32 layers; embedding and head 128256·4096 each; norms 32·2·4096 + 4096.
LINEAR_8B, EMB_8B, NORMS_8B = 32 * 218_103_808, 2 * 525_336_576, 266_240
LINEAR_70B, EMB_70B, NORMS_70B = 80 * 855_638_016, 2 * 1_050_673_152, 1_318_912


def test_llama31_8b_on_two_4090s(tmp_path, capsys):
    r = plan(capsys, llama31(tmp_path / "Llama-3.1-8B", "8b"))
    assert r["model"]["params"] == LINEAR_8B + EMB_8B + NORMS_8B == 8_030_261_248
    sv, per, kv = r["serve"], r["memory"]["per_gpu_bytes"], r["kv"]
    assert (sv["tp"], sv["replicas"], sv["dtype"], sv["quantization"], sv["fits"]) == (1, 2, "bfloat16", "none", True)
    weights = 2 * 8_030_261_248                                     # 16.06 GB in bf16, whole on one GPU
    assert per["weights"] == weights
    assert kv["bytes_per_token"] == 2 * 32 * 8 * 128 * 2 == 131_072     # 128 KiB: GQA, 8 KV heads
    left = BUDGET - weights - reserve(4096, 32, 8, 14336, 1)          # 3.62 GB
    assert kv["tokens_fit"] == int(left // (16 * 131_072)) * 16 == 27_616
    assert sv["max_model_len"] == 4096          # the largest power of two with 4 full-length requests in 27,616
    assert sv["max_num_seqs"] == 27_616 // 4096 == 6
    assert r["throughput"]["decode_tokens_per_s_bound"] == pytest.approx(1008e9 / weights)   # 62.8 tokens/s
    assert "--max-model-len 4096" in " ".join(sv["vllm_args"])


def test_llama31_8b_at_tp2_splits_weights_and_kv(tmp_path, capsys):
    r = plan(capsys, llama31(tmp_path / "m", "8b"), "--set", "serve.tp=2")
    weights = (LINEAR_8B + EMB_8B) * 2 / 2 + NORMS_8B * 2           # norms replicated on both ranks
    assert r["memory"]["per_gpu_bytes"]["weights"] == weights == 8_030_527_488
    assert r["kv"]["bytes_per_token_per_gpu"] == 65_536              # 4 of the 8 KV heads per rank
    left = BUDGET - weights - reserve(4096, 32, 8, 14336, 2)
    assert r["kv"]["tokens_fit"] == int(left // (16 * 65_536)) * 16
    assert r["serve"]["max_model_len"] == 32_768 and r["serve"]["replicas"] == 1


def test_llama31_70b_refused_at_0_9_with_the_numbers(tmp_path, capsys):
    model = llama31(tmp_path / "Llama-3.1-70B", "70b")
    proc = cli_inprocess(capsys, "serve", "plan", "--model", model, "--cluster", "rtx4090-box")
    # int4 (AWQ) at tp 2: (68.45e9 x (0.5 + 2.5/128) + 2.10e9 x 2) / 2 + norms = 19.9 GB, + 1.9 GB reserve > 21.6 GB
    assert_one_line_error(proc, "does not fit 2 x RTX4090", "awq at tp 2", "19.9 GB of weights",
                          "0.2 GB over the budget")
    as_json = cli_inprocess(capsys, "serve", "plan", "--model", model, "--cluster", "rtx4090-box", "--json")
    assert as_json.returncode == 2
    r = json.loads(as_json.stdout)
    weights = (LINEAR_70B * (0.5 + 2.5 / 128) + EMB_70B * 2) / 2 + NORMS_70B * 2
    assert r["serve"]["fits"] is False and r["memory"]["per_gpu_bytes"]["weights"] == weights
    assert [c["quantization"] for c in r["candidates"]] == ["none", "none", "fp8", "fp8", "awq", "awq"]


def test_llama31_70b_fits_int4_at_0_95(tmp_path, capsys):
    r = plan(capsys, llama31(tmp_path / "m", "70b"), "--set", "serve.gpu_memory_utilization=0.95")
    weights = (LINEAR_70B * (0.5 + 2.5 / 128) + EMB_70B * 2) / 2 + NORMS_70B * 2
    left = 0.95 * 24e9 - weights - reserve(8192, 64, 8, 28672, 2)    # 0.97 GB
    per_gpu = 2 * 80 * 4 * 128 * 2                                   # 160 KiB per token per GPU
    sv = r["serve"]
    assert (sv["tp"], sv["quantization"], sv["fits"]) == (2, "awq", True)
    assert r["kv"]["tokens_fit"] == int(left // (16 * per_gpu)) * 16 == 5904
    assert (sv["max_model_len"], sv["max_num_seqs"]) == (2048, 2)
    assert any("quantized to 4 bits" in n for n in r["notes"])
    fp8 = plan(capsys, llama31(tmp_path / "m", "70b"), "--set", "serve.gpu_memory_utilization=0.95",
               "--set", "serve.kv_cache_dtype=fp8")
    assert fp8["kv"]["tokens_fit"] == int(left // (16 * per_gpu / 2)) * 16   # fp8 KV: twice the tokens


@pytest.mark.parametrize("preset,kv_bytes,attention", [
    ("llm_tiny", 2 * 4 * 2 * 32 * 2, "GQA"), ("llm_125m", 2 * 12 * 12 * 64 * 2, "MHA"),
    ("llm_1b", 2 * 18 * 16 * 128 * 2, "MHA"), ("llm_7b", 2 * 32 * 32 * 128 * 2, "MHA"),
    ("llm_13b", 2 * 40 * 40 * 128 * 2, "MHA"), ("llm_70b", 2 * 80 * 8 * 128 * 2, "GQA")])
def test_presets_kv_bytes_per_token(capsys, preset, kv_bytes, attention):
    r = plan(capsys, preset)
    assert r["kv"]["bytes_per_token"] == kv_bytes and r["model"]["attention"] == attention
    assert r["serve"]["fits"]


def test_multi_head_presets_cost_four_times_gqa_kv(tmp_path, capsys):
    """llm_7b has Llama-3.1-8B's layers and head dim with 32 KV heads instead of 8: 4 x the KV per token."""
    gqa = plan(capsys, llama31(tmp_path / "m", "8b"))["kv"]["bytes_per_token"]
    assert plan(capsys, "llm_7b")["kv"]["bytes_per_token"] == 4 * gqa


def test_checkpoint_quantization_is_kept(tmp_path, capsys):
    model = llama31(tmp_path / "awq", "8b", quantization_config={"quant_method": "awq", "bits": 4})
    r = plan(capsys, model)
    assert r["serve"]["quantization"] == "awq" and r["model"]["checkpoint_quantization"] == "awq"
    assert not any("quantized to 4 bits" in n for n in r["notes"])   # it already is
    proc = cli_inprocess(capsys, "serve", "plan", "--model", model, "--cluster", "rtx4090-box",
                         "--set", "serve.quantization=none")
    assert_one_line_error(proc, "awq-quantized")


def test_a_run_export_is_found_under_storage(tmp_path, capsys):
    llama31(tmp_path / "storage" / "models" / "chat-8b", "8b")
    r = plan(capsys, "chat-8b", "--root", tmp_path / "storage")
    assert r["model"]["name"] == "chat-8b" and r["serve"]["tp"] == 1


def test_bad_input_is_one_line_exit_2(tmp_path, capsys):
    def err(model, *args, cluster="rtx4090-box"):
        return cli_inprocess(capsys, "serve", "plan", "--model", model, "--cluster", cluster, *args)

    (tmp_path / "empty").mkdir()
    assert_one_line_error(err(tmp_path / "empty"), "no config.json")
    m8 = llama31(tmp_path / "8b", "8b")
    assert_one_line_error(err(m8, "--set", "serve.tp=3", cluster="h200-8x"), "serve.tp 3", "32 attention heads")
    odd = llama31(tmp_path / "odd", "8b", hidden_size=1536, num_attention_heads=12, num_key_value_heads=4)
    assert_one_line_error(err(odd, "--set", "serve.tp=6", cluster="h200-8x"), "serve.tp 6", "4 KV heads")
    assert_one_line_error(err(m8, "--set", "serve.tp=4"), "serve.tp 4", "2 GPUs per node")
    assert_one_line_error(err(m8, "--set", "serve.tp=1", "--set", "serve.quantization=none",
                              "--set", "serve.max_model_len=65536"),
                          "does not fit", "65,536 tokens", "27,616 tokens")
    assert_one_line_error(err(m8, "--set", "serve.max_model_len=200000"), "exceeds", "131072")
    assert_one_line_error(err(m8, "--set", "serve.quantization=fp8", cluster="seed-a100"), "no fp8")
    assert_one_line_error(err(m8, "--set", "serve.max_model_lenn=4096"), "serve.max_model_len")
    assert_one_line_error(err("llm_nope"), "llm_nope", "preset")
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.json").write_text("{not json")
    assert_one_line_error(err(tmp_path / "bad"), "not a JSON config")


def test_cli_subprocess_refusal_and_no_gpu_cluster(tmp_path):
    m = llama31(tmp_path / "m", "70b")
    assert_one_line_error(run_cli("serve", "plan", "--model", m, "--cluster", "rtx4090-box"), "does not fit")
    assert_one_line_error(run_cli("serve", "plan", "--model", "llm_7b", cwd=tmp_path), "hardware.gpu is none")


def test_serve_plan_never_imports_torch(tmp_path):
    model = llama31(tmp_path / "m", "8b")
    code = ("import sys; from llmcluster.cli import main; "
            f"rc = main(['serve', 'plan', '--model', {str(model)!r}, '--cluster', 'rtx4090-box', '--json']); "
            "assert rc == 0; import llmcluster.plan.serving, llmcluster.plan.served_model, llmcluster.plan.serving_report; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


def test_a_layout_with_room_beats_one_that_barely_fits(capsys):
    """llm_70b in bf16 on A100-80GB: tp 2 holds 69 GB of weights per GPU and leaves under 4 x 2,048 tokens of KV;
    tp 4 is chosen."""
    r = plan(capsys, "llm_70b", cluster="seed-a100")
    tp2 = next(c for c in r["candidates"] if (c["tp"], c["quantization"]) == (2, "none"))
    assert tp2["fits"] and tp2["kv_tokens"] < 4 * 2048
    assert (r["serve"]["tp"], r["serve"]["quantization"], r["serve"]["replicas"]) == (4, "none", 8)


def test_plan_cost_gains_serving_per_million_tokens(capsys):
    """The 2 x 4090 box's capex ($2,500 a GPU / (1 - 0.19 network share)) over 5 years at 70% busy, and its energy
    (2.03 x 2 x 450 W x 0.75 average x PUE 1.25 x $0.08/kWh), per million tokens at the serving decode bound."""
    proc = cli_inprocess(capsys, "plan", "rtx4090-1b", "--json", "--set", "cluster.cost.api_usd_per_million_tokens=0.2")
    assert proc.returncode == 0, proc.stderr
    sv = json.loads(proc.stdout)["cost"]["serving"]
    tps = sv["tokens_per_s_bound"]
    assert sv["fits"] and tps > 0
    capex = 2 * 2500 / (1 - 0.19)
    assert sv["capex_usd_per_million_tokens"] == pytest.approx(capex / (5 * 365.25 * 86400) / (tps * 0.7) * 1e6)
    assert sv["power_usd_per_million_tokens"] == pytest.approx(2.03 * 2 * 0.45 * 0.75 * 1.25 * 0.08 / (tps * 3600) * 1e6)
    assert sv["api_usd_per_million_tokens"] == 0.2 and sv["advice"].startswith("serve on-premise")
    text = cli_inprocess(capsys, "plan", "rtx4090-1b")
    assert "Serving (tp 1 x 2 replicas" in text.stdout and "cost.api_usd_per_million_tokens" in text.stdout


def test_serve_section_from_a_config_file(tmp_path, capsys):
    cfg = tmp_path / "serve.yaml"
    cfg.write_text(f"run: {{storage: {tmp_path / 'store'}}}\nserve: {{tp: 2, kv_cache_dtype: fp8, slo: {{ttft_p99_ms: 500}}}}\n")
    llama31(tmp_path / "store" / "models" / "mine", "8b")
    r = plan(capsys, "mine", "--config", cfg)          # the export found under the config's run.storage
    assert (r["serve"]["tp"], r["kv"]["bytes_per_token"]) == (2, 2 * 32 * 8 * 128 * 1)
    assert r["slo"]["ttft_p99_ms"] == 500 and r["slo"]["met_at_bound"] == (r["slo"]["ttft_bound_ms"] <= 500)
