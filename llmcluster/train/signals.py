"""Preemption: SIGTERM (scheduler kill, torchrun forwarding), SIGUSR2 (Slurm's pre-time-limit signal; not
SIGUSR1, which NCCL uses), SIGHUP (a closed terminal or ssh session) and Ctrl-C (SIGINT) set a flag. The flag
is acted on only at a step boundary, after all ranks agree on it (an all-reduce MAX), because a rank that
stops alone leaves the others blocked in a collective: the run checkpoints and exits 75. A second Ctrl-C
aborts at once (KeyboardInterrupt), without a checkpoint."""

from __future__ import annotations

import os
import signal
import time

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR2, signal.SIGHUP, signal.SIGINT)


class PreemptionFlag:
    def __init__(self):
        self.signal: int | None = None
        self.at: float | None = None
        self._previous = {}

    def install(self) -> PreemptionFlag:
        for sig in STOP_SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, _frame) -> None:
        if self.signal is None:
            self.signal, self.at = signum, time.time()
            if signum == signal.SIGINT and os.environ.get("RANK", "0") == "0":
                print("Ctrl-C: checkpointing at the next step boundary, then exiting 75 (Ctrl-C again aborts "
                      "without a checkpoint)", flush=True)
        elif signum == signal.SIGINT:
            raise KeyboardInterrupt

    @property
    def set(self) -> bool:
        return self.signal is not None

    def uninstall(self) -> None:
        for sig, prev in self._previous.items():
            signal.signal(sig, prev)
        self._previous.clear()
