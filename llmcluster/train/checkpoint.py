"""Checkpoints: checkpoints/<run>/step_<N>/ written with torch.distributed.checkpoint (DCP), atomically.

Protocol (every rank takes part; rank 0 does the renames):
 1. write into checkpoints/<run>/.tmp-step_<N>/: DCP shards (model + optimizer, resharding-friendly),
    train_state.json (step, sampler, scheduler, config) and rng/rank_<r>.json;
 2. every rank hashes the files it wrote; rank 0 renames the directory to step_<N>;
 3. rank 0 writes COMPLETE.json (sha256 of every file) last, through a temp file + rename + fsync.
A directory without the marker, or whose files no longer match it, is never loaded. Loading never unpickles
arbitrary objects: tensors come through `torch.load(weights_only=True)` inside DCP, and DCP's pickled
metadata through an unpickler that accepts only DCP's own metadata classes.
"""

from __future__ import annotations

import base64
import contextlib
import errno
import json
import os
import pickle
import random
import shutil
import time
import warnings
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_state_dict,
                                                     set_state_dict)

from llmcluster.errors import UserError
from llmcluster.storage.layout import COMPLETE_MARKER, TMP_PREFIX, Storage, read_marker, sha256_file

TRAIN_STATE = "train_state.json"


# -- safe DCP metadata ---------------------------------------------------------------------------
_ALLOWED = {
    "torch.distributed.checkpoint.metadata": None,  # None: any name of that module
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "pathlib": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        allowed = _ALLOWED.get(module, set())
        ok = allowed is None or name in allowed
        if module == "torch":
            ok = name == "Size" or isinstance(getattr(torch, name, None), (torch.dtype, torch.layout,
                                                                           torch.memory_format))
        if not ok:
            raise pickle.UnpicklingError(f"checkpoint metadata refers to {module}.{name}: refused")
        return super().find_class(module, name)


class SafeFileSystemReader(dcp.FileSystemReader):
    def read_metadata(self, *args, **kwargs):
        path = Path(self.path) / ".metadata"
        with open(path, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
        if getattr(metadata, "storage_meta", None) is None:
            from torch.distributed.checkpoint.metadata import StorageMeta
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


# -- helpers -------------------------------------------------------------------------------------
def _rng_state() -> dict:
    state = {"torch": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode(),
             "numpy": _jsonable(np.random.get_state()), "python": _jsonable(random.getstate())}
    if torch.cuda.is_available():
        state["cuda"] = base64.b64encode(torch.cuda.get_rng_state().numpy().tobytes()).decode()
    return state


def _jsonable(x):
    if isinstance(x, np.ndarray):
        return {"__nd__": x.tolist(), "dtype": str(x.dtype)}
    if isinstance(x, (tuple, list)):
        return [_jsonable(v) for v in x]
    return x


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(torch.from_numpy(np.frombuffer(base64.b64decode(state["torch"]), dtype=np.uint8).copy()))
    n = state["numpy"]
    np.random.set_state((n[0], np.array(n[1]["__nd__"], dtype=n[1]["dtype"]), n[2], n[3], n[4]))
    p = state["python"]
    random.setstate((p[0], tuple(p[1]), p[2]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(torch.from_numpy(np.frombuffer(base64.b64decode(state["cuda"]),
                                                                dtype=np.uint8).copy()))


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


def verify_checkpoint(step_dir: Path) -> str | None:
    """None if the marker exists and every file matches its checksum, else what is wrong."""
    marker = read_marker(step_dir)
    if marker is None:
        return "no completion marker (interrupted write)"
    for rel, digest in marker.get("files", {}).items():
        f = step_dir / rel
        if not f.is_file():
            return f"{rel} is missing"
        if sha256_file(f) != digest:
            return f"{rel} does not match its checksum"
    return None


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


def _os_error(e: BaseException) -> OSError | None:
    """The OSError behind a failed save: DCP wraps each rank's exception in a CheckpointException."""
    if isinstance(e, OSError):
        return e
    if isinstance(e, CheckpointException):
        for failure in e.failures.values():
            inner = failure[0] if isinstance(failure, tuple) else getattr(failure, "exception", failure)
            if isinstance(inner, BaseException):
                found = _os_error(inner)
                if found is not None:
                    return found
    if e.__cause__ is not None:
        return _os_error(e.__cause__)
    return None


def _any_rank(flag: bool) -> bool:
    if not dist.is_initialized():
        return flag
    t = torch.tensor([1 if flag else 0], dtype=torch.int32)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
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
                 keep_every: int | None = None, log=print):
        self.storage, self.run, self.rank, self.world = storage, run, rank, world_size
        self.keep_last, self.keep_every, self.log = keep_last, keep_every, log
        self.dir = storage.run_checkpoints(run)
        self.last_save_s: float | None = None   # time training was blocked by the last save (Young/Daly C)
        self.last_write_s: float | None = None  # start of the last save to its completion marker
        self.last_bytes: int | None = None
        self.pending = None                     # an async save in flight: (step, tmp dir, t0, future)
        self._group = None

    # -- save --------------------------------------------------------------------------------------
    def save(self, step: int, model, optimizer, train_state: dict, deadline: float | None = None,
             async_: bool = False) -> Path | None:
        """Write step_<N>. Sync: returns its path, or None when it could not finish before `deadline`
        (time.time(); the preemption grace period): then the partial write is discarded and the previous
        checkpoint stays the newest. Async: stages the state in memory, writes it in a thread and returns
        None; `poll()` at later step boundaries finalizes it once every rank's write has completed."""
        self.wait_pending()
        t0 = time.time()
        tmp = self.dir / f"{TMP_PREFIX}step_{step}"
        if self.rank == 0:
            self.dir.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        _barrier()
        try:
            model_sd, optim_sd = get_state_dict(model, optimizer)
            state = {"model": model_sd, "optim": optim_sd}
            self._estimate = _state_bytes(state)
            (tmp / "rng").mkdir(exist_ok=True)
            _write_json_atomic(tmp / "rng" / f"rank_{self.rank}.json", _rng_state())
            if self.rank == 0:
                _write_json_atomic(tmp / TRAIN_STATE, {**train_state, "step": step, "world_size": self.world})
            if async_:
                # A process group of its own: the writer thread's collectives must not interleave with
                # the training loop's on the default group.
                with _single_process_is_intended():
                    future = dcp.async_save(state, storage_writer=dcp.FileSystemWriter(tmp),
                                            process_group=self._async_group())
                self.pending = (step, tmp, t0, future)
                self.last_save_s = time.time() - t0  # the time training was blocked (staging)
                return None
            with _single_process_is_intended():
                dcp.save(state, storage_writer=dcp.FileSystemWriter(tmp))
        except (OSError, CheckpointException) as e:
            self._fail(tmp, e, step)
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
            dist.all_reduce(flag, op=dist.ReduceOp.MIN)
            done = bool(flag.item())
        return self.wait_pending() if done else None

    def wait_pending(self) -> Path | None:
        """Block until the async write (if any) is written on this rank, then finalize it (collective)."""
        if self.pending is None:
            return None
        step, tmp, t0, future = self.pending
        self.pending = None
        try:
            future.result()
        except (OSError, CheckpointException) as e:
            self._fail(tmp, e, step)
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
        # Each rank hashes its own DCP files (in parallel); rank 0 the shared ones.
        mine = {}
        for f in sorted(tmp.rglob("*")):
            rel = str(f.relative_to(tmp))
            owner = 0
            if rel.startswith("__") and rel.endswith(".distcp"):
                owner = int(rel[2:].split("_")[0]) % self.world
            elif rel.startswith("rng/rank_"):
                owner = int(rel[len("rng/rank_"):-5]) % self.world
            if f.is_file() and owner == self.rank:
                mine[rel] = sha256_file(f)
        parts = [None] * self.world if dist.is_initialized() else [mine]
        if dist.is_initialized():
            dist.all_gather_object(parts, mine)
        files = {k: v for part in parts for k, v in part.items()}
        if self.rank == 0:
            try:
                if final.exists():  # an earlier, incomplete attempt at this step
                    shutil.rmtree(final)
                os.rename(tmp, final)
                _fsync_dir(self.dir)
                size = sum((final / rel).stat().st_size for rel in files)
                _write_json_atomic(final / COMPLETE_MARKER, {
                    "step": step, "files": files, "bytes": size, "world_size": self.world,
                    "written_s": round(time.time() - t0, 3), "time": time.strftime("%Y-%m-%dT%H:%M:%SZ",
                                                                                  time.gmtime())})
                self.last_bytes = size
            except OSError as e:
                self._fail(final, e, step)
            self.prune()
        _barrier()
        self.last_write_s = time.time() - t0
        return final

    def _async_group(self):
        if dist.is_initialized() and self._group is None:
            self._group = dist.new_group(backend="gloo")
        return self._group

    def _fail(self, path: Path, e: BaseException, step: int):
        shutil.rmtree(path, ignore_errors=True)
        os_err = _os_error(e)
        if os_err is not None and os_err.errno in (errno.ENOSPC, errno.EDQUOT):
            free = shutil.disk_usage(self.dir).free
            need = self.last_bytes or getattr(self, "_estimate", 0)
            raise UserError(f"disk full writing checkpoint step_{step} to {self.dir}: it needs about "
                            f"{max(need, 1) / 1e6:.1f} MB, {free / 1e6:.1f} MB free; the previous checkpoint "
                            "is intact (free space or lower checkpoint.keep_last)") from None
        if os_err is None:
            raise e
        raise UserError(f"cannot write checkpoint step_{step} to {self.dir}: {os_err.strerror or os_err}") \
            from None

    def prune(self) -> None:
        """Keep the newest `keep_last` complete checkpoints plus milestones; drop older incomplete ones."""
        steps = self.storage.checkpoint_steps(self.run)
        complete = [s for s, _, ok in steps if ok]
        if not complete:
            return
        keep = set(complete[-self.keep_last:])
        if self.keep_every:
            keep |= {s for s in complete if s % self.keep_every == 0}
        newest = complete[-1]
        for s, d, ok in steps:
            if s in keep or (not ok and s > newest):
                continue
            shutil.rmtree(d, ignore_errors=True)

    # -- load --------------------------------------------------------------------------------------
    def find_resume(self, resume: str) -> Path | None:
        """'never' -> None; 'auto' -> newest step_<N> that verifies; else that directory."""
        if resume == "never":
            return None
        if resume != "auto":
            p = Path(resume)
            if not p.is_dir():
                raise UserError(f"--resume {resume}: no such checkpoint directory")
            problem = verify_checkpoint(p) if self.rank == 0 else None
            problem = _broadcast_obj(problem)
            if problem:
                raise UserError(f"--resume {resume}: {problem}")
            return p
        choice = None
        if self.rank == 0:
            newest = newest_verified_checkpoint(self.storage, self.run, self.log)
            choice = str(newest) if newest else None
        choice = _broadcast_obj(choice)
        return Path(choice) if choice else None

    def load(self, path: Path, model, optimizer) -> dict:
        """Load model + optimizer (resharded to this run's layout) and return train_state.json."""
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = {"model": model_sd, "optim": optim_sd}
        with _single_process_is_intended():
            dcp.load(state, storage_reader=SafeFileSystemReader(path))
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        train_state = json.loads((path / TRAIN_STATE).read_text())
        rng = path / "rng" / f"rank_{self.rank}.json"
        if train_state.get("world_size") == self.world and rng.is_file():
            _set_rng_state(json.loads(rng.read_text()))
        return train_state


def newest_verified_checkpoint(storage: Storage, run: str, log) -> Path | None:
    """The newest step_<N> of a run whose marker and checksums verify; each newer one is skipped with a
    warning through `log` (an interrupted or corrupted write costs the steps since the previous one, no more)."""
    for _step, d, _complete in reversed(storage.checkpoint_steps(run)):
        problem = verify_checkpoint(d)
        if problem is None:
            return d
        log(f"warning: skipping checkpoint {d}: {problem}")
    return None


def load_model_weights(path: Path, model) -> None:
    """Model weights only, in one process without a process group (export, generate)."""
    sd = get_model_state_dict(model, options=StateDictOptions())
    state = {"model": sd}
    with _single_process_is_intended():
        dcp.load(state, storage_reader=SafeFileSystemReader(path), no_dist=True)
    model.load_state_dict(state["model"])


@contextlib.contextmanager
def _single_process_is_intended():
    """DCP warns "assuming the intent is to load/save in a single process" whenever no process group exists,
    even when told `no_dist=True`; in a one-process run or an export that is exactly the intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield
