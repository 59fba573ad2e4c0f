"""`benchmarks/gpu_check.sh --cpu-smoke` (and `--perf --cpu-smoke`, the performance mode) and `gpu_check_multi.sh
--dry-run-cpu`: the GPU checks' own steps on
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
    env.update(GPU_CHECK_WORK=str(tmp_path / "work"), PYTHON=sys.executable)   # threads: the suite's (conftest)
    p = subprocess.run(["bash", f"benchmarks/{script}", *flag.split()], cwd=REPO, env=env, capture_output=True, text=True,
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


PERF_STEPS = ["setup", "layers", "gemm", "phases", "sdpa", "compile", "loss", "accum", "float8"]


@pytest.mark.slow
def test_gpu_check_perf_cpu_smoke_runs_every_step_in_order_into_one_summary(tmp_path):
    """Issue 36: the performance mode's steps on CPU (tiny shapes, wall-clock stand-ins), in priority order,
    inside its own GPU budget, each step's figures in the one summary.json."""
    out = _run(tmp_path, "gpu_check.sh", "--perf --cpu-smoke")
    assert "gpu_check --perf: all steps passed" in out
    budget, total = _budget(out)
    assert list(budget) == PERF_STEPS and sum(budget.values()) == total <= 480, budget
    assert re.findall(r"^=== perf (\S+) \(limit", out, re.M) == PERF_STEPS[1:]
    s = json.loads((tmp_path / "work" / "summary.json").read_text())
    assert s["ok"] and s["mode"] == "perf" and list(s["steps"]) == PERF_STEPS[1:], s["failed"]
    st = {n: x["figures"] for n, x in s["steps"].items()}
    assert all(x["status"] in ("pass", "skipped") and x["limit_s"] == budget[n] for n, x in s["steps"].items())
    runs = [(d["layers"], d["ac"]) for d in st["layers"]["depths"]]
    assert runs == [(2, "selective"), (1, "none"), (2, "none"), (3, "none")]
    assert st["layers"]["fit"]["depths"] == [1, 2, 3]          # the slope, whatever its CPU noise says
    assert st["gemm"]["ceiling_tflops"] > 0 and "no GPU" in st["gemm"]["nvml"]["skipped"]
    assert set(st["phases"]["fsdp"]["phases_s"]) == {"forward", "backward", "clip", "optimizer"}
    assert "CPU stand-in" in st["phases"]["clock"] and "fsdp_copies_s" in st["phases"]
    assert "fwd_bwd_s" in st["sdpa"]["backends"]["MATH"] and st["sdpa"]["chosen"]
    if s["steps"]["compile"]["status"] == "pass":   # a machine with a C++ compiler
        assert [(r["layers"], r["compile"]) for r in st["compile"]["runs"]] == [(1, False), (1, True), (3, False),
                                                                                (3, True)]
        assert all(r["compile_s"] >= 0 for r in st["compile"]["runs"] if r["compile"])
    assert all(v["rel_diff"] < 1e-2 for v in st["loss"]["variants"].values())
    assert st["accum"]["accum_4"]["tokens_per_step"] == 4 * st["accum"]["accum_1"]["tokens_per_step"]
    assert st["float8"].get("tensorwise") or st["float8"].get("skipped")


def test_gpu_perf_resumes_after_a_crashed_step_and_stops_at_its_deadline(tmp_path):
    """A step left "running" by a killed process is marked crashed, not retried; a step the budget no longer
    covers is skipped with the reason; the summary says both (exit 1: the crash is a failure)."""
    (tmp_path / "summary.json").write_text(json.dumps(
        {"mode": "perf", "device": "cpu", "steps": {"layers": {"status": "running", "figures": {"depths": [1]}}}}))
    p = subprocess.run([sys.executable, "benchmarks/gpu_perf.py", "--work", str(tmp_path), "--cpu", "--deadline-s",
                        "0", "layers=10", "gemm=10"], cwd=REPO, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": str(REPO)})
    assert p.returncode == 1, p.stdout + p.stderr
    s = json.loads((tmp_path / "summary.json").read_text())
    assert s["steps"]["layers"]["status"] == "crashed" and s["steps"]["layers"]["figures"] == {"depths": [1]}
    assert s["steps"]["gemm"]["status"] == "skipped" and "budget ran out" in s["steps"]["gemm"]["error"]
    assert s["failed"] == ["layers"] and not s["ok"]


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


@pytest.mark.parametrize("script, args", [("gpu_check.sh", ["--bogus"]), ("gpu_check_multi.sh", ["--bogus"]),
                                          ("gpu_check.sh", ["--perf", "--perf"]),
                                          ("gpu_check.sh", ["--perf", "--fetch-wheels"])])
def test_gpu_checks_reject_an_unknown_option(script, args):
    p = subprocess.run(["bash", f"benchmarks/{script}", *args], cwd=REPO, capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 2 and p.stderr.strip().startswith("usage:")


def test_the_gpu_tests_configs_validate_here():
    """tests/test_gpu.py skips without CUDA, so its configs were first validated on the H200, where they failed
    (data.seq_len over the shape's max_seq_len): build them here, where every run can see them."""
    from test_gpu import cfg

    assert cfg().data.seq_len <= cfg().model.max_seq_len and cfg(dp_shard=1).parallel.dp_shard == 1
