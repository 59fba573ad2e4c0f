"""`benchmarks/gpu_check.sh --cpu-smoke`: the GPU check's own steps (tests, validate, bench, train with AC,
checkpoint, resume) on CPU with tiny shapes, so the script cannot rot between the runs on a GPU machine."""

from __future__ import annotations

import os
import subprocess

import pytest

from conftest import REPO

pytestmark = pytest.mark.slow


def test_gpu_check_cpu_smoke_runs_every_step(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("OUT", "LLMCLUSTER_STORAGE")}
    env.update(GPU_CHECK_WORK=str(tmp_path / "work"), OMP_NUM_THREADS="2")
    p = subprocess.run(["bash", "benchmarks/gpu_check.sh", "--cpu-smoke"], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=600)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-5000:]
    assert "gpu_check: all steps passed" in out
    for step in ("pytest", "validate", "bench", "train", "resume"):
        assert f"=== {step} (limit" in out, step
    assert "MFU" in out and "resumed from" in out and "finished step 20" in out
    assert (tmp_path / "work" / "validate.json").is_file()
    assert (tmp_path / "work" / "gpu_check.log").read_text().strip()


def test_gpu_check_rejects_an_unknown_option():
    p = subprocess.run(["bash", "benchmarks/gpu_check.sh", "--bogus"], cwd=REPO, capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 2 and p.stderr.strip().startswith("usage:")
