"""Issue 62, invariant 3: a group that makes no progress leaves (llmcluster/ft/watchdog.py;
docs/fault-tolerance.md, "Invariants"). The deadline's rules, its suspension and its expiry, on a clock of the
test's own (no processes, no torch); the real-process case is in tests/test_ft_invariants.py."""

from __future__ import annotations

import json
import threading
import time

import pytest

from llmcluster.ft.watchdog import MEDIAN_OF, Watchdog, append_event


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _dog(clock, **kw):
    fired, lines, kills = [], [], []
    dog = Watchdog(group=1, timeout_s=10.0, first_step_deadline_s=300.0, clock=clock,
                   on_expiry=lambda step, waited, deadline: fired.append((step, round(waited, 3), deadline)),
                   kill=lambda: kills.append(1), log=lines.append, **kw)
    return dog, fired, lines, kills


def test_the_deadline_is_the_first_steps_then_timeout_plus_three_median_steps():
    clock = Clock()
    dog, fired, _lines, kills = _dog(clock)
    assert dog.deadline_s() == 300.0                   # nothing committed: model build, compile
    clock.now += 299.0
    assert not dog.check()
    for step in range(1, MEDIAN_OF):                   # fewer than 5 steps known: still the first step's deadline
        clock.now += 2.0
        dog.committed(step)
        assert dog.deadline_s() == 300.0
    clock.now += 2.0
    dog.committed(MEDIAN_OF)
    assert dog.deadline_s() == pytest.approx(10.0 + 3 * 2.0)   # ft.timeout_s + 3 x the median committed step
    clock.now += 15.9
    assert not dog.check() and not kills
    clock.now += 0.2
    assert dog.check()
    assert fired == [(MEDIAN_OF + 1, 16.1, 16.0)] and kills == [1]
    assert not dog.check() and kills == [1]            # once


def test_an_explicit_step_deadline_counts_from_the_first_committed_step():
    clock = Clock()
    dog, fired, lines, kills = _dog(clock, step_deadline_s=20.0)
    assert dog.deadline_s() == 300.0
    clock.now += 1.0
    dog.committed(7)                                   # a healed group's first committed step is the run's 7th
    assert dog.deadline_s() == 20.0
    clock.now += 20.5
    assert dog.check() and kills == [1]
    assert fired == [(8, 20.5, 20.0)]
    assert "group 1 made no progress on step 8 for 20.5 s (deadline 20.0 s, ft.step_deadline_s)" in lines[0]


def test_no_deadline_while_suspended_and_the_clock_starts_again_after():
    clock = Clock()
    dog, fired, _lines, kills = _dog(clock, step_deadline_s=20.0)
    clock.now += 1.0
    dog.committed(1)
    with dog.suspended():                              # a checkpoint, an evaluation, the quorum, a heal
        clock.now += 1000.0
        assert not dog.check()
        with dog.suspended():                          # nested: a heal inside the quorum
            clock.now += 50.0
        assert not dog.check()                         # still inside the outer one
    clock.now += 19.0
    assert not dog.check()                             # 19 s since the suspension ended
    dog.committed(2)
    assert list(dog.times)[-1] == pytest.approx(19.0)  # the suspended time is not the step's
    clock.now += 21.0
    assert dog.check() and fired[0][0] == 3 and kills == [1]


def test_the_thread_fires_on_its_own_while_the_training_thread_is_blocked(tmp_path):
    """A real thread on the real clock: the training thread blocked (as in a kernel) does nothing; the watchdog
    records the hang and calls the kill it was given."""
    killed = threading.Event()
    dog = Watchdog(group=0, timeout_s=0.05, first_step_deadline_s=0.3, step_deadline_s=0.2, poll_s=0.02,
                   on_expiry=lambda step, waited, deadline: append_event(tmp_path, "hang", step, group=0,
                                                                         waited_s=round(waited, 3)),
                   kill=killed.set, log=lambda line: None)
    dog.committed(4)
    t0 = time.monotonic()
    dog.start()
    assert killed.wait(10)
    assert 0.2 <= time.monotonic() - t0 < 5
    rec = json.loads((tmp_path / "events.jsonl").read_text())
    assert (rec["event"], rec["step"], rec["group"], rec["attempt"]) == ("hang", 5, 0, 1)
    dog.stop()


def test_a_process_stopped_as_a_whole_gets_one_more_deadline_when_it_wakes():
    """SIGSTOP freezes the watchdog's thread too: waking, it finds its own look late, so the process (not its
    training thread) was stopped; its collectives failed meanwhile and it will heal in place: the deadline starts
    again instead of the kill (tests/test_ft_end.py's frozen group)."""
    clock = Clock()
    dog, _fired, lines, kills = _dog(clock, step_deadline_s=20.0)
    clock.now += 1.0
    dog.committed(9)

    class Frozen:   # the thread's wait returns 60 s late once, then on time
        waits = iter([60.0])

        def wait(self, timeout):
            clock.now += next(self.waits, timeout)
            return bool(lines)   # stop once the line was said
    dog._stop = Frozen()
    dog.poll_s = 0.5
    dog._run()                              # one late look, then one on time (stops: the line was said)
    assert not kills and "was stopped for 59.5 s" in lines[0]
    clock.now += 19.0
    assert not dog.check()                  # a fresh deadline from the wake-up
    clock.now += 2.0
    assert dog.check() and kills == [1]


def test_a_step_deadline_not_above_the_collective_timeout_is_refused():
    from llmcluster.config.schema import FtConfig

    with pytest.raises(ValueError, match="ft.step_deadline_s .5. must be above ft.timeout_s .10."):
        FtConfig(step_deadline_s=5)
    assert FtConfig(step_deadline_s=30).step_deadline_s == 30 and FtConfig().step_deadline_s is None


def test_a_group_that_gave_up_waiting_for_a_quorum_is_started_again_uncharged(tmp_path, monkeypatch):
    """Invariant 3's budget rule (launch/ft_local.py): a healthy group that exits EXIT_FT_NO_QUORUM (10 quorum
    timeouts in a row: the others did not come) is started again and not charged; any other exit is charged.
    Unit test of the supervisor's loop (processes stood in for)."""
    from llmcluster.errors import EXIT_FT_NO_QUORUM
    from llmcluster.storage.events import read_events
    from llmcluster.train.procs import _code_from_reasons

    from faultkit import StandInProc as Proc
    from faultkit import stand_in_supervisor

    sup = stand_in_supervisor(tmp_path, [Proc(10, EXIT_FT_NO_QUORUM), Proc(20, -9)], monkeypatch)
    started = []

    def start(g):
        started.append(g)
        sup.procs[g] = Proc(30 + g, 0)   # back, and finishes
    monkeypatch.setattr(sup, "_start_group", start)
    assert sup._supervise() == 0
    assert sup.restarts == [0, 1] and sup.waited == [1, 0] and sorted(started) == [0, 1]
    events = [(e["event"], e["group"]) for e in read_events(tmp_path / "events.jsonl", warn=None)]
    assert sorted(events) == [("ft_group_failed", 1), ("ft_group_waited", 0)]
    # a group of several ranks: the ranks' words give the code (a real failure on one rank is worse)
    for r, word in enumerate(("no_quorum", "no_quorum")):
        (tmp_path / f"exit-rank{r}").write_text(word + " RunFailure: ...\n")
    assert _code_from_reasons(tmp_path, 2) == EXIT_FT_NO_QUORUM
    (tmp_path / "exit-rank1").write_text("failed x\n")
    assert _code_from_reasons(tmp_path, 2) == 1


def test_the_restart_budget_counts_the_failures_of_a_window(tmp_path, monkeypatch):
    """Issue 62, item 5: a group's restart budget (MAX_RESTARTS) counts its failures within RESTART_WINDOW_S, not over
    the run: four failures an hour apart restart the group each time; four within the window stop the run."""
    from llmcluster.launch import ft_local

    from faultkit import StandInProc as Proc
    from faultkit import stand_in_supervisor

    clock = [1000.0]
    monkeypatch.setattr(ft_local.time, "monotonic", lambda: clock[0])
    for gap, stops in ((3600.0, False), (60.0, True)):
        sup = stand_in_supervisor(tmp_path, [Proc(10, None), Proc(20, 1)], monkeypatch)
        outcomes = []
        for _ in range(ft_local.MAX_RESTARTS + 1):
            clock[0] += gap
            outcomes.append(sup._group_failed(1, sup.procs[1], 1))
        assert sup.restarts[1] == ft_local.MAX_RESTARTS + 1
        assert outcomes == [True] * ft_local.MAX_RESTARTS + [not stops], (gap, outcomes)

