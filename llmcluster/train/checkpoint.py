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
import errno
import json
import os
import pickle
import random
import shutil
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
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
        self.last_save_s: float | None = None   # measured write time (for the Young/Daly interval)
        self.last_bytes: int | None = None

    # -- save --------------------------------------------------------------------------------------
    def save(self, step: int, model, optimizer, train_state: dict) -> Path:
        t0 = time.time()
        final = self.dir / f"step_{step}"
        tmp = self.dir / f"{TMP_PREFIX}step_{step}"
        if self.rank == 0:
            self.dir.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        _barrier()
        try:
            model_sd, optim_sd = get_state_dict(model, optimizer)
            dcp.save({"model": model_sd, "optim": optim_sd}, storage_writer=dcp.FileSystemWriter(tmp))
            (tmp / "rng").mkdir(exist_ok=True)
            _write_json_atomic(tmp / "rng" / f"rank_{self.rank}.json", _rng_state())
            if self.rank == 0:
                _write_json_atomic(tmp / TRAIN_STATE, {**train_state, "step": step, "world_size": self.world})
        except OSError as e:
            self._fail(tmp, e, step)
        _barrier()
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
        self.last_save_s = time.time() - t0
        return final

    def _fail(self, path: Path, e: OSError, step: int):
        shutil.rmtree(path, ignore_errors=True)
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            free = shutil.disk_usage(self.dir).free
            need = self.last_bytes or 0
            raise UserError(f"disk full writing checkpoint step_{step} to {self.dir}: it needs about "
                            f"{max(need, 1) / 1e6:.1f} MB, {free / 1e6:.1f} MB free; the previous checkpoint "
                            "is intact") from None
        raise UserError(f"cannot write checkpoint step_{step} to {self.dir}: {e.strerror or e}") from None

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
            for step, d, _ok in reversed(self.storage.checkpoint_steps(self.run)):
                problem = verify_checkpoint(d)
                if problem is None:
                    choice = str(d)
                    break
                self.log(f"warning: skipping checkpoint {d}: {problem}")
        choice = _broadcast_obj(choice)
        return Path(choice) if choice else None

    def load(self, path: Path, model, optimizer) -> dict:
        """Load model + optimizer (resharded to this run's layout) and return train_state.json."""
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = {"model": model_sd, "optim": optim_sd}
        dcp.load(state, storage_reader=SafeFileSystemReader(path))
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        train_state = json.loads((path / TRAIN_STATE).read_text())
        rng = path / "rng" / f"rank_{self.rank}.json"
        if train_state.get("world_size") == self.world and rng.is_file():
            _set_rng_state(json.loads(rng.read_text()))
        return train_state


def load_model_weights(path: Path, model) -> None:
    """Model weights only, in one process without a process group (export, generate)."""
    sd = get_model_state_dict(model, options=StateDictOptions())
    state = {"model": sd}
    import warnings

    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, storage_reader=SafeFileSystemReader(path), no_dist=True)
    model.load_state_dict(state["model"])
