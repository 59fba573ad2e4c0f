"""The training loop: one process, or every rank of a torchrun / Slurm job.

    build model (seeded, identical on every rank) → parallelize → optimizer + schedule → resume
    → for each step: micro-batches from the sampler → forward/backward (autocast) → clip → step
    → at the step boundary the evaluator, the metrics processor and the checkpointer, each on its own
      cadence → preemption check.

Rank 0 records the run's lifecycle in logs/<run>/events.jsonl (storage/events.py) for `jobs goodput`.
"""

from __future__ import annotations

import collections
import contextlib
import math
import os
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

from llmcluster.config.load import saved_config_dict
from llmcluster.config.schema import JobConfig
from llmcluster.data.dataset import META, data_sources, open_training_data
from llmcluster.data.prefetch import Prefetcher
from llmcluster.errors import EXIT_FT_DROPPED, EXIT_FT_NO_QUORUM, EXIT_PREEMPTED, UserError
from llmcluster.model import flops_per_token, param_count
from llmcluster.model.llama import cross_entropy_sum
from llmcluster.config.cluster_load import storage_root
from llmcluster.storage.layout import Storage, sha256_file
from llmcluster.distributed import process_groups as D
from llmcluster.train.attention import attention_line
from llmcluster.train.batch import resume_batch
from llmcluster.checkpoint.checkpointer import Checkpointer
from llmcluster.checkpoint.fingerprint import checked_state, dataset_digest, run_fingerprint
from llmcluster.checkpoint.nf4_base import NF4_WEIGHTS, nf4_names
from llmcluster.train.downstream import Downstream, pending_steps
from llmcluster.train.gc_cadence import GarbageCollection
from llmcluster.train.hf_import import load_hf_weights, resolve_model_config
from llmcluster.train.health import (BusyTimer, CollectiveFailure, FaultInjector, LossSpikeDetector, SampleLog,
                                     is_collective_error, young_daly_steps)
from llmcluster.train.evaluate import Evaluator
from llmcluster.ft import group as ft
from llmcluster.ft.quorum import RunFinished, StopAsked
from llmcluster.storage.events import EventLog
from llmcluster.monitor.energy import EnergyMeter
from llmcluster.train.metrics import device_peak_flops, peak_note, record_step
from llmcluster.train.optimizer import build_optimizer, build_scheduler
from llmcluster.train.parallelize import build_parallel_model, clip_grad_norm, step_context
from llmcluster.train.resources import require_fit
from llmcluster.train.pipeline import bubble_note, build_pipeline, grad_scaler
from llmcluster.storage import exit_reason
from llmcluster.train.signals import PreemptionFlag
from llmcluster.monitor.tracking import MetricsProcessor, run_info


class BadStepLimit(UserError):
    pass


class Trainer:
    def __init__(self, cfg: JobConfig, root: Path, resume: str = "auto", foreign_ok: bool = False):
        resolve_model_config(cfg, root)  # train.init_from's config.json; vocab_size from the tokenizer
        self.cfg = cfg
        self.storage = Storage(root)
        world = int(os.environ.get("WORLD_SIZE", 1))
        self.dims = D.ParallelDims.from_config(ft.group_config(cfg), world)  # ft: the group's own world
        self.env = D.init_distributed(cfg, need_group=self.dims.needs_group)
        env, dims = self.env, self.dims
        env.writer = ft.is_writer(cfg)   # ft: one group writes checkpoints, events and metrics
        self.notes: list[str] = []  # said once the run starts (after every input check passed)
        if not D.native_low_precision(env.device, cfg.train.precision):   # said once, with the reason
            self.notes.append("precision " + D.precision_note(env.device, cfg.train.precision))
            cfg.train.precision = "fp32"
        self.dp_rank, self.dp_size = ft.data_shard(cfg, dims.dp_rank(env.rank), dims.dp)
        t = cfg.train
        self.global_batch = t.global_batch or t.micro_batch * t.grad_accum * self.dp_size
        if self.global_batch != t.micro_batch * t.grad_accum * self.dp_size:
            raise UserError(
                f"train.global_batch ({self.global_batch}) must equal train.micro_batch ({t.micro_batch}) × "
                f"train.grad_accum ({t.grad_accum}) × data-parallel degree ({self.dp_size})")
        if cfg.data.seq_len > cfg.model.max_seq_len:
            raise UserError("data.seq_len exceeds model.max_seq_len")
        # Before any allocation or run folder: a job that cannot fit is one line, not an OOM per rank.
        self.notes += require_fit(cfg, dims, env.device, env.local_world_size)
        # Storage and data first: bad input fails before any expensive work; the run's folders are removed again
        fresh = self.storage.require_run_dirs(cfg.run.name)  # by rank 0 (if still empty) when refused
        self.metrics = None
        # One writer per run, decided before anything expensive: a second one is refused within seconds.
        self.ckpt = ft.checkpointer(cfg, Checkpointer(self.storage, cfg.run.name, env.rank, env.world_size,
                                 cfg.checkpoint.keep_last, cfg.checkpoint.keep_every, log=self.log,
                                 lock_stale_s=cfg.checkpoint.lock_stale_s, dist_timeout_s=cfg.dist.timeout_s))
        env.writer = self.ckpt.claim()   # ft: False in a group that reads (ft/writer.py)
        self.events = EventLog(self.storage.run_logs(cfg.run.name), env.is_main)
        try:
            self._build(resume, foreign_ok)
        except BaseException as e:
            self.ckpt.close()
            # refused: no trace in a new run, a no-op start in an existing one (not an attempt for goodput)
            self.events.discard(str(e)) if isinstance(e, UserError) else self.events.close()
            # rank 0 only: another rank, refused first, removed logs/<run> as rank 0 opened events.jsonl in it
            self.storage.remove_if_empty(fresh if env.is_main else [])
            raise

    def _build(self, resume: str, foreign_ok: bool) -> None:
        cfg, env, dims, root, t = self.cfg, self.env, self.dims, self.storage.root, self.cfg.train
        path = self.ckpt.find_resume(resume, foreign_ok)
        self.dataset, sampler = open_training_data(root, cfg.data, cfg.run.seed, verify=env.is_main,
                                                   max_vocab=cfg.model.vocab_size)
        self.sampler = Prefetcher(sampler)  # steps gathered ahead on a thread; position as trained
        # What the run trains on, so that a resume over a rebuilt dataset is refused: meta.json's digest (for a
        # mixture, the digest of every source's, in order).
        self.dataset_digest = dataset_digest([sha256_file(d / META) for _, d, _ in data_sources(root, cfg.data)])
        self.fingerprint = run_fingerprint(cfg, sha256_file(data_sources(root, cfg.data)[0][1] / "tokenizer.json")[:16])
        if path is not None:  # the one check before any weight is loaded; the global batch before the model and PP
            saved, notes = checked_state(path, self.fingerprint, self.storage, cfg.run.name)
            self.notes += notes   # a start from another run's checkpoint, a resharded layout
            self._keep_global_batch(saved)

        # Same seed on every rank: identical initial weights without a broadcast, whatever the mesh.
        torch.manual_seed(cfg.run.seed)
        self.pipe = None
        if dims.pp > 1:
            self.pipe = build_pipeline(cfg, dims, env, cfg.run.seed, self._pp_loss)
            self.model = self.raw_model = self.pipe.model  # this rank's part, with the full model's names
        else:
            self.model, self.raw_model = build_parallel_model(cfg, dims, env, cfg.run.seed)
        self.loss_ctx = step_context(dims, env.device)  # TP's loss_parallel, SDPA's order: fwd and bwd
        self.optimizer = build_optimizer(self.model, t, env.device)
        self.scheduler = build_scheduler(self.optimizer, t)
        self.scaler = grad_scaler(env.device, t.precision == "fp16", self.pipe)
        self.step = self.bad_in_row = self.bad_total = 0
        self.resumed_from = None
        self.spikes = LossSpikeDetector(t.spike_window, t.spike_zscore)
        self.inject = FaultInjector(env.rank)
        self.busy_timer = BusyTimer(env.device)   # straggler signal: device time on CUDA, host time on CPU
        self.ckpt.every = cfg.checkpoint.interval_steps  # interval=auto retunes it after each checkpoint
        self.ft_skipped = 0   # ft: samples of shards whose groups were not in a committed step (never trained)
        self.sample_log = SampleLog(self.storage.run_logs(cfg.run.name), env.rank, ft.sample_log_tag(cfg)) \
            if cfg.log.sample_log else None
        self.ckpt.skip_frozen = bool(t.lora and t.lora.base_precision == "nf4")  # base: from init_from again
        if t.init_from and (path is None or self.ckpt.skip_frozen):  # else the checkpoint's weights supersede
            load_hf_weights(self.raw_model, Path(t.init_from))
        if path is not None:
            self.events.emit("restore_start")
            state = self.ckpt.load(path, self.model, self.optimizer)
            self._check_dataset(path, state.get("dataset_digest"))
            self.step = int(state["step"])
            self.sampler.load_state_dict(state["sampler"])
            self.scheduler.load_state_dict(state["scheduler"])
            if "scaler" in state and t.precision == "fp16":
                self.scaler.load_state_dict(state["scaler"])
            self.bad_total = int(state.get("bad_steps", 0))
            self.ft_skipped = int(state.get("ft_skipped_samples", 0))
            self.spikes.load_state_dict(state.get("loss_window"))
            self.resumed_from = path
            self.events.emit("restore_end", self.step)
        self.ckpt.prepare_start(resume, path, self.step)
        self.flops_per_token = flops_per_token(cfg.model, cfg.data.seq_len)
        self.peak_flops, self.peak_source = device_peak_flops(env.device, t.precision)
        self.device_name = torch.cuda.get_device_name(env.device) if env.device.type == "cuda" else env.device.type
        # every GPU rank measures its GPU's energy (NVML) for the run's records (storage/energy.py, issue 67)
        self.energy = EnergyMeter(self.storage.run_logs(cfg.run.name), env.rank, str(
            torch.cuda.get_device_properties(env.device).uuid) if env.device.type == "cuda" else None)
        self.preempt = PreemptionFlag().install()
        self.evaluator = Evaluator(cfg, env, dims, self.model, self.pipe, self.autocast, self.dataset, sampler,
                                   self.events)
        self.metrics = MetricsProcessor(cfg, root, self.storage.run_logs(cfg.run.name), env.rank,
                                        ft.port_slot(cfg, env.local_rank, env.local_world_size),
                                        self.step, env.is_main)
        if env.is_main:
            self.metrics.start(run_info(cfg, root, self.dataset_digest, env.device))
        self.downstream = Downstream(cfg, root, self.storage.run_logs(cfg.run.name), env.is_main, self.log)
        self.ckpt.protected = lambda: pending_steps(self.storage.run_logs(cfg.run.name)) if cfg.eval else set()
        self.ft = ft.Replica(self) if cfg.ft.enabled else None   # after everything a healing peer copies
        self.events.emit("init_done", self.step)

    # -- helpers -----------------------------------------------------------------------------------
    def log(self, text: str) -> None:
        if self.env.rank == 0:   # a group's rank 0 (ft): the writer's lines, and the other groups' own
            self.metrics.message(text) if getattr(self, "metrics", None) else print(text, flush=True)

    def _keep_global_batch(self, state: dict) -> None:
        """Resuming at another data-parallel degree: the checkpoint's global batch, by accumulation (batch.py)."""
        t = self.cfg.train
        accum, self.global_batch, line = resume_batch(state, t, self.dp_size, self.env.world_size)
        if line:
            self.notes.append(line)
        if accum != t.grad_accum:
            t.grad_accum = accum
            D.ParallelDims.from_config(self.cfg, self.env.world_size)  # PP's schedule rules on grad_accum

    def _check_dataset(self, path: Path, digest: str | None) -> None:
        """Resuming over a dataset rebuilt under the same name would continue the sampler's position in
        different data: refused unless asked for."""
        if digest is None or digest == self.dataset_digest or self.cfg.checkpoint.allow_dataset_change:
            return
        raise UserError(f"dataset {self.cfg.data.dataset} changed since {path} was written ({META} sha256 "
                        f"{digest[:12]} then, {self.dataset_digest[:12]} now): resume with the dataset it was "
                        "trained on, or set checkpoint.allow_dataset_change=true")

    def autocast(self):
        p = self.cfg.train.precision
        if p == "fp32" or (self.dims.fsdp and self.env.device.type == "cuda"):
            return contextlib.nullcontext()  # FSDP's MixedPrecisionPolicy casts on GPU
        return torch.autocast(self.env.device.type, dtype=torch.bfloat16 if p == "bf16" else torch.float16)

    def _mean_over_ranks(self, t: torch.Tensor) -> torch.Tensor:
        """Mean over the ranks that computed a loss: all of them, or with PP those of the last stage (the
        others contribute zeros)."""
        if self.env.distributed:
            dist.all_reduce(t)
            t /= self.env.world_size // self.dims.pp
        return t

    def _loss(self, loss_sum: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        # Mean over trained targets (chat data marks the rest -100); a micro-batch with none gives 0.
        loss = loss_sum / (y != -100).sum().clamp(min=1)
        if self.inject.loss_factor(self.step + 1) is not None:  # test hook (health.py)
            loss = loss * self.inject.loss_factor(self.step + 1)
        return loss

    def _pp_loss(self, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        # Training: the schedule runs backward on the micro-batch's share, fp16-scaled (`unscale_` needs that)
        loss = self._loss(cross_entropy_sum(logits, y), y)
        return self.scaler.scale(loss / self.cfg.train.grad_accum) if self.model.training else loss

    def train_state(self) -> dict:
        return {"sampler": self.sampler.state_dict(), "scheduler": self.scheduler.state_dict(),
                "scaler": self.scaler.state_dict() if self.scaler.is_enabled() else None,
                "bad_steps": self.bad_total, "loss_window": self.spikes.state_dict(),
                "ft_skipped_samples": self.ft_skipped,
                "config": saved_config_dict(self.cfg), "dataset_digest": self.dataset_digest,  # job.env redacted
                "parallel": self.dims.describe(), "global_batch": self.global_batch, "fingerprint": self.fingerprint,
                "device": self.device_name,   # what the model card's energy estimate prices (export/card.py)
                NF4_WEIGHTS: nf4_names(self.raw_model)}   # the export rebuilds an NF4 base from init_from with it

    # -- one optimizer step ------------------------------------------------------------------------
    def train_step(self) -> tuple[float, float, bool]:
        """Returns (global mean loss, grad norm, applied)."""
        cfg, model = self.cfg, self.model
        accum = cfg.train.grad_accum
        if self.ft:   # the quorum; a group behind it heals here
            self.ft.start_step()
        self.optimizer.zero_grad(set_to_none=True)
        loss_sum = torch.zeros((), device=self.env.device, dtype=torch.float32)
        self.busy_timer.start()
        self.inject.maybe_sleep(self.step + 1)
        sample_ids: list[int] = []
        batches = self.sampler.micro_batches(self.global_batch, self.dp_rank, self.dp_size, cfg.train.micro_batch)
        if self.pipe is not None:  # the schedule runs all micro-batches (forward, backward, reductions)
            loss_sum, sample_ids = self._pipeline_step(list(batches))
            batches = []
        for i, (ids, x, y) in enumerate(batches):
            x, y = x.to(self.env.device, non_blocking=True), y.to(self.env.device, non_blocking=True)
            last = i == accum - 1
            # DDP: all-reduce gradients once per optimizer step, not per micro-batch.
            sync = model.no_sync() if self.dims.ddp and not last else contextlib.nullcontext()
            with sync, self.loss_ctx():
                with self.autocast():
                    loss = self._loss(model(x, y, cfg.train.loss_chunks), y)
                if last:  # this rank's own work up to its first gradient all-reduce (DDP): straggler signal
                    self.busy_timer.stop()
                self.scaler.scale(loss / accum).backward()
            loss_sum += loss.detach()
            sample_ids += ids.tolist()
        if self.sample_log:
            self.sample_log.write(self.step + 1, sample_ids)
        loss = self._mean_over_ranks(loss_sum / accum)
        if self.ft:   # across the replica groups in the quorum (with each group's compute time: stragglers)
            loss = self.ft.average(model, loss, lambda: self.inject.busy_time(self.step + 1, self.busy_timer.seconds()))
        self.scaler.unscale_(self.optimizer)
        max_norm = cfg.train.grad_clip if cfg.train.grad_clip > 0 else float("inf")
        norm = clip_grad_norm(model.parameters(), max_norm, self.pipe.pp_group if self.pipe else None)
        loss_v, norm_v = torch.stack([loss.float(), norm.float()]).tolist()  # the step's one host sync
        self.busy_s = self.inject.busy_time(self.step + 1, self.busy_timer.seconds())   # read after the sync
        self.lr_used = self.optimizer.param_groups[0]["lr"]
        finite = math.isfinite(loss_v) and (math.isfinite(norm_v) or self.scaler.is_enabled())
        commit = self.ft.should_commit() if self.ft else True   # every group's decision, every step
        z = self.spikes.score(loss_v)
        spike_skip = commit and self.spikes.is_spike(z) and cfg.train.skip_spikes
        if commit:   # ft: an attempt that was not committed did not happen: its loss stays out of the window
            self.spikes.update(loss_v)
            if self.spikes.is_spike(z):
                self.log(f"warning: step {self.step + 1}: loss spike {loss_v:.4f} (z-score {z:.1f} over the last "
                         f"{cfg.train.spike_window} steps){': update skipped' if spike_skip else ''}")
        if finite and not spike_skip and commit:
            self.scaler.step(self.optimizer)  # fp16: skips by itself on inf gradients
        else:
            self.optimizer.zero_grad(set_to_none=True)
        # fp16: roll the scaler forward on skipped steps too. `unscale_` above ran on every step, and torch refuses
        # the next step's `unscale_` until an update() (a NaN's inf gradients back the scale off, like an overflow)
        self.scaler.update()
        if commit:   # ft: a step not committed did not happen (its batch is drawn again)
            self.scheduler.step()
        return loss_v, norm_v, finite

    def _pipeline_step(self, batches: list) -> tuple[torch.Tensor, list[int]]:
        """The rank's grad_accum micro-batches as one batch through the schedule: forward, backward and the
        gradient reduce-scatters of every stage. Returns (sum of micro-batch losses, sample ids); the loss
        is 0 on ranks without the last stage (`_mean_over_ranks` divides accordingly)."""
        ids = [i for b in batches for i in b[0].tolist()]
        x = torch.cat([b[1] for b in batches]).to(self.env.device)
        y = torch.cat([b[2] for b in batches]).to(self.env.device)
        with self.autocast():
            losses = self.pipe.step(x, y)
        unscale = self.cfg.train.grad_accum / self.scaler.get_scale()  # each was loss / m × scale
        # forward + backward of all micro-batches (incl. the bubble)
        self.busy_timer.stop()
        total = torch.zeros((), device=self.env.device, dtype=torch.float32)
        for loss in losses:
            total += loss.detach().float() * unscale
        return total, ids

    def evaluate(self) -> float:
        return self.evaluator(self.step)["val_loss"]

    # -- the loop ----------------------------------------------------------------------------------
    def fit(self) -> int:
        try:
            with GarbageCollection(self.cfg.train.gc_interval) as self.gc:  # at the same steps on every rank
                return self._fit()
        except RunFinished as e:   # an ft group back after the run ended (ft/quorum.py)
            self.log(str(e))
            return 0
        except StopAsked:          # a stop signal while an ft group waited for its quorum
            return self._preempted(False)
        except Exception as e:  # a hung (dist.timeout_s) or dead peer: one line naming step and rank
            if self.env.distributed and is_collective_error(e):
                raise CollectiveFailure(self.step, self.env.rank, self.cfg.dist.timeout_s, e) from None
            raise

    def _fit(self) -> int:
        cfg, t = self.cfg, self.cfg.train
        last_step = t.last_step
        if self.step >= last_step:
            self.log(f"run {cfg.run.name}: already at step {self.step} of {last_step}; nothing to do")
            self.events.noop(f"already at step {self.step} of {last_step}; nothing to do")
            return 0
        self._announce()
        self.model.train()
        if self.ft:   # a group that makes no progress leaves (ft/watchdog.py)
            self.ft.watchdog.start()
        while self.step < last_step:
            t0 = time.perf_counter()
            self.gc.step(self.step + 1)
            loss, norm, applied = self.train_step()
            if self.ft and not self.ft.committed:   # not applied: the same batch again (ft/group.py), unless told to stop
                if D.all_reduce_max(1.0 if self.preempt.set else 0.0, self.env) > 0:
                    return self._preempted(False)
                continue
            self.step += 1
            if self.ft:
                self.ft.watchdog.committed(self.step)
            self._time_step(time.perf_counter() - t0)
            self._check_bad_step(loss, norm, applied)
            final = self.step == last_step
            with self._suspended():   # an evaluation and a checkpoint have deadlines of their own
                val = self.evaluator(self.step) if self.evaluator.due(self.step) else {}
                if self.metrics.due(self.step) or val or final:
                    self._record(loss, norm, val)
                saved = self._checkpoint(final)
            # One agreement per step: 2 = rank 0 lost the owner lock (stop, write nothing), 1 = a stop signal.
            stop = D.all_reduce_max(2.0 if self.ckpt.heartbeat() else 1.0 if self.preempt.set else 0.0, self.env)
            if stop >= 2:
                raise self.ckpt.lost_error()
            if stop > 0 or (self.ft and self.ft.leaving):   # ft: dropped as a straggler (ft.py), started again later
                return self._preempted(saved) if stop > 0 else EXIT_FT_DROPPED
        if self.ft:   # the writer records the run's end for every group still to come (ft/quorum.py)
            self.ft.watchdog.stop()
            self.ft.record_end()
        self.log(f"run {cfg.run.name}: finished step {self.step}; checkpoints in "
                 f"{self.storage.run_checkpoints(cfg.run.name)}")
        return 0

    def _announce(self) -> None:
        cfg, t = self.cfg, self.cfg.train
        for note in self.notes:
            self.log(note)
        if self.resumed_from:
            self.log(f"resumed from {self.resumed_from} (step {self.step})")
        self.log(f"run {cfg.run.name}: {self.dims.describe()}, device {self.env.device}, {t.precision}, "
                 f"{param_count(cfg.model) / 1e6:.2f}M params, global batch {self.global_batch} × {cfg.data.seq_len} "
                 f"tokens; MFU vs {peak_note(self.peak_flops, self.peak_source)}{bubble_note(self.dims, self.cfg.train.grad_accum)}")
        self.log(attention_line(cfg, self.env.device))   # the run's summary: after every refusal had its chance
        if self.step == 0:  # the baseline the validation curve is read against
            start = f"from {cfg.train.init_from}" if cfg.train.init_from else "untrained"   # a base is not untrained
            self.log(f"step 0 val {self.evaluate():.4f} ({start}; a uniform guess over the vocabulary "
                     f"scores {math.log(cfg.model.vocab_size):.4f})")
        self.step_times: list[float] = []   # since the last record (their median is reported)
        self.busy: list[float] = []
        self.recent_dt: collections.deque[float] = collections.deque(maxlen=20)   # interval=auto's step time

    def _suspended(self):
        """ft: the watchdog suspended (ft/watchdog.py); otherwise nothing."""
        return self.ft.watchdog.suspended() if self.ft else contextlib.nullcontext()

    def _time_step(self, dt: float) -> None:
        self.dt = dt
        self.step_times.append(dt)
        self.recent_dt.append(dt)
        self.busy.append(self.busy_s)
        self.events.heartbeat(self.step)   # a killed attempt's end, to within a step
        if len(self.recent_dt) == 1 and not self.metrics.due(self.step):   # else nothing on screen until a record
            self.log(f"first step took {dt:.1f} s" + (" (compiling: torch.compile builds the step's kernels once)"
                                                      if self.cfg.train.compile else ""))

    def _record(self, loss: float, norm: float, val: dict) -> None:
        record_step(self, loss, norm, val)

    def _checkpoint(self, final: bool) -> bool:
        """The checkpointer's cadence (checkpoint.interval_steps, retuned by interval=auto); True if saved."""
        if final or self.step % self.ckpt.every == 0:
            self.save(async_=self.cfg.checkpoint.async_save and not final)
            if self.cfg.checkpoint.interval == "auto":
                self._auto_interval(statistics.median(self.recent_dt))
            return True
        if self.ckpt.pending:
            self._log_saved(self.ckpt.poll())
        return False

    def save(self, deadline: float | None = None, async_: bool = False) -> Path | None:
        self._log_saved(self.ckpt.wait_pending())
        self.events.emit("save_start", self.step, ckpt=self.step)
        path = self.ckpt.save(self.step, self.model, self.optimizer, self.train_state(), deadline, async_)
        self.events.emit("save_end", self.step, ckpt=self.step, ok=path is not None or async_)
        if async_:
            self.log(f"checkpoint step_{self.step}: writing in the background "
                     f"(training blocked {self.ckpt.last_save_s:.2f} s)")
        self._log_saved(path)
        return path

    def _log_saved(self, path: Path | None) -> None:
        if path is None:
            return
        step = int(path.name.rsplit("_", 1)[-1])
        self.events.emit("checkpointed", self.step, ckpt=step)
        self.energy.record(self.events.attempt)
        self.downstream.checkpointed(step, final=step == self.cfg.train.steps)
        self.metrics.checkpoint(self.step, self.ckpt.last_save_s or 0.0)
        self.log(f"checkpoint {path} ({self.ckpt.last_write_s:.2f} s)")

    def _preempted(self, saved: bool) -> int:
        """Every rank agreed on the stop flag: checkpoint within the grace period, exit for requeue."""
        deadline = (self.preempt.at or time.time()) + self.cfg.checkpoint.grace_period_s
        if self.ft:   # a stop's checkpoint is bounded by checkpoint.grace_period_s
            self.ft.watchdog.stop()
        self._log_saved(self.ckpt.wait_pending())
        if not saved and self.save(deadline=deadline) is None:
            self.log(f"preempted at step {self.step}: no checkpoint within checkpoint.grace_period_s="
                     f"{self.cfg.checkpoint.grace_period_s:g}; the run resumes from the previous one; "
                     f"exiting {EXIT_PREEMPTED} (requeue)")
            return EXIT_PREEMPTED
        self.log(f"preempted at step {self.step}: checkpoint written, exiting {EXIT_PREEMPTED} (requeue)")
        return EXIT_PREEMPTED

    def _auto_interval(self, step_s: float) -> None:
        """Young/Daly: checkpoint every sqrt(2·C·M) seconds, C the measured save time, M the job's MTBF.
        Rank 0 decides (ranks measure slightly different times; they must agree on the steps)."""
        c, m = self.ckpt.last_save_s or 0.0, self.cfg.checkpoint.mtbf_hours * 3600
        optimum_s, steps = young_daly_steps(c, m, step_s)
        steps = int(D.all_reduce_max(float(steps) if self.env.is_main else 0.0, self.env))
        if steps != self.ckpt.every:
            self.log(f"checkpoint interval auto: sqrt(2 × C {c:.3f} s × MTBF {m:.4g} s) = {optimum_s:.3f} s "
                     f"= every {steps} steps of {step_s:.4f} s")
            self.ckpt.every = steps

    def _check_bad_step(self, loss: float, norm: float, applied: bool) -> None:
        if applied:
            self.bad_in_row = 0
            return
        self.bad_in_row += 1
        self.bad_total += 1
        self.metrics.bad_step()
        self.log(f"warning: step {self.step}: non-finite loss {loss} or grad norm {norm}: update skipped "
                 f"({self.bad_in_row} in a row)")
        if self.bad_in_row >= self.cfg.train.max_bad_steps:
            raise BadStepLimit(f"stopping: {self.bad_in_row} non-finite steps in a row at step {self.step} "
                               f"(train.max_bad_steps={self.cfg.train.max_bad_steps}); lower train.lr or check "
                               "the data; the last good checkpoint is intact")

    def close(self, reason: str | None = None, detail: str = "") -> None:
        """`reason`: how the attempt ended (exit_reason's words), recorded as its last event; `detail`: a
        refusal's message."""
        self.preempt.uninstall()
        if getattr(self, "ft", None):
            self.ft.shutdown(reason)
        self.sampler.close()
        self.ckpt.close()
        if self.sample_log:
            self.sample_log.close()
        self.metrics.status = {"completed": "FINISHED", "preempted": "PREEMPTED"}.get(reason, "FAILED")
        self.metrics.close()
        if getattr(self, "energy", None):
            self.energy.record(self.events.attempt)
        self.events.close(reason, detail)


def train_cli(args, cfg: JobConfig) -> int:   # cfg: loaded from args by cli/train.py, before torch
    root = storage_root(args.root, cfg.run.storage)
    trainer, ok, reason, detail = None, False, "failed", ""
    try:
        trainer = Trainer(cfg, root, resume=args.resume, foreign_ok=getattr(args, "init_from_checkpoint", False))
        code = trainer.fit()
        ok = True
        reason = {EXIT_PREEMPTED: "preempted", EXIT_FT_DROPPED: "dropped"}.get(code, "completed")
        exit_reason.write(reason)
        return code
    except CollectiveFailure as e:   # a peer died: a restart (or a requeue onto other nodes) may cure it
        exit_reason.write("failed", f"{type(e).__name__}: {e}")
        raise
    except UserError as e:      # bad config, the non-finite-step limit: a requeue would repeat it
        reason, detail = "fatal", str(e)
        exit_reason.write("fatal", str(e))
        raise
    except BaseException as e:  # NCCL timeout, a lost peer, ...: the launcher may requeue
        # ft: a group that gave up waiting for the others' quorum is not charged for it (launch/ft_local.py)
        word = "no_quorum" if getattr(e, "exit_code", None) == EXIT_FT_NO_QUORUM else "failed"
        exit_reason.write(word, f"{type(e).__name__}: {e}")
        raise
    finally:
        if trainer is not None:
            trainer.close(reason, detail)
        D.shutdown(barrier=ok)  # after a failure a peer may be gone: no barrier, which could hang or raise
