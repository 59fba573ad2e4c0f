"""Step health: loss spikes, stragglers, hung collectives, the sample log, and the fault-injection hooks.

Non-finite steps are skipped in `Trainer.train_step`; this module holds what watches the run around them:

- `LossSpikeDetector`: like llm.c's outlier detector, the z-score of this step's loss against a window of
  recent losses. Every rank sees the same all-reduced loss, so every rank takes the same decision.
- `slow_ranks`: ranks whose compute time (step start to the last forward: no collective waits under DDP)
  exceeds the median by `log.straggler_factor`; `BusyTimer` measures it (CUDA events on a GPU, host time on CPU).
- `CollectiveFailure`: a collective that timed out (`dist.timeout_s`) or lost its peer, reported as one
  line naming the step and the rank, instead of a hang or a C++ traceback.
- `young_daly_steps`: the checkpoint interval that minimises lost work, sqrt(2 · save time · MTBF).
- `SampleLog`: opt-in (`log.sample_log: true`) per-rank record of the global sample ids of every step, so
  a test can prove that interrupted and resumed runs neither repeat nor skip a sample.
- Fault injection (test hooks, read from the environment; they act only with LLMCLUSTER_TESTING=1, see
  llmcluster/testing.py):
    LLMCLUSTER_INJECT_NAN_AT_STEP=5,7-9        the loss (hence the gradients) of those steps becomes NaN
    LLMCLUSTER_INJECT_SPIKE_AT_STEP=12         the loss of those steps is multiplied by 10
    LLMCLUSTER_INJECT_SLEEP=1:0.3:1-4,1:20:6   rank:seconds[:steps] sleep before those steps' forward
                                               (steps: N, A-B, or N;M)
    LLMCLUSTER_INJECT_SLEEP_UNTIL=PATH         those sleeps end once PATH exists (a test that waits for
                                               events, not for the clock, lets the rest of the run go fast)
    LLMCLUSTER_INJECT_BUSY=0:0.1:1-6,1:1:1-6   rank:seconds[:steps] the straggler clock: the compute time
                                               that rank reports for those steps (a test decides who is
                                               slow without racing the machine's load)
"""

from __future__ import annotations

import json
import math
import os
import statistics
import time
from collections import deque
from pathlib import Path

from llmcluster.errors import EXIT_FAILURE as EXIT_RUNTIME, RunFailure
from llmcluster.testing import hook_steps, per_rank, test_hook


class LossSpikeDetector:
    def __init__(self, window: int, zscore: float | None):
        self.zscore = zscore
        self.losses: deque[float] = deque(maxlen=window)

    def score(self, loss: float) -> float | None:
        """z-score of `loss` against the window, or None until the window is full."""
        if len(self.losses) < self.losses.maxlen or not math.isfinite(loss):
            return None
        mean = statistics.fmean(self.losses)
        std = statistics.pstdev(self.losses, mean)
        return (loss - mean) / std if std > 0 else 0.0

    def is_spike(self, z: float | None) -> bool:
        return self.zscore is not None and z is not None and z > self.zscore

    def update(self, loss: float) -> None:
        # Spikes enter the window too (as in llm.c): a lasting shift of the loss level becomes the new
        # normal instead of skipping every later step.
        if math.isfinite(loss):
            self.losses.append(loss)

    def state_dict(self) -> list[float]:
        return list(self.losses)

    def load_state_dict(self, losses: list[float] | None) -> None:
        self.losses.clear()
        self.losses.extend(losses or [])


def slow_ranks(times: list[float], factor: float) -> tuple[float, list[int]]:
    """(median step time, ranks slower than median × factor)."""
    med = statistics.median(times)
    return med, [r for r, v in enumerate(times) if med > 0 and v > med * factor]


class CollectiveFailure(RunFailure):
    """One line instead of a hang: which step, which rank, what to look at."""

    def __init__(self, step: int, rank: int, timeout_s: float, error: BaseException):
        what = " ".join(str(error).split())[:200]
        timed_out = "timed out" in what.lower() or "timeout" in what.lower()
        cause = (f"a collective did not complete within dist.timeout_s={timeout_s:g}s" if timed_out
                 else "a collective failed (a peer rank died or closed its connection)")
        super().__init__(f"after step {step}, rank {rank}: {cause}: another rank is hung, dead or far slower "
                         f"(see its log; the last complete checkpoint is intact) [{what}]",
                         exit_code=EXIT_RUNTIME)


def is_collective_error(e: BaseException) -> bool:
    """gloo/NCCL failures surface as DistError subclasses or RuntimeErrors naming the transport."""
    import torch.distributed as dist

    if isinstance(e, getattr(dist, "DistError", ())):
        return True
    text = str(e).lower()
    return isinstance(e, RuntimeError) and any(
        k in text for k in ("gloo", "nccl", "timed out", "connection closed", "connection reset"))


class SampleLog:
    """logs/<run>/samples-rank<r>.jsonl (ft: samples-group<g>-rank<r>.jsonl): {"step": s, "ids": [...]} per
    optimizer step of this rank.

    Appended line by line; a kill can leave a torn last line or steps that a resume replays. Readers keep
    the last record of each step up to the step of the checkpoint the run finished from."""

    def __init__(self, log_dir: Path, rank: int, tag: str = ""):
        log_dir.mkdir(parents=True, exist_ok=True)
        self.file = open(log_dir / f"samples-{tag}rank{rank}.jsonl", "a", buffering=1)

    def write(self, step: int, ids: list[int]) -> None:
        self.file.write(json.dumps({"step": step, "ids": ids}) + "\n")

    def close(self) -> None:
        self.file.close()


def read_sample_log(path: Path) -> dict[int, list[int]]:
    """step -> ids, the last complete record of each step (torn lines skipped)."""
    out: dict[int, list[int]] = {}
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        out[int(rec["step"])] = list(rec["ids"])
    return out


# -- fault injection (test hooks) ------------------------------------------------------------------
class FaultInjector:
    """Reads the LLMCLUSTER_INJECT_* hooks once; a no-op when none is set or LLMCLUSTER_TESTING is not 1."""

    def __init__(self, rank: int, environ=os.environ):
        self.nan_steps = hook_steps(test_hook("LLMCLUSTER_INJECT_NAN_AT_STEP", environ))
        self.spike_steps = hook_steps(test_hook("LLMCLUSTER_INJECT_SPIKE_AT_STEP", environ))
        self.sleeps = per_rank(test_hook("LLMCLUSTER_INJECT_SLEEP", environ), rank)
        self.sleep_until = test_hook("LLMCLUSTER_INJECT_SLEEP_UNTIL", environ)
        self.busy = per_rank(test_hook("LLMCLUSTER_INJECT_BUSY", environ), rank)

    def loss_factor(self, step: int) -> float | None:
        """What to multiply this step's loss by, or None to leave it alone (bitwise)."""
        if step in self.nan_steps:
            return float("nan")
        return 10.0 if step in self.spike_steps else None

    def maybe_sleep(self, step: int) -> None:
        if self.sleep_until and os.path.exists(self.sleep_until):
            return
        for seconds, steps in self.sleeps:
            if steps is None or step in steps:
                time.sleep(seconds)

    def busy_time(self, step: int, measured: float) -> float:
        """The compute time this rank reports for `step`: the measured one unless the test clock says."""
        for seconds, steps in self.busy:
            if steps is None or step in steps:
                return seconds
        return measured


class BusyTimer:
    """This rank's own compute time in a step, the straggler signal. On CUDA the host returns from launching
    kernels long before the device runs them, so host time measures Python: two CUDA events bracket the work
    on the stream and are read after the step's sync (the loss to the host), costing no extra sync. On CPU
    the host time is the work.

        timer.start()          # step start
        timer.stop()           # end of this rank's own work (before its first gradient collective)
        ...loss.tolist()...    # the step's sync (loss and grad norm to the host)
        busy_s = timer.seconds()
    """

    def __init__(self, device, clock=time.perf_counter):
        self.cuda, self.clock = getattr(device, "type", "cpu") == "cuda", clock
        self._t0 = self._host = 0.0
        self._begin = self._end = None

    def _event(self):
        import torch   # only on CUDA: this module is imported where torch may not be
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def start(self) -> None:
        self._t0 = self.clock()
        self._begin = self._event() if self.cuda else None

    def stop(self) -> None:
        self._host = self.clock() - self._t0
        self._end = self._event() if self.cuda else None

    def seconds(self) -> float:
        if self._end is None:
            return self._host
        self._end.synchronize()   # already complete after the step's sync: a no-op that makes the read safe
        return self._begin.elapsed_time(self._end) / 1e3      # ms -> s


def young_daly_steps(save_s: float, mtbf_s: float, step_s: float) -> tuple[float, int]:
    """(sqrt(2·C·M) seconds, that interval in whole steps of `step_s`, at least 1): Young/Daly's optimum."""
    optimum_s = math.sqrt(2 * save_s * mtbf_s)
    return optimum_s, max(1, round(optimum_s / max(step_s, 1e-9)))


def note_stragglers(times: list[float], factor: float, metrics, log) -> None:
    """Name the ranks whose compute time is over the median x `factor` (log.straggler_factor)."""
    if len(times) < 2:
        return
    med, slow = slow_ranks(times, factor)
    metrics.straggler(slow[0] if slow else None)
    for r in slow:
        log(f"warning: straggler: rank {r} compute time {times[r]:.3f}s vs median {med:.3f}s")
