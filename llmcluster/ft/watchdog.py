"""A group that makes no progress leaves (issue 62, invariant 3; docs/fault-tolerance.md, "Invariants").

A group hung while its process lives (a stuck kernel, a hung collective inside the group, a stalled read) keeps
heartbeating through torchft's ManagerServer, and the Lighthouse forms no quorum without more than half of the
heartbeating groups: with 2 groups, the healthy one commits nothing while the other hangs. So each rank of each
group runs this watchdog: a daemon thread that reads one monotonic timestamp the training loop moves at every
committed step (`committed`) and at the end of every suspension (`suspended`: a checkpoint, an evaluation, the
quorum and a heal, which are bounded by their own settings). When no progress was made within the deadline it
records a `hang` event naming the group and the step, prints one line and SIGKILLs its own process (a stuck CUDA
kernel ignores Python signals): torchft's heartbeat for the group ends with it, the others form their quorum, and
the group's launcher starts it again; it heals from a peer like any returning group.

The deadline (`deadline_s`):
- before the first committed step of this process, and while fewer than MEDIAN_OF steps are known:
  ft.first_step_deadline_s (model build, compile, the first collectives);
- ft.step_deadline_s when set;
- else ft.timeout_s + 3 x the median committed step time (of the last WINDOW steps). A healthy group's longest
  stretch without progress outside a suspension is one step's own work plus one cross-group collective that
  waits ft.timeout_s on a hung peer (then the step is retried through the quorum, a suspension): the deadline
  stays above it, so the hung group's watchdog fires and the healthy group's does not.

No torch here, and nothing the training thread must do but call `committed`: the thread needs no cooperation
from a training thread stuck in a kernel (it reads a float; a thread blocked in native code holds no GIL).
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import signal
import statistics
import sys
import threading
import time
from pathlib import Path

MEDIAN_OF = 5       # committed steps known before the step time counts (until then: the first-step deadline)
WINDOW = 50         # the median is over this many recent steps
STEP_FACTOR = 3.0   # x the median committed step time
POLL_S = 0.5        # how often the thread looks
FROZEN_S = 5.0      # the thread's own look late by more than this: the whole process was stopped (SIGSTOP, a VM
                    # paused), not its training thread hung: it gets one more deadline to notice and heal in place


def kill_self() -> None:
    """SIGKILL this process: a Python signal handler would wait for a training thread stuck in native code."""
    os.kill(os.getpid(), signal.SIGKILL)


class Watchdog:
    """`on_expiry(step, waited_s, deadline_s)` records the hang (an event); `kill` ends the process. `clock` is
    monotonic seconds. `start()` runs the thread; tests call `check()` with their own clock instead."""

    def __init__(self, *, group: int, timeout_s: float, first_step_deadline_s: float,
                 step_deadline_s: float | None = None, on_expiry=None, kill=kill_self, clock=time.monotonic,
                 log=None, poll_s: float = POLL_S):
        self.group, self.timeout_s = group, timeout_s
        self.first_step_deadline_s, self.step_deadline_s = first_step_deadline_s, step_deadline_s
        self.on_expiry, self.kill, self.clock, self.poll_s = on_expiry, kill, clock, poll_s
        self.log = log or (lambda line: print(line, file=sys.stderr, flush=True))
        self.step = 0                  # the last step committed (what the hang event names: step + 1 hung)
        self.commits = 0               # committed by this process (a restarted group starts again at 0)
        self.times: collections.deque[float] = collections.deque(maxlen=WINDOW)
        self.since = clock()           # the last progress: a committed step, or the end of a suspension
        self.held = 0                  # suspensions open (they nest: a heal inside a quorum, a save in a stop)
        self.fired = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- the training thread's side ----------------------------------------------------------------
    def committed(self, step: int) -> None:
        now = self.clock()
        if self.held == 0:
            self.times.append(now - self.since)
        self.step, self.since = step, now
        self.commits += 1

    @contextlib.contextmanager
    def suspended(self):
        """No deadline while the group checkpoints, evaluates, waits for its quorum or heals (each bounded by its
        own setting); the clock starts again when it ends."""
        self.held += 1
        try:
            yield
        finally:
            self.held -= 1
            self.since = self.clock()

    # -- the deadline ------------------------------------------------------------------------------
    def deadline_s(self) -> float:
        if self.commits == 0:
            return self.first_step_deadline_s
        if self.step_deadline_s is not None:
            return self.step_deadline_s
        if len(self.times) < MEDIAN_OF:
            return self.first_step_deadline_s
        return self.timeout_s + STEP_FACTOR * statistics.median(self.times)

    def check(self) -> bool:
        """True (and the hang recorded, said and the process killed) when the deadline passed without progress."""
        if self.fired or self.held:
            return False
        waited, deadline = self.clock() - self.since, self.deadline_s()
        if waited <= deadline or self.held:
            return False
        self.fired = True
        step = self.step + 1
        try:
            if self.on_expiry is not None:
                self.on_expiry(step, waited, deadline)
        finally:
            self.log(f"ft: group {self.group} made no progress on step {step} for {waited:.1f} s (deadline "
                     f"{deadline:.1f} s, {self.describe()}): it leaves (SIGKILL to itself; its launcher starts it "
                     "again and it heals from a peer)")
            self.kill()
        return True

    def describe(self) -> str:
        if self.commits == 0 or (self.step_deadline_s is None and len(self.times) < MEDIAN_OF):
            return "ft.first_step_deadline_s"
        if self.step_deadline_s is not None:
            return "ft.step_deadline_s"
        return f"ft.timeout_s + {STEP_FACTOR:g} x the median step {statistics.median(self.times):.2f} s"

    # -- the thread --------------------------------------------------------------------------------
    def start(self) -> Watchdog:
        self._thread = threading.Thread(target=self._run, name=f"ft-watchdog-{self.group}", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        looked = self.clock()
        while not self._stop.wait(self.poll_s):
            now = self.clock()
            late, looked = now - looked - self.poll_s, now
            if late > FROZEN_S:
                self.thawed(late)
            try:
                if self.check():
                    return
            except Exception as e:   # noqa: BLE001 (a watchdog that crashed says so, not stop silently)
                self.log(f"ft: group {self.group}: watchdog error: {type(e).__name__}: {e}")

    def thawed(self, late: float) -> None:
        """The process was stopped as a whole for `late` s (this thread too): its collectives failed meanwhile and
        its training thread, running again, goes back to the quorum and heals; the deadline starts again."""
        self.since = max(self.since, self.clock())
        self.log(f"ft: group {self.group}: this process was stopped for {late:.1f} s (its watchdog too): the "
                 "deadline starts again")

    def stop(self) -> None:
        self._stop.set()


def append_event(log_dir: Path, kind: str, step: int, **fields) -> None:
    """One line appended to the run's events.jsonl in one write (as the supervisor writes ft_group_failed): a
    group that is not the writer has no EventLog of its own, and its hang must still be on the record."""
    from llmcluster.storage.events import EVENTS, read_events

    path = Path(log_dir) / EVENTS
    try:
        recs = read_events(path, warn=None) if path.is_file() else []
        attempt = max((r["attempt"] for r in recs), default=1)
        line = json.dumps({"t": round(time.time(), 6), "attempt": attempt, "event": kind, "step": step, **fields})
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, (line + "\n").encode())
        finally:
            os.close(fd)
    except OSError as e:   # the kill still comes: a hung group must leave even if the record could not be written
        print(f"ft: the {kind} event could not be written to {path}: {e}", file=sys.stderr, flush=True)
