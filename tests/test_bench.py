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
    assert 0 < rec["mfu"] < 1, rec   # against the CPU's instruction-set peak, a bound (config/cpus.py)
    assert rec["peak_source"].startswith("CPU ISA peak: "), rec["peak_source"]
    assert rec["precision"] == "fp32" and rec["world_size"] == 1 and rec["global_batch"] == 2
    assert rec["seq_len"] == 64 and rec["parallel"]["tp"] == 1
    # Derived figures agree with each other: tokens/s = batch tokens / step time; MFU = FLOPs rate / peak.
    assert abs(rec["tokens_per_s"] - 2 * 64 / rec["step_time_s"]) < 1e-6 * rec["tokens_per_s"]
    mfu = rec["flops_per_token"] * rec["tokens_per_s"] / (rec["peak_tflops"] * 1e12)
    assert abs(rec["mfu"] - mfu) < 1e-9
    assert rec["peak_memory_bytes"] > 50 * 2**20  # ru_maxrss of a process that imported torch
    out = proc.stdout
    assert "tokens/s" in out and "MFU" in out and "CPU ISA peak" in out, out
    assert f"{100 * rec['mfu']:.1f}%" in out


def test_bench_bad_input_is_a_one_line_error(tmp_path):
    proc = run_cli("bench", "--root", tmp_path / "s", *SMALL, "--steps", "0")
    assert_one_line_error(proc, "--steps")
    proc = run_cli("bench", "--root", tmp_path / "s", *SMALL, "--set", "parallel.tp=2")
    assert_one_line_error(proc, "parallel.tp=2", "world size 1")


def test_pipelined_bench_records_the_bubble_and_calibration_divides_it_out(tmp_path):
    """2 ranks (torchrun, gloo), PP 2 with 4 micro-batches: 1F1B idles (p-1)/(m+p-1) = 1/5 of the step."""
    from conftest import torchrun
    from llmcluster.plan.calibration import bench_rows

    root = tmp_path / "s"
    proc = torchrun(2, "bench", "--root", root, *SMALL, "--set", "train.precision=fp32", "--set", "parallel.pp=2",
                    "--set", "parallel.dp_shard=1", "--set", "train.grad_accum=4", "--steps", "2",
                    "--warmup", "1", timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    [path] = (root / "logs" / "bench").glob("bench-tiny-*.json")
    rec = json.loads(path.read_text())
    assert rec["parallel"]["pp"] == 2 and rec["parallel"]["pp_schedule"] == "1F1B"
    assert rec["pipeline_bubble"] == 0.2 and rec["global_batch"] == 8
    assert "PP bubble     20.0%" in proc.stdout, proc.stdout
    # The planner knows GPUs only: the record is relabelled as an H100's (no GPU here), its numbers kept.
    gpu = tmp_path / "gpu.json"
    gpu.write_text(json.dumps({**rec, "device_name": "NVIDIA H100 80GB HBM3"}))
    [row] = bench_rows([str(gpu)])
    assert abs(row.efficiency - min(1.0, rec["mfu"] / 0.8)) < 1e-12


def test_tensor_parallel_bench_prints_no_library_warning(tmp_path):
    """Issue 53: TP on CPU printed DTensor's raw UserWarning (a site-packages path) about its random operators,
    which only draw bench's throughput-only weights: filtered where they are drawn (train/bench.py says why)."""
    proc = run_cli("bench", "--procs-per-node", "2", "--root", tmp_path / "s", *SMALL, "--set", "train.precision=fp32",
                   "--set", "parallel.tp=2", "--set", "parallel.dp_shard=1", "--steps", "1", "--warmup", "0",
                   timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Warning" not in proc.stdout + proc.stderr and "site-packages" not in proc.stderr, proc.stderr
    assert (proc.stdout + proc.stderr).count("attention: SDPA ") == 1
