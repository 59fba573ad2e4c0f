"""Issue 62's fault-schedule explorer, a fixed few seeds (benchmarks/ft_schedules.py holds the schedules and the
checks, and runs hundreds of seeds): each seed draws groups, ft.min_replicas, the end (train.steps or stop_at) and
1-2 faults among SIGKILL, SIGSTOP for T s, an in-process hang and a slow return after the checkpoint read, some in
the last 20% of the run; the run must keep the invariants (docs/fault-tolerance.md, "Invariants"). A failing seed
prints the command that replays it."""

from __future__ import annotations

import importlib.util
import sys

import pytest

from conftest import REPO

pytest.importorskip("torchft")


def _explorer():
    spec = importlib.util.spec_from_file_location("ft_schedules", REPO / "benchmarks" / "ft_schedules.py")
    mod = sys.modules["ft_schedules"] = importlib.util.module_from_spec(spec)   # its dataclasses look it up
    spec.loader.exec_module(mod)
    return mod


def test_a_seed_draws_the_same_schedule_and_faults_land_late_too():
    ex = _explorer()
    assert ex.draw(3) == ex.draw(3)
    schedules = [ex.draw(s) for s in range(200)]
    for s in schedules:
        assert 2 <= s.groups <= 3 and 1 <= s.min_replicas < s.groups
        assert 1 <= len(s.faults) <= 2 and len({f.group for f in s.faults}) == len(s.faults)
        assert all(3 <= f.step < s.last and f.kind in ex.KINDS for f in s.faults)
    faults = [(f, s) for s in schedules for f in s.faults]
    assert {f.kind for f, _ in faults} == set(ex.KINDS)
    assert sum(f.step >= 0.8 * s.last for f, s in faults) > len(faults) // 3   # the end is where it breaks
    assert any(s.stop_at for s in schedules) and any(not s.stop_at for s in schedules)
    assert "--seed 3" in ex.replay_command(ex.draw(3))


# 3: 2 groups; group 1 killed at 15 and slow to return (10.4 s), group 0 (the writer) hangs in-process at 33 of 35.
# 2: 2 groups; group 1 SIGKILLed at 21 of 26.
@pytest.mark.slow   # real processes: ~1-2 minutes a seed on a loaded 2-core machine
@pytest.mark.parametrize("seed", [3, 2])
def test_a_fault_schedule_keeps_the_invariants(tiny_root, tmp_path, seed):
    ex = _explorer()
    s = ex.draw(seed)
    r = ex.run_schedule(s, tiny_root, tmp_path / f"seed-{seed}")
    print(f"seed {seed}: {r['seconds']} s, hangs {r['hangs']}, failed groups {r['failed']}")
    assert r["ok"], (f"seed {seed} broke the invariants: {r['problems']}; schedule {r['schedule']}; logs in "
                     f"{tmp_path} and {tiny_root / 'logs' / f'sched-{seed}'}; replay: {r['replay']} (on a busy "
                     "machine the interleaving may differ)")
