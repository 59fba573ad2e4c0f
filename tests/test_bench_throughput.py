"""`make bench` (benchmarks/train_throughput.py) runs and prints what its docstring promises: each side's
tokens/s with its page faults a step, the allocator in use, both ratios and the bound the shared kernels set. No
speed is asserted here (2 shared cores drift); the figures are in docs/compat.md."""

import os
import re
import subprocess
import sys

import pytest

from conftest import REPO

pytestmark = pytest.mark.slow   # an inductor compile and transformers' import: ~20 s


def test_the_throughput_benchmark_prints_sides_faults_allocator_and_ratios(tmp_path):
    pytest.importorskip("transformers")
    env = {k: v for k, v in os.environ.items()   # no allocator choice of the caller's: the trainer's default
           if k not in ("LD_PRELOAD", "GLIBC_TUNABLES") and not k.startswith("MALLOC_")}
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "train_throughput.py"), "--rounds", "1",
                           "--steps", "1", "--warmup", "1", "--batch", "1", "--seq-len", "16",
                           "--set", "model.n_layers=1"], capture_output=True, text=True, cwd=tmp_path,
                          env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout
    for side in ("llmcluster eager", "llmcluster compiled", "transformers"):
        assert re.search(rf"^{side} +[\d,]+ tokens/s .*; [\d,]+ page faults a step\)$", out, re.M), out
    assert "allocator: freed buffers kept, as the trainer does" in out   # as in the trainer (glibc here)
    bound = re.search(r"^transformers: (\d+)% of profiled steps in matmuls and attention .* at most (\d+\.\d\d)x$",
                      out, re.M)
    assert bound and 0 < int(bound[1]) < 100 and abs(float(bound[2]) - 100 / int(bound[1])) < 0.2, out
    assert len(re.findall(r"^ratio llmcluster (eager|compiled) / transformers .*: \d+\.\d\dx", out, re.M)) == 2
