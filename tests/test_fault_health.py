"""Stragglers and hangs under real torchrun (2 ranks): a rank made slow by the sleep hook is named at the
log step, and a collective that a sleeping rank never joins fails after dist.timeout_s with one line naming
the step and the rank, instead of hanging."""

from __future__ import annotations

import pytest

import re

from faultkit import make_dataset, run, sets, torchrun_cmd


def test_slow_rank_is_named_and_a_hung_collective_fails_naming_step_and_rank(tmp_path):
    root = make_dataset(tmp_path / "storage")
    # rank 1: 0.4 s extra on steps 1-6 (a straggler), then 12 s at step 9 (hung past the 5 s timeout)
    proc = run(torchrun_cmd(2, "train", "-c", "llm_tiny", "--root", root,
                            *sets(train__steps=40, log__interval=3, dist__timeout_s=5, checkpoint__interval_steps=100)),
               timeout=180, LLMCLUSTER_INJECT_SLEEP="1:0.4:1-6,1:12:9")
    out = proc.stdout + proc.stderr
    assert re.search(r"warning: straggler: rank 1 compute time 0\.\d+s vs median 0\.\d+s", out), out[-3000:]
    assert "straggler: rank 0" not in out
    assert proc.returncode != 0
    line = re.search(r"llmcluster train: error: after step 8, rank 0: a collective did not complete within "
                     r"dist.timeout_s=5s.*", out)
    assert line, out[-3000:]
    assert "Traceback" not in line.group(0)
    assert "finished step" not in out
