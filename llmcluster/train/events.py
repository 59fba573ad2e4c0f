"""logs/<run>/events.jsonl: the run's own record of where its time went, for `llmcluster jobs goodput`.

Rank 0 appends one line per lifecycle event — attempt_start (the process's start time), restore_start/end,
init_done, eval_start/end, save_start/end, checkpointed (a checkpoint became durable), exit — plus a `step`
heartbeat at every step boundary (about 70 bytes a step), so a killed attempt's end is known to a step. Every line has the time, the attempt number (one more than the attempts
already in the file) and the training step reached. Lifecycle lines are fsynced (a few per checkpoint
interval); heartbeats are only flushed, which a killed process does not lose.

No torch here: the head node reads these files.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

EVENTS = "events.jsonl"


def process_start_time() -> float:
    """When this process started (Unix time): its startup includes the interpreter and torch imports."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        btime = next(int(ln.split()[1]) for ln in Path("/proc/stat").read_text().splitlines()
                     if ln.startswith("btime"))
        return btime + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return time.time()


def read_events(path: Path) -> list[dict]:
    """The well-formed records of an events file (anything else, e.g. a line cut by a crash, is skipped)."""
    out = []
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return out
    for line in text.splitlines():
        try:
            r = json.loads(line)
        except ValueError:
            continue
        if (isinstance(r, dict) and isinstance(r.get("t"), (int, float)) and isinstance(r.get("attempt"), int)
                and isinstance(r.get("event"), str) and isinstance(r.get("step", 0), int)):
            out.append(r)
    return out


class EventLog:
    """Rank 0's writer; on other ranks every call is a no-op."""

    def __init__(self, log_dir: Path, enabled: bool):
        self.file = None
        self.attempt = 0
        self.step = 0
        if not enabled:
            return
        self.path = log_dir / EVENTS
        self.attempt = 1 + max((r["attempt"] for r in read_events(self.path)), default=0)
        self.created = not self.path.exists()    # ours to remove again if the run is refused (discard)
        self.file = open(self.path, "a")
        self.emit("attempt_start", t=process_start_time(), pid=os.getpid())

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
        self.emit("step", step, sync=False)

    def discard(self) -> None:
        """A refused start (bad input) leaves no run folder behind: the file goes if this writer made it."""
        created = self.file is not None and self.created
        self.close()
        if created:
            self.path.unlink(missing_ok=True)

    def close(self, reason: str | None = None) -> None:
        if self.file is not None:
            if reason:
                self.emit("exit", reason=reason)
            self.file.close()
            self.file = None
