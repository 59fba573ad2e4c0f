"""`llmcluster_train_*` metrics of one training process, served over HTTP for Prometheus.

The trainer calls `TrainMetrics(run, rank, port)` once and then `step(...)` every logged step. Every rank
may serve its own port (its step time and loss); rank 0 also publishes what only it knows after the
all-gather of step times: every rank's step time, and which rank is the straggler.

Each instance owns its own CollectorRegistry, so two instances in one process (tests, a restarted run)
never collide in prometheus_client's global registry, and the process's own python_* / process_* metrics
are not mixed in. `port=None` keeps everything in memory and serves nothing: the trainer can call the
methods unconditionally.

No torch import here: the monitor must import on a head node without the GPU stack.
"""

from __future__ import annotations

import math
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

from llmcluster.errors import UserError

PREFIX = "llmcluster_train_"


class TrainMetrics:
    def __init__(self, run: str, rank: int, port: int | None, bind: str = "127.0.0.1"):
        self.run, self.rank = run, int(rank)
        self.registry = CollectorRegistry(auto_describe=True)
        labels = ("run", "rank")

        def gauge(name: str, doc: str, labelnames=labels):
            return Gauge(PREFIX + name, doc, labelnames, registry=self.registry)

        self._step = gauge("step", "Last completed optimizer step.")
        self._loss = gauge("loss", "Training loss of the last logged step (NaN if it was not finite).")
        self._lr = gauge("learning_rate", "Learning rate of the last logged step.")
        self._tps = gauge("tokens_per_second", "Training throughput of the whole job (all ranks), tokens/s.")
        self._mfu = gauge("mfu", "Model FLOPs utilization of the last logged step, as a fraction of peak.")
        self._step_time = gauge("step_time_seconds", "Wall time of the last optimizer step of this rank.")
        self._last_step_ts = gauge(
            "last_step_timestamp_seconds",
            "Unix time of the last completed step (the process start until the first one): a stall detector.")
        self._start_ts = gauge("start_timestamp_seconds", "Unix time this training process started.")
        self._ckpt_step = gauge("checkpoint_step", "Step of the last completed checkpoint.")
        self._ckpt_duration = gauge("checkpoint_duration_seconds", "Time the last checkpoint took to save.")
        self._ckpt_age = gauge("checkpoint_age_seconds",
                               "Seconds since the last checkpoint completed (computed at scrape time).")
        self._ckpt_interval = gauge(
            "checkpoint_interval_seconds", "Seconds between the last two completed checkpoints.")
        self._bad_steps = Counter(PREFIX + "bad_steps", "Steps skipped because the loss or gradients "
                                  "were non-finite or the loss spiked.", labels, registry=self.registry)
        self._straggler = gauge("straggler_rank", "Rank whose step time exceeds the median by the "
                                "configured factor, or -1 when there is none.")
        self._ft_groups = gauge("ft_groups", "ft: replica groups in the last quorum (torchft); fewer than the "
                                "run's replica groups while one is down or healing.")
        self._rank_step_time = gauge("rank_step_time_seconds",
                                     "Step time of each rank (published by rank 0; label rank = that rank).")
        me = {"run": self.run, "rank": str(self.rank)}
        now = time.time()
        self._start_ts.labels(**me).set(now)
        self._last_step_ts.labels(**me).set(now)
        self._bad_steps.labels(**me)            # exported as 0 from the start: increase() needs a baseline
        self._straggler.labels(**me).set(-1)
        self._me = me
        self._last_ckpt_finished: float | None = None

        self.port: int | None = None
        self._server = None
        if port is not None:
            try:
                self._server, _thread = start_http_server(int(port), addr=bind, registry=self.registry)
            except OSError as e:
                raise UserError(f"cannot serve training metrics on {bind}:{port}: {e.strerror or e}") from None
            self.port = self._server.server_address[1]

    # -- every logged step --------------------------------------------------------------------
    def step(self, step: int, loss: float, lr: float, tokens_per_s: float, mfu: float,
             step_time_s: float) -> None:
        me = self._me
        self._step.labels(**me).set(step)
        self._loss.labels(**me).set(float(loss) if math.isfinite(loss) else math.nan)
        self._lr.labels(**me).set(lr)
        self._tps.labels(**me).set(tokens_per_s)
        self._mfu.labels(**me).set(mfu)
        self._step_time.labels(**me).set(step_time_s)
        self._last_step_ts.labels(**me).set(time.time())

    def rank_step_times(self, times_s: list[float]) -> None:
        """Rank 0 only: the all-gathered step time of every rank."""
        for r, t in enumerate(times_s):
            self._rank_step_time.labels(run=self.run, rank=str(r)).set(t)

    # -- events -------------------------------------------------------------------------------
    def checkpoint(self, step: int, duration_s: float, finished_at: float) -> None:
        me = self._me
        self._ckpt_step.labels(**me).set(step)
        self._ckpt_duration.labels(**me).set(duration_s)
        if self._last_ckpt_finished is not None:
            self._ckpt_interval.labels(**me).set(max(0.0, finished_at - self._last_ckpt_finished))
        self._last_ckpt_finished = finished_at
        # The age must keep growing between scrapes while no checkpoint happens: compute it on scrape.
        self._ckpt_age.labels(**me).set_function(lambda: max(0.0, time.time() - finished_at))

    def bad_step(self) -> None:
        self._bad_steps.labels(**self._me).inc()

    def ft_groups(self, groups: int) -> None:
        self._ft_groups.labels(**self._me).set(groups)

    def straggler(self, rank: int | None) -> None:
        self._straggler.labels(**self._me).set(-1 if rank is None or rank < 0 else rank)

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
