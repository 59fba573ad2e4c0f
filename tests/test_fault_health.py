"""Stragglers and hangs under real torchrun (2 ranks): a rank made slow by the sleep hook is named at the
log step, and a collective that a sleeping rank never joins fails after dist.timeout_s with one line naming
the step and the rank, instead of hanging."""

from __future__ import annotations

import pytest

import re

from faultkit import make_dataset, run, sets, torchrun_cmd

from llmcluster.train.health import BusyTimer, FaultInjector, slow_ranks


def test_straggler_decision_and_the_test_clock():
    assert slow_ranks([0.1, 1.0], 1.5) == (0.55, [1])
    assert slow_ranks([1.0, 1.0, 1.0, 1.6], 1.5) == (1.0, [3])
    assert slow_ranks([1.0, 1.4], 1.5)[1] == []
    inject = FaultInjector(1, {"LLMCLUSTER_TESTING": "1", "LLMCLUSTER_INJECT_BUSY": "0:0.1:1-6,1:1.0:2-3"})
    assert [inject.busy_time(s, 0.25) for s in (1, 2, 3, 4)] == [0.25, 1.0, 1.0, 0.25]
    assert FaultInjector(0, {}).busy_time(7, 0.25) == 0.25


class FakeCudaEvent:
    """torch.cuda.Event stand-in (no GPU here): each event's device timestamp comes from a scripted list, the
    way the stream would reach it, and `synchronize`/`elapsed_time` behave as CUDA's do."""
    device_ms = []

    def __init__(self, enable_timing=False):
        assert enable_timing
        self.ms, self.synced = None, False

    def record(self):
        self.ms = FakeCudaEvent.device_ms.pop(0)

    def synchronize(self):
        self.synced = True

    def elapsed_time(self, end):
        assert end.synced, "read before the end event completed"
        return end.ms - self.ms


def test_busy_time_is_device_time_on_cuda_and_host_time_on_cpu(monkeypatch):
    import torch
    from types import SimpleNamespace
    monkeypatch.setattr(torch.cuda, "Event", FakeCudaEvent)
    host = iter([100.0, 100.002])           # the host returns 2 ms after launching the kernels ...
    FakeCudaEvent.device_ms = [5.0, 805.0]   # ... which the device runs for 800 ms
    t = BusyTimer(SimpleNamespace(type="cuda"), clock=lambda: next(host))
    t.start()
    t.stop()
    assert t.seconds() == pytest.approx(0.8)
    host = iter([100.0, 100.25])
    cpu = BusyTimer(torch.device("cpu"), clock=lambda: next(host))
    cpu.start()
    cpu.stop()
    assert cpu.seconds() == pytest.approx(0.25) and cpu._begin is None


def test_slow_rank_is_named_and_a_hung_collective_fails_naming_step_and_rank(tmp_path):
    root = make_dataset(tmp_path / "storage")
    # Steps 1-6 run on the straggler test clock (health.py): rank 1 reports 1.0 s of compute, rank 0 0.1 s, so
    # the decision at the log steps 3 and 6 does not depend on this machine's load. Rank 1 really sleeps 12 s
    # before step 9: hung past the 5 s timeout.
    proc = run(torchrun_cmd(2, "train", "-c", "llm_tiny", "--root", root,
                            *sets(train__steps=40, log__interval=3, dist__timeout_s=5, checkpoint__interval_steps=100)),
               timeout=180, LLMCLUSTER_TESTING="1", LLMCLUSTER_INJECT_BUSY="0:0.1:1-6,1:1.0:1-6",
               LLMCLUSTER_INJECT_SLEEP="1:12:9")
    out = proc.stdout + proc.stderr
    named = re.findall(r"warning: straggler: rank (\d) compute time ([\d.]+)s vs median ([\d.]+)s", out)
    assert named == [("1", "1.000", "0.550")] * 2, out[-3000:]
    assert proc.returncode != 0
    line = re.search(r"llmcluster train: error: after step 8, rank 0: a collective did not complete within "
                     r"dist.timeout_s=5s.*", out)
    assert line, out[-3000:]
    assert "Traceback" not in line.group(0)
    assert "finished step" not in out
