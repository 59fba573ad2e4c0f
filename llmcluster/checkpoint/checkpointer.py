"""Checkpoints: checkpoints/<run>/step_<N>/ written with torch.distributed.checkpoint (DCP), atomically,
by the run's one writer (checkpoint/ownership.py), verified before it is chosen (checkpoint/verify.py),
and loaded as data only (checkpoint/safe_load.py).

Protocol (every rank takes part; rank 0 does the renames; an error on any rank is agreed on by all, which
then stop with the same one line):
 1. write into checkpoints/<run>/.tmp-step_<N>-<attempt>/ (unique per attempt): DCP shards (model +
    optimizer, resharding-friendly), train_state.json (step, sampler, scheduler, config, dataset digest) and
    rng/rank_<r>.json;
 2. every rank hashes the files it wrote; rank 0 checks it still owns the run and renames the directory to
    step_<N>. An existing step_<N> that verifies is committed and final: it is kept, this write is discarded and
    the checkpointer writes no more (`set_aside`, the one place a step leaves its name); one that fails
    verification is moved aside (.abandoned-<time>/) first;
 3. rank 0 writes COMPLETE.json (sha256 of every file) last, through a temp file + rename + fsync, then
    prunes: only steps up to the one just written count, and that one is never deleted.
A directory without the marker, or whose files no longer match it, is never loaded. The marker proves a
complete write, not a trusted writer (whoever can write the checkpoint can rewrite it), so loading reads
data only: DCP's metadata through an exact allow-list of its classes, non-tensor entries and tensors through
`torch.load(weights_only=True)`; a checkpoint that asks for more is refused like a corrupt one.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

from llmcluster.errors import DISK_FULL, DiskFull, UserError, disk_full_line, is_disk_full
from llmcluster.storage.layout import ABANDONED_PREFIX, COMPLETE_MARKER, TMP_PREFIX, Storage, sha256_file
from llmcluster.testing import test_hook
from llmcluster.distributed import compat
from llmcluster.checkpoint.verify import (first_error as _first_error, gather_obj as _gather_obj,
                                                newest_verified_checkpoint, owner_rank, verify_checkpoint,
                                                verify_share)
from llmcluster.distributed.process_groups import control_group
from llmcluster.checkpoint.fingerprint import foreign_resume_error, is_own_checkpoint
from llmcluster.checkpoint.ownership import RunLock
from llmcluster.checkpoint.rng import rng_state, set_rng_state
from llmcluster.checkpoint.safe_load import TRAIN_STATE, UnsafeCheckpoint, load_state

CLAIM_POLL_S = 5.0  # rank 0 tells the other ranks this often how the owner lock's judgment stands
IO_ERROR_HOOK = "LLMCLUSTER_INJECT_IO_ERROR"  # test hook: rank:step[,...] fails that rank's part of that save

__all__ = ["TRAIN_STATE", "Checkpointer", "verify_checkpoint", "verify_share", "newest_verified_checkpoint",
           "load_model_weights"]


# -- helpers -------------------------------------------------------------------------------------
def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        pass


def _write_json_atomic(path: Path, obj) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _state_bytes(state) -> int:
    """Bytes of the tensors in a (nested) state dict: what a checkpoint of it needs on disk."""
    if isinstance(state, dict):
        return sum(_state_bytes(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return sum(_state_bytes(v) for v in state)
    if isinstance(state, torch.Tensor):
        local = state.to_local() if hasattr(state, "to_local") else state
        return local.numel() * local.element_size()
    return 0


def _find_exc(e: BaseException, cls):
    """The exception of type `cls` behind a failed save/load: DCP wraps each rank's in a CheckpointException."""
    from torch.distributed.checkpoint.api import CheckpointException  # lazy: DCP's import (~1.2 s), see save

    if isinstance(e, cls):
        return e
    if isinstance(e, CheckpointException):
        for failure in e.failures.values():
            inner = failure[0] if isinstance(failure, tuple) else getattr(failure, "exception", failure)
            if isinstance(inner, BaseException):
                found = _find_exc(inner, cls)
                if found is not None:
                    return found
    if e.__cause__ is not None:
        return _find_exc(e.__cause__, cls)
    return None


def _any_rank(flag: bool) -> bool:
    if not dist.is_initialized():
        return flag
    t = torch.tensor([1 if flag else 0], dtype=torch.int32)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=control_group())
    return bool(t.item())


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _broadcast_obj(obj, src: int = 0):
    if not dist.is_initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


class Checkpointer:
    def __init__(self, storage: Storage, run: str, rank: int, world_size: int, keep_last: int = 3,
                 keep_every: int | None = None, log=print, lock_stale_s: float = 600.0,
                 dist_timeout_s: float | None = None):
        self.storage, self.run, self.rank, self.world = storage, run, rank, world_size
        self.keep_last, self.keep_every, self.log = keep_last, keep_every, log
        self.protected = set   # () -> steps retention must keep (a pending downstream evaluation reads them)
        self.dir = storage.run_checkpoints(run)
        self.last_save_s: float | None = None   # time training was blocked by the last save (Young/Daly C)
        self.last_write_s: float | None = None  # start of the last save to its completion marker
        self.last_bytes: int | None = None
        self.pending = None                     # an async save in flight: (step, tmp dir, t0, future)
        self._staging = None                    # async saves' host buffers, made once (`staging`)
        self._group = None
        # A QLoRA run's frozen NF4 base is not saved: a resume quantizes train.init_from again (train/qlora.py)
        self.skip_frozen = False
        # The owner lock's hang watchdog: a healthy step's collectives each finish within dist.timeout_s.
        self.lock = RunLock(self.dir, run, lock_stale_s, log, 2 * dist_timeout_s if dist_timeout_s else None)
        self.claim_poll_s = min(CLAIM_POLL_S, (dist_timeout_s or CLAIM_POLL_S * 4) / 4)
        self.attempt = self.lock.attempt        # rank 0's, once claim() has run
        self.refused: str | None = None         # why this process writes no more: it found a committed step

    @property
    def staging(self):
        if self._staging is None:
            from llmcluster.checkpoint.staging import ReusedStaging  # lazy: it imports DCP (see save)
            self._staging = ReusedStaging()
        return self._staging

    # -- ownership ---------------------------------------------------------------------------------
    def claim(self, wait: bool = True) -> bool:
        """Collective: rank 0 takes the run's owner lock (or every rank refuses with its one line), then
        removes what dead attempts left behind (their .tmp-* directories) under it. Judging a holder that
        flock cannot vouch for takes up to checkpoint.lock_stale_s: rank 0 reports every CLAIM_POLL_S (at most
        a quarter of dist.timeout_s), so the other ranks' wait in the broadcast never reaches dist.timeout_s.
        `wait=False` (an ft group taking over mid-run): one look; False while the judgment needs more time."""
        done = False
        while not done:
            error, done = None, True
            if self.rank == 0:
                try:
                    done = self.lock.acquire(for_s=self.claim_poll_s if wait else 0.0)
                    for d in sorted(self.dir.glob(f"{TMP_PREFIX}*")) if done else []:
                        if d.is_dir():
                            shutil.rmtree(d, ignore_errors=True)
                            self.log(f"removed {d.name}: left by an attempt that did not finish")
                except UserError as e:
                    error = str(e)
                except OSError as e:
                    error = f"run {self.run}: cannot take the owner lock in {self.dir}: {e.strerror or e}"
            error, done, self.attempt = _broadcast_obj((error, done, self.lock.attempt))
            if error:
                raise UserError(error)
            if not wait:
                return done
        return True

    def heartbeat(self) -> bool:
        """At a step boundary (rank 0; no collective): refresh the lock. True if it is no longer ours: the
        trainer folds that into its per-step agreement and every rank raises `lost_error()`."""
        return self.rank == 0 and self.lock.heartbeat() is not None

    def lost_error(self) -> UserError:
        return UserError(self.lock.lost_message())

    def close(self) -> None:
        if self.rank == 0:
            self.lock.release()

    def set_aside(self, dirs: list[Path], rollback: bool = False) -> tuple[Path | None, list[Path]]:
        """The one place a step_<N> leaves its name (rank 0; docs/fault-tolerance.md, "Invariants" 1). A step that
        verifies is committed and final: a late group's retrained copy of it is another trajectory's weights, so
        only an operator's `--resume PATH` roll-back (`rollback`) moves one. The rest go to one .abandoned-<time>/.
        Returns (that folder or None, the steps kept because they verify)."""
        kept = [] if rollback else [d for d in dirs if verify_checkpoint(d) is None]
        move = [d for d in dirs if d not in kept]
        if not move:
            return None, kept
        stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime())
        aside = base = self.dir / f"{ABANDONED_PREFIX}{stamp}-{self.attempt[-6:]}"
        while any((aside / d.name).exists() for d in move):   # the same step set aside twice within a second
            aside = base.with_name(f"{base.name}.{len(list(self.dir.glob(base.name + '*')))}")
        aside.mkdir(parents=True, exist_ok=True)
        for d in move:
            os.rename(d, aside / d.name)
        _fsync_dir(self.dir)
        return aside, kept

    def prepare_start(self, resume: str, path: Path | None, start: int) -> None:
        """Collective, after find_resume: step directories above the start step are not this trajectory's.
        `--resume never`: complete ones are refused; `--resume PATH`: complete ones are set aside;
        `auto` starts from the newest verified one, so every one above it was skipped (a mismatch, an I/O
        error, no marker): set aside too, since retention counts only the steps it sees - left in place,
        a corrupt step_6 would count among `keep_last` and get the verified step_4 deleted. Set aside
        (`.abandoned-*`, never resumed or pruned) rather than deleted: the error may have been transient."""
        error = None
        if self.rank == 0:
            steps = self.storage.checkpoint_steps(self.run)
            higher = [(s, d) for s, d, ok in steps if s > start and (ok or resume == "auto")]
            if higher and resume == "never":
                error = (f"run {self.run} already has checkpoints up to step {higher[-1][0]}: choose another "
                         "run.name or --resume auto")
            elif higher:
                try:
                    aside, kept = self.set_aside([d for _s, d in higher], rollback=resume != "auto")
                    moved = [(s, d) for s, d in higher if d not in kept]
                    names = ", ".join(d.name for _s, d in moved)
                    if moved:
                        self.log((f"set aside {names} (failed verification) in {aside}" if resume == "auto" else
                                  f"rolled back to step {start}: moved {names} to {aside}")
                                 + self._stale_export([s for s, _ in moved]))
                    if kept:   # committed by a live writer since this process chose its start: not ours to move
                        error = (f"run {self.run}: {kept[0].name} was committed after this process chose to resume "
                                 f"from step {start}; a committed step is final: start again to resume from it")
                except OSError as e:
                    error = f"cannot set aside the checkpoints above step {start} in {self.dir}: {e.strerror or e}"
        error = _broadcast_obj(error)
        if error:
            raise UserError(error)

    def _stale_export(self, moved: list[int]) -> str:
        """'; ...' when the run's export (models/<run>/, its llmcluster.json) was made from a step just set aside."""
        try:
            step = json.loads((self.storage.model_dir(self.run) / "llmcluster.json").read_text()).get("step")
        except (OSError, ValueError, AttributeError):
            return ""
        return (f"; {self.storage.model_dir(self.run)} is the export of step_{step}, set aside with them: export "
                "again once the run has trained on") if step in moved else ""

    # -- save --------------------------------------------------------------------------------------
    def save(self, step: int, model, optimizer, train_state: dict, deadline: float | None = None,
             async_: bool = False) -> Path | None:
        """Write step_<N>. Sync: returns its path, or None when it could not finish before `deadline`
        (time.time(); the preemption grace period): then the partial write is discarded and the previous
        checkpoint stays the newest. Async: stages the state in memory, writes it in a thread and returns
        None; `poll()` at later step boundaries finalizes it once every rank's write has completed."""
        # lazy: DCP's import (~1.2 s: DTensor, sympy) is paid by a run that writes or reads a checkpoint only,
        # not before its first step, nor by a refused run, a benchmark or a non-checkpoint command
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.api import CheckpointException
        from torch.distributed.checkpoint.state_dict import get_state_dict

        self.wait_pending()
        if self.refused:   # invariant 1: this process found a committed step where it wrote; it writes no more
            return None
        if self.rank == 0:
            self.lock.progress()  # the hang watchdog counts a save from its start
        t0 = time.time()
        tmp = self.dir / f"{TMP_PREFIX}step_{step}-{self.attempt}"
        error = None
        if self.rank == 0:
            try:
                self.dir.mkdir(parents=True, exist_ok=True)
                shutil.rmtree(tmp, ignore_errors=True)
                tmp.mkdir(parents=True)
            except OSError as e:
                error = self._message(e, step)
        self._agree(error, tmp)
        error = None
        try:
            model_sd, optim_sd = get_state_dict(model, optimizer, options=self._options())
            state = {"model": model_sd, "optim": optim_sd}
            self._estimate = _state_bytes(state)
            (tmp / "rng").mkdir(exist_ok=True)
            _write_json_atomic(tmp / "rng" / f"rank_{self.rank}.json", rng_state())
            if f"{self.rank}:{step}" in test_hook(IO_ERROR_HOOK).split(","):
                raise OSError(errno.EIO, "Input/output error (injected)")
            if self.rank == 0:
                _write_json_atomic(tmp / TRAIN_STATE, {**train_state, "step": step, "world_size": self.world})
        except OSError as e:
            error = self._message(e, step)
        self._agree(error, tmp)
        try:
            if async_:
                # A process group of its own: the writer thread's collectives must not interleave with
                # the training loop's on the default group.
                with _single_process_is_intended():
                    future = dcp.async_save(state, storage_writer=self.staging.writer(tmp),
                                            process_group=self._async_group())
                self.pending = (step, tmp, t0, future)
                self.last_save_s = time.time() - t0  # the time training was blocked (staging)
                return None
            with _single_process_is_intended():
                dcp.save(state, storage_writer=dcp.FileSystemWriter(tmp))
        except (OSError, CheckpointException) as e:  # DCP has gathered every rank's outcome: all see it
            self._agree(self._message(e, step), tmp)
        path = self._finalize(step, tmp, t0, deadline)
        self.last_save_s = self.last_write_s
        return path

    def poll(self) -> Path | None:
        """At a step boundary (every rank): finalize the async write if every rank's part is done."""
        if self.pending is None:
            return None
        done = self.pending[3].done()
        if dist.is_initialized():
            flag = torch.tensor([1 if done else 0], dtype=torch.int32)
            dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=control_group())
            done = bool(flag.item())
        return self.wait_pending() if done else None

    def wait_pending(self) -> Path | None:
        """Block until the async write (if any) is written on this rank, then finalize it (collective)."""
        if self.pending is None:
            return None
        from torch.distributed.checkpoint.api import CheckpointException  # lazy (see save); loaded by now

        step, tmp, t0, future = self.pending
        self.pending = None
        error = None
        try:
            future.result()
        except (OSError, CheckpointException) as e:
            error = self._message(e, step)
        self._agree(error, tmp)
        return self._finalize(step, tmp, t0, None)

    def _finalize(self, step: int, tmp: Path, t0: float, deadline: float | None) -> Path | None:
        _barrier()
        if deadline is not None and _any_rank(time.time() > deadline):
            if self.rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            _barrier()
            self.log(f"warning: checkpoint step_{step} did not finish within checkpoint.grace_period_s: "
                     "discarded; the previous checkpoint is intact")
            return None
        final = self.dir / f"step_{step}"
        # Each rank hashes the files it wrote (in parallel); rank 0 the shared ones.
        mine, error = {}, None
        try:
            for f in sorted(tmp.rglob("*")):
                rel = str(f.relative_to(tmp))
                if f.is_file() and owner_rank(rel, self.world) == self.rank:
                    mine[rel] = sha256_file(f)
        except OSError as e:
            error = self._message(e, step)
        self._agree(error, tmp)
        files = {k: v for part in _gather_obj(mine) for k, v in part.items()}
        refused = None
        if self.rank == 0:
            try:
                error = self.lock.heartbeat(force=True)  # a writer presumed dead must not seal a step
                aside, kept = self.set_aside([final]) if error is None and final.exists() else (None, [])
                if kept:
                    refused = (f"{final} is already committed (it verifies): a committed step is final, so this "
                               "write is discarded and this process writes no more checkpoints")
                    shutil.rmtree(tmp, ignore_errors=True)
                elif error is None:
                    if aside:   # an earlier write of this step that failed verification
                        self.log(f"moved the earlier {final.name} to {aside}")
                    os.rename(tmp, final)
                    _fsync_dir(self.dir)
                    size = sum((final / rel).stat().st_size for rel in files)
                    _write_json_atomic(final / COMPLETE_MARKER, {
                        "step": step, "files": files, "bytes": size, "world_size": self.world,
                        "attempt": self.attempt, "written_s": round(time.time() - t0, 3),
                        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})
                    self.last_bytes = size
                    self.prune(step)
            except OSError as e:
                error = self._message(e, step)
        error, refused = _broadcast_obj((error, refused))
        # renamed but not sealed (the marker's write failed: a full disk) -> the unsealed step_N is ours to remove
        half = tmp if tmp.exists() or not final.exists() else None if (final / COMPLETE_MARKER).is_file() else final
        self._agree(error, half, agreed=True)
        self.last_write_s = time.time() - t0
        if refused:
            self.refused = refused
            if self.rank == 0:
                self.log(refused)
            return None
        return final

    def _async_group(self):
        if dist.is_initialized() and self._group is None:
            self._group = dist.new_group(backend="gloo")
        return self._group

    def _agree(self, error: str | None, tmp: Path | None, agreed: bool = False) -> None:
        """Collective: if any rank failed, every rank raises the same one line; the shared temporary
        directory is removed by rank 0 only after every rank has stopped writing into it."""
        if not agreed:
            error = _first_error(error)
        if error is None:
            return
        _barrier()
        if self.rank == 0 and tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        raise (DiskFull if error.startswith(DISK_FULL) else UserError)(error)   # agreed on as strings

    def _message(self, e: BaseException, step: int) -> str:
        # whatever raised it: an errno (our writes, DCP's) or torch's zip writer's words (a 1-rank DCP shard)
        if is_disk_full(e, self.dir):
            need = self.last_bytes or getattr(self, "_estimate", 0)
            earlier = [s for s, _, ok in self.storage.checkpoint_steps(self.run) if ok and s != step]
            intact = f"step_{earlier[-1]} is intact" if earlier else "there is no earlier checkpoint"
            return disk_full_line(f"checkpoint step_{step}", self.dir, intact, need,
                                  "free space or lower checkpoint.keep_last" if earlier else "free space")
        os_err = _find_exc(e, OSError)
        if os_err is None:
            raise e
        return f"cannot write checkpoint step_{step} to {self.dir}: {os_err.strerror or os_err}"

    def prune(self, written: int | None = None) -> None:
        """Retention after writing step `written` (default: the newest complete one): among complete steps
        up to it keep the newest `keep_last` plus milestones; drop incomplete ones below it. It and anything
        above it are never touched (a higher step is another trajectory's, or one that failed verification)."""
        steps = self.storage.checkpoint_steps(self.run)
        if written is None:
            complete = [s for s, _, ok in steps if ok]
            if not complete:
                return
            written = complete[-1]
        complete = [s for s, _, ok in steps if ok and s <= written]
        keep = set(complete[-self.keep_last:]) | {written}
        if self.keep_every:
            keep |= {s for s in complete if s % self.keep_every == 0}
        keep |= self.protected()
        for s, d, _ok in steps:
            if s < written and s not in keep:
                shutil.rmtree(d, ignore_errors=True)

    # -- load --------------------------------------------------------------------------------------
    def find_resume(self, resume: str, foreign_ok: bool = False) -> Path | None:
        """'never' -> None; 'auto' -> newest step_<N> that verifies; else that directory (refused if it does
        not verify, or if it is another run's and `foreign_ok` (--init-from-checkpoint) is not given). Collective:
        each rank verifies its own share of the files."""
        if resume == "never":
            return None
        if resume != "auto":
            p = Path(resume)
            if not p.is_dir():
                raise UserError(f"--resume {resume}: no such checkpoint directory (--resume takes auto, never or a "
                                "step_N directory)")
            if not foreign_ok and not is_own_checkpoint(self.storage, self.run, p):
                raise foreign_resume_error(self.run, resume)
            problem = _first_error(verify_share(p, self.rank, self.world))
            if problem:
                raise UserError(f"--resume {resume}: {problem}")
            return p
        return newest_verified_checkpoint(self.storage, self.run, self.log, self.rank, self.world)

    def _options(self):
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        # not strict when the frozen base is left out: those weights come from train.init_from
        return StateDictOptions(ignore_frozen_params=self.skip_frozen, strict=not self.skip_frozen)

    def load(self, path: Path, model, optimizer) -> dict:
        """Load model + optimizer (resharded to this run's layout) and return train_state.json."""
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict  # lazy (see save)

        model_sd, optim_sd = get_state_dict(model, optimizer, options=self._options())
        state = {"model": model_sd, "optim": optim_sd}
        _load_or_refuse(state, path, no_dist=False)
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                       options=self._options())
        train_state = json.loads((path / TRAIN_STATE).read_text())
        rng = path / "rng" / f"rank_{self.rank}.json"
        if train_state.get("world_size") == self.world and rng.is_file():
            set_rng_state(json.loads(rng.read_text()))
        return train_state


def _load_or_refuse(state: dict, path: Path, no_dist: bool) -> None:
    try:
        with _single_process_is_intended():
            load_state(state, path, no_dist=no_dist)
    except Exception as e:  # the files changed since they were verified
        unsafe = _find_exc(e, UnsafeCheckpoint)
        if unsafe is None:
            raise
        raise UserError(f"refusing checkpoint {path}: {unsafe}") from None


def load_model_weights(path: Path, model, frozen: bool = True) -> None:
    """Model weights only, in one process without a process group (export, generate). `frozen=False`: the
    trained parameters alone (an NF4 run's checkpoint leaves its frozen base out: Checkpointer.skip_frozen)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict  # lazy (see save)

    sd = get_model_state_dict(model, options=StateDictOptions(ignore_frozen_params=not frozen))
    state = {"model": sd}
    _load_or_refuse(state, path, no_dist=True)
    model.load_state_dict(state["model"], strict=frozen)


@contextlib.contextmanager
def _single_process_is_intended():
    """DCP warns "assuming the intent is to load/save in a single process" whenever no process group exists,
    even when told `no_dist=True`; in a one-process run or an export that is exactly the intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield
