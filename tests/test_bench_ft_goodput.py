"""benchmarks/ft_goodput.py's own arithmetic (issue 52), without its runs (minutes of real processes): kill points
off the checkpoint steps, and ft's cost per step from the two failure-free runs' metrics records, term by term.
No speed is asserted (2 shared cores drift); the benchmark's figures need a quiet machine."""

import importlib.util

import pytest

from conftest import REPO


def bench():
    spec = importlib.util.spec_from_file_location("ft_goodput", REPO / "benchmarks" / "ft_goodput.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_kill_points_are_off_the_checkpoint_steps():
    b = bench()
    assert b.kill_points("90,30", 20, 120) == [30, 90]
    for bad in ("20,30", "30,120", "0"):
        with pytest.raises(SystemExit, match="off the checkpoint steps"):
            b.kill_points(bad, 20, 120)


def test_ft_step_cost_side_by_side_and_term_by_term():
    b = bench()
    ddp = [{"step": k, "step_time_s": 9.0 if k <= b.WARMUP else 1.0} for k in range(1, 16)]   # warm-up left out
    parts = {"quorum": 0.05, "copy": 0.01, "allreduce": 0.1, "commit": 0.02}
    ft = [{"step": k, "step_time_s": 9.0 if k <= b.WARMUP else 1.25, "ft_s": parts} for k in range(1, 16)]
    cost = b.step_cost({"ddp": [ddp, ddp], "ft": [ft, ft]})   # two rounds of each, each with its warm-up
    assert cost["ddp_step_s"] == 1.0 and cost["ft_step_s"] == 1.25 and cost["ratio"] == 1.25
    assert cost["ft_parts_s"] == parts and cost["rest_s"] == pytest.approx(0.25 - 0.18)
    assert b.PARTS == __import__("llmcluster.ft.group", fromlist=["TIMINGS"]).TIMINGS   # the trainer's own names


def test_the_membership_proofs_cost_is_timed_per_quorum_over_gloo():
    pytest.importorskip("torchft")
    cost = bench().proof_cost(rounds=3)
    assert cost["members"] == 2 and cost["rounds"] == 3
    assert 0 < cost["median_s"] <= cost["max_s"] < 30   # every round proved (a refusal raises), within the timeout
