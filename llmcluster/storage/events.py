"""logs/<run>/events.jsonl: the run's own record of where its time went, for `llmcluster jobs goodput`.

Rank 0 appends one line per lifecycle event — attempt_start (the process's start time), restore_start/end,
init_done, eval_start/end, save_start/end, checkpointed (a checkpoint became durable), noop_start (this start
trains nothing: already finished, or refused after start-up; its reason), exit — plus a `step`
heartbeat at every step boundary (about 70 bytes a step), so a killed attempt's end is known to a step. Every line has the time, the attempt number (one more than the attempts
already in the file) and the training step reached. Lifecycle lines are fsynced (a few per checkpoint
interval); heartbeats are only flushed, which a killed process does not lose.

An ft run (per-step fault tolerance, docs/fault-tolerance.md) adds, from its writer group: ft_quorum (`groups`,
`of` the run's groups, `replica_ids`) when the quorum changes, ft_heal (`group` healed, `peer`, `bytes`, `seconds`, `side`), ft_straggler
(`group` that left the quorum, its `busy_s`, the others' `median_s`, `steps` slow in a row); and from
the supervisor (launch/ft_local.py, one appended line each): ft_group_failed (`group`, `pids`, `exit_code`),
ft_lighthouse_lost; ft_writer (`group`, `previous`) from a group that takes the writer's role over; and ft_stranger
(`replica_ids`: a quorum refused for a member without the run's secret, docs/security.md); from any group, `hang`
(`group`, `rank`, `waited_s`, `deadline_s`: its watchdog found no progress and killed it, ft/watchdog.py); and from
the supervisor, ft_group_waited (`group`, `pids`, `exit_code`: it gave up waiting for a quorum; not a failure).

No torch here: the head node reads these files.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from llmcluster.storage import records

EVENTS = "events.jsonl"
NOOP = "noop_start"   # {"reason": ...}: an attempt that trained nothing (jobs goodput leaves it out)


def process_start_time() -> float:
    """When this process started (Unix time): its startup includes the interpreter and torch imports."""
    try:   # seconds since boot at the start, against the boot clock now (btime, whole seconds, is up to 1 s off)
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        return time.time() - (time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError, AttributeError):
        return time.time()


# A line's shape (storage/records.py): `jobs goodput` computes with every one of these, so a line without them, or
# with a non-finite time (1e400 parses as inf), is skipped rather than allowed to crash or poison the sums.
REQUIRED = {"t": records.number(0), "attempt": records.integer(1), "event": records.TEXT, "step": records.integer(0)}
# Every other field a writer here puts in a line, by its name whatever the event (the ft lines' above, the
# supervisor's), so that a hand-written `"group": [1]` is a bad line skipped with the note, never a TypeError.
OPTIONAL = {"ckpt": records.integer(0), "reason": records.TEXT, "pid": records.integer(1),
            "group": records.integer(0), "peer": records.integer(0), "previous": records.integer(0),
            "bytes": records.number(0), "seconds": records.number(0), "side": records.TEXT,
            "groups": records.integer(0), "of": records.integer(1), "replica_ids": records.LIST, "busy_s": records.number(0),
            "median_s": records.number(0), "steps": records.integer(0), "pids": records.LIST,
            "exit_code": records.integer(), "code": records.integer(), "rank": records.integer(0),
            "waited_s": records.number(0), "deadline_s": records.number(0)}


FT_PREFIX = "ft_"   # per-step fault tolerance's records (launch/goodput.py's ft_summary)
HANG = "hang"       # an ft group's watchdog fired (ft/watchdog.py): a record of ft's, it splits no interval either


def is_ft(e: dict) -> bool:
    return e["event"].startswith(FT_PREFIX) or e["event"] == HANG


def attempts(events: list[dict]) -> list[list[dict]]:
    """The run's attempts that could train, in order, each its events in time order. A no-op start (already
    finished, refused: it says so with a noop_start event) is no attempt: its seconds are neither the job's
    wall time nor queued time, so re-running a finished run leaves its goodput as it was."""
    by: dict[int, list[dict]] = {}
    for e in events:
        by.setdefault(e["attempt"], []).append(e)
    return [sorted(by[a], key=lambda e: e["t"]) for a in sorted(by)
            if not any(e["event"] == NOOP for e in by[a])]


def trained_attempts(events: list[dict]) -> list[list[dict]]:
    """`attempts` of the trainer's own lines (ft's records split nothing): what `jobs goodput` counts."""
    return attempts([e for e in events if not is_ft(e)])


def read_events(path: Path, warn=records.note) -> list[dict]:
    """The records of an events file that have their shape; anything else (a line cut by a crash, a hand
    edit) is skipped, with one note for the file through `warn` (None: silently)."""
    return records.read_jsonl(path, REQUIRED, OPTIONAL, warn)


def _cut(path: Path) -> bool:
    """Whether the file's last line lacks its newline (a writer killed mid-line)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            if f.tell() == 0:
                return False
            f.seek(-1, os.SEEK_END)
            return f.read(1) != b"\n"
    except OSError:
        return False


class EventLog:
    """Rank 0's writer; on other ranks every call is a no-op."""

    def __init__(self, log_dir: Path, enabled: bool):
        self.file = None
        self.attempt = 0
        self.step = 0
        self.trained = self.noted = False   # a step heartbeat written / a no-op start said
        self.log_dir = log_dir
        if not enabled:
            return
        self.attempt = 1 + self._open()
        self.emit("attempt_start", t=process_start_time(), pid=os.getpid())

    def _open(self) -> int:
        """Open the file for appending; the last attempt number in it (0: none)."""
        self.path = self.log_dir / EVENTS
        last = max((r["attempt"] for r in read_events(self.path, warn=None)), default=0)
        self.created = not self.path.exists()    # ours to remove again if the run is refused (discard)
        self.file = open(self.path, "a")
        if not self.created and _cut(self.path):
            self.file.write("\n")   # a line cut by a crash must not swallow this attempt's first line
        return last

    def take_over(self, step: int, **fields) -> None:
        """An ft group becomes the run's writer mid-attempt (its writer died): the file is opened again and the
        attempt goes on (no attempt_start: a hand-over is not a start); one ft_writer line says so."""
        if self.file is not None:
            return
        self.attempt = max(self._open(), 1)
        self.created = False   # the run's file, never removed by this writer
        self.emit("ft_writer", step, **fields)

    def hand_over(self) -> None:
        """The other side: this group stops writing (no exit line: the attempt goes on in another group)."""
        if self.file is not None:
            self.file.close()
            self.file = None

    def emit(self, event: str, step: int | None = None, sync: bool = True, t: float | None = None,
             **fields) -> None:
        """`step`: the training step reached (default: the last one given)."""
        self.step = self.step if step is None else step
        if self.file is None:
            return
        rec = {"t": round(time.time() if t is None else t, 6), "attempt": self.attempt, "event": event,
               "step": self.step, **fields}
        self.file.write(json.dumps(rec) + "\n")
        self.file.flush()
        if sync:
            os.fsync(self.file.fileno())

    def heartbeat(self, step: int) -> None:
        self.trained = True
        self.emit("step", step, sync=False)

    def noop(self, reason: str) -> None:
        """This attempt trains nothing (already finished, refused): said once, so that `jobs goodput` leaves
        it out of the attempts, their wall time and the queued time (issue 34: re-running a finished run
        must not change its goodput)."""
        if not self.noted:
            self.noted = True
            self.emit(NOOP, reason=" ".join(reason.split())[:300])

    def discard(self, reason: str = "refused") -> None:
        """A refused start (bad input): a file this writer made goes (no run folder left behind); in a run's
        existing file the attempt is recorded as a no-op start."""
        created = self.file is not None and self.created
        if not created:
            self.noop(reason)
        self.close()
        if created:
            self.path.unlink(missing_ok=True)

    def close(self, reason: str | None = None, detail: str = "") -> None:
        """`reason`: how the attempt ended (exit_reason's words). A fatal end before any step (a refusal
        after start-up) makes it a no-op start; a failure or a preemption stays an attempt (its time was
        spent by the job)."""
        if self.file is not None:
            if reason == "fatal" and not self.trained:
                self.noop(detail or "refused before the first step")
            if reason:
                self.emit("exit", reason=reason)
            self.file.close()
            self.file = None
