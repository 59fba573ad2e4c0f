"""`benchmarks/gpu_check.sh --cpu-smoke` and `gpu_check_multi.sh --dry-run-cpu`: the GPU checks' own steps on
CPU with tiny shapes (gloo, fake NVML in the nvml/thermal probes since a CPU machine has no NVML), so the
scripts cannot rot between the rare runs on a lent GPU machine; and the GPU budget they print adds up."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from conftest import REPO

GPU_STEPS = ["setup", "pytest", "sdpa", "timing", "nvml", "thermal", "data", "train-fp16", "resume-fp16",
             "train-bf16", "resume-bf16", "bench", "compile"]


def _run(tmp_path, script: str, flag: str) -> str:
    """Run a check script in CPU mode with this interpreter; its output, after asserting it passed."""
    env = {k: v for k, v in os.environ.items() if k not in ("OUT", "LLMCLUSTER_STORAGE", "PYTHON")}
    env.update(GPU_CHECK_WORK=str(tmp_path / "work"), OMP_NUM_THREADS="2", PYTHON=sys.executable)
    p = subprocess.run(["bash", f"benchmarks/{script}", flag], cwd=REPO, env=env, capture_output=True, text=True,
                       timeout=900)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-5000:]
    return out


def _budget(out: str) -> tuple[dict[str, int], int]:
    """The printed budget table: step -> seconds, and the printed total."""
    table = out[out.index("budget per step"):out.index("total")]
    steps = {m[1]: int(m[2]) for m in re.finditer(r"^\s+(\S+)\s+(\d+)$", table, re.M)}
    return steps, int(re.search(r"^\s+total\s+(\d+)", out, re.M)[1])


@pytest.mark.slow
def test_gpu_check_cpu_smoke_runs_every_step_in_order_and_writes_the_summary(tmp_path):
    out = _run(tmp_path, "gpu_check.sh", "--cpu-smoke")
    assert "gpu_check: all steps passed" in out
    budget, total = _budget(out)
    assert list(budget) == GPU_STEPS and sum(budget.values()) == total <= 480, budget
    ran = re.findall(r"^=== (\S+) \(limit", out, re.M)
    assert ran == GPU_STEPS, ran     # GPU tests first, probes next, compile last
    s = json.loads((tmp_path / "work" / "summary.json").read_text())
    assert s["ok"] and list(s["steps"]) == GPU_STEPS and s["budget_s"] == total
    st = s["steps"]
    assert all(x["status"] == "pass" and x["limit_s"] == budget[n] for n, x in st.items())
    assert st["sdpa"]["figures"]["kv_heads_seen"] == st["sdpa"]["figures"]["q_heads"]  # K/V expanded for the mask
    assert st["nvml"]["figures"]["gpus"] == 1 and "FakeNVML" in st["nvml"]["figures"]["nvml"]
    assert st["thermal"]["figures"]["status"] in ("PASS", "WARN")
    for prec in ("fp16", "bf16"):
        assert (st[f"train-{prec}"]["figures"]["first_step"], st[f"train-{prec}"]["figures"]["last_step"]) == (1, 2)
        assert (st[f"resume-{prec}"]["figures"]["first_step"], st[f"resume-{prec}"]["figures"]["last_step"]) == (3, 4)
        assert "step_2" in st[f"resume-{prec}"]["figures"]["resumed"]
    assert st["bench"]["figures"]["mfu"] > 0 and st["bench"]["figures"]["peak_memory_bytes"] > 0
    assert st["compile"]["figures"]["last_step"] == 2
    assert "FSDP dp_replicate=1 dp_shard=1" in (tmp_path / "work" / "train-fp16.log").read_text()


def test_the_gpu_bench_runs_the_presets_own_compile_and_accumulation():
    """Issue 36: the bench step measured an eager step with one micro-batch although llm_7b compiles and
    accumulates 4, so AdamW and the clip ran 4x as often per token as in a real run. Nothing in the GPU bench
    command may override them."""
    from llmcluster.config import load_job_config

    script = (REPO / "benchmarks" / "gpu_check.sh").read_text()
    gpu_model = script[script.index("BENCH_MODEL=(--config llm_7b"):].split(")", 1)[0]
    bench = script[script.index("run bench "):].split("\n\n", 1)[0]
    for key in ("train.compile=", "train.grad_accum="):
        assert key not in gpu_model and key not in bench, key
    preset = load_job_config("llm_7b", [])
    assert preset.train.compile and preset.train.grad_accum == 4


@pytest.mark.slow
def test_gpu_check_multi_dry_run_cpu_matches_one_rank(tmp_path):
    out = _run(tmp_path, "gpu_check_multi.sh", "--dry-run-cpu")
    budget, total = _budget(out)
    assert list(budget) == ["data", "ref", "tp", "pp", "hsdp"] and sum(budget.values()) == total <= 300
    s = json.loads((tmp_path / "work" / "summary.json").read_text())
    assert s["ok"], s["failed"]
    for run in ("tp", "pp", "hsdp"):
        par = s["steps"][run]["figures"]["runs"][run]
        assert par["ok"] and par["steps"] == [1, 2, 3, 4] and par["max_abs_diff"] <= 1e-4, par
    work = tmp_path / "work"   # each run really had its mesh
    assert "× TP 2 (world 2)" in (work / "tp.log").read_text()
    assert "× PP 2 1F1B (world 2)" in (work / "pp.log").read_text()
    assert "HSDP dp_replicate=2" in (work / "hsdp.log").read_text()


def test_parity_fails_when_a_mesh_differs(tmp_path):
    """The parity gate itself can fail: a run whose loss drifts past the tolerance exits 1."""
    for run, losses in (("ref", [5.0, 4.5]), ("good", [5.0, 4.50001]), ("bad", [5.0, 4.6])):
        d = tmp_path / run
        d.mkdir()
        (d / "metrics.jsonl").write_text("".join(json.dumps({"step": i + 1, "loss": x}) + "\n"
                                                 for i, x in enumerate(losses)))
    cmd = [sys.executable, "benchmarks/gpu_check_summary.py", "parity", str(tmp_path), "ref"]
    ok = subprocess.run(cmd + ["good", "--tol", "1e-4"], cwd=REPO, capture_output=True, text=True)
    bad = subprocess.run(cmd + ["good", "bad", "--tol", "1e-4"], cwd=REPO, capture_output=True, text=True)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert bad.returncode == 1 and "parity bad vs ref: MISMATCH" in bad.stdout, bad.stdout


@pytest.mark.parametrize("script", ["gpu_check.sh", "gpu_check_multi.sh"])
def test_gpu_checks_reject_an_unknown_option(script):
    p = subprocess.run(["bash", f"benchmarks/{script}", "--bogus"], cwd=REPO, capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 2 and p.stderr.strip().startswith("usage:")


def test_the_gpu_tests_configs_validate_here():
    """tests/test_gpu.py skips without CUDA, so its configs were first validated on the H200, where they failed
    (data.seq_len over the shape's max_seq_len): build them here, where every run can see them."""
    from test_gpu import cfg

    assert cfg().data.seq_len <= cfg().model.max_seq_len and cfg(dp_shard=1).parallel.dp_shard == 1
