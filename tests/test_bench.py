"""`llmcluster bench` on CPU: a tiny Llama, random tokens, real timing; checks the printout and the record."""

from __future__ import annotations

import json

from conftest import assert_one_line_error, run_cli

SMALL = ["--config", "llm_tiny", "--set", "model.n_layers=2", "--set", "model.d_model=64",
         "--set", "model.n_heads=4", "--set", "model.n_kv_heads=2", "--set", "model.ffn_hidden=128",
         "--set", "model.vocab_size=512", "--set", "data.seq_len=64", "--set", "train.micro_batch=2",
         "--set", "train.threads=1", "--set", "run.name=bench-tiny"]

KEYS = {"model_params", "flops_per_token", "tokens_per_s", "tokens_per_s_per_device", "step_time_s", "mfu",
        "peak_tflops", "peak_source", "device_name", "precision", "world_size", "seq_len", "micro_batch",
        "global_batch", "parallel", "peak_memory_bytes", "time"}


def test_bench_prints_a_sane_mfu_and_writes_the_record(tmp_path):
    root = tmp_path / "s"
    proc = run_cli("bench", "--root", root, *SMALL, "--set", "train.precision=fp32", "--steps", "3",
                   "--warmup", "1", check=True, timeout=300)
    files = list((root / "logs" / "bench").glob("bench-tiny-*.json"))
    assert len(files) == 1, files
    rec = json.loads(files[0].read_text())
    assert KEYS <= set(rec), KEYS - set(rec)
    assert 0 < rec["mfu"] < 1, rec
    assert rec["peak_source"].startswith("measured CPU fp32 matmul peak"), rec["peak_source"]
    assert rec["precision"] == "fp32" and rec["world_size"] == 1 and rec["global_batch"] == 2
    assert rec["seq_len"] == 64 and rec["parallel"]["tp"] == 1
    # Derived figures agree with each other: tokens/s = batch tokens / step time; MFU = FLOPs rate / peak.
    assert abs(rec["tokens_per_s"] - 2 * 64 / rec["step_time_s"]) < 1e-6 * rec["tokens_per_s"]
    mfu = rec["flops_per_token"] * rec["tokens_per_s"] / (rec["peak_tflops"] * 1e12)
    assert abs(rec["mfu"] - mfu) < 1e-9
    assert rec["peak_memory_bytes"] > 50 * 2**20  # ru_maxrss of a process that imported torch
    out = proc.stdout
    assert "tokens/s" in out and "MFU" in out and "measured CPU fp32 matmul peak" in out, out
    assert f"{100 * rec['mfu']:.1f}%" in out


def test_bench_bad_input_is_a_one_line_error(tmp_path):
    proc = run_cli("bench", "--root", tmp_path / "s", *SMALL, "--steps", "0")
    assert_one_line_error(proc, "--steps")
    proc = run_cli("bench", "--root", tmp_path / "s", *SMALL, "--set", "parallel.tp=2")
    assert_one_line_error(proc, "parallel.tp=2", "world size 1")


def test_gpu_check_script_is_valid_bash():
    # The script itself needs a GPU (benchmarks/gpu_check.sh); here only its syntax can be checked.
    import subprocess

    from conftest import REPO

    script = REPO / "benchmarks" / "gpu_check.sh"
    proc = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    text = script.read_text()
    assert "set -euo pipefail" in text and "tests/test_gpu.py" in text and "llm_1b" in text
