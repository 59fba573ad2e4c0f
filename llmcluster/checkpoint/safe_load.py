"""Loading a DCP checkpoint as data, never as code.

Whoever can write `checkpoints/` can also rewrite its sha256 marker, so the marker proves completeness, not
trust. What keeps a planted checkpoint from running code in every trainer and exporter of the run is here:
 - `.metadata` (a pickle) goes through an unpickler that resolves an exact list of (module, name) pairs,
   DCP's own metadata classes and torch's dtypes; no module wildcard and no dotted name (protocol 4
   resolves `module.attr.attr`, which reaches any module that module imported);
 - non-tensor entries (optimizer hyper-parameters) go through `torch.load(weights_only=True)`: DCP's
   `DefaultLoadPlanner.load_bytes` uses `weights_only=False`;
 - the marker's entries must be relative paths inside the step directory and must list the metadata and the
   train state, and every file the metadata points into must be listed (so it is checksummed).
`check_data_only` runs all of this before a checkpoint is chosen, so `--resume auto` can fall back past a
planted one; the planner and reader repeat it at load time (the files may change in between).
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path, PurePosixPath

import torch

from llmcluster.storage.layout import COMPLETE_MARKER

METADATA = ".metadata"
TRAIN_STATE = "train_state.json"

# Every (module, name) a DCP 2.x `.metadata` of ours refers to (torch 2.13: dataclasses of metadata.py, the
# filesystem's _StorageInfo, the layout helper, pathlib for checkpoint_id). Exact names only.
_ALLOWED = {
    ("torch.distributed.checkpoint.metadata", n) for n in (
        "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
        "BytesStorageMetadata", "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING")
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.serialization", "_get_layout"),
    ("torch", "Size"),
    ("collections", "OrderedDict"),
} | {("pathlib", n) for n in ("PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath", "Path")}
_DTYPES = {str(v).removeprefix("torch.") for v in vars(torch).values() if isinstance(v, torch.dtype)}


class UnsafeCheckpoint(Exception):
    """A checkpoint that asks for more than data; the message says what it asked for."""


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        ok = "." not in name and ((module, name) in _ALLOWED or (module == "torch" and name in _DTYPES))
        if not ok:
            raise UnsafeCheckpoint(f"its {METADATA} refers to {module}.{name} (only DCP metadata is loaded)")
        return super().find_class(module, name)


def read_metadata_file(path: Path):
    try:
        with open(path, "rb") as f:
            return _MetadataUnpickler(f).load()
    except UnsafeCheckpoint:
        raise
    except Exception as e:  # truncated, not a pickle, wrong classes' arguments
        raise UnsafeCheckpoint(f"its {METADATA} is unreadable ({type(e).__name__}: {e})") from None


def load_data(value: io.BytesIO):
    """A non-tensor entry: plain data (numbers, strings, tuples, dicts, tensors) or refused."""
    try:
        return torch.load(value, weights_only=True)
    except pickle.UnpicklingError as e:
        first = str(e).strip().splitlines()
        raise UnsafeCheckpoint(f"a non-tensor entry is not plain data ({first[-1] if first else e})") from None


def load_state(state: dict, path: Path, no_dist: bool = False) -> None:
    """dcp.load with the safe reader and planner: the one way this project reads a DCP checkpoint."""
    from llmcluster.checkpoint.safe_reader import load_state as load  # lazy: DCP's import (~1.2 s), on a read only

    load(state, path, no_dist=no_dist)


def marker_problem(step_dir: Path, marker: dict) -> str | None:
    """What is wrong with the marker's file list itself (before any file is hashed)."""
    files = marker.get("files")
    if not isinstance(files, dict) or not files:
        return "its completion marker lists no files"
    for rel, digest in files.items():
        p = PurePosixPath(rel) if isinstance(rel, str) else None
        if p is None or p.is_absolute() or ".." in p.parts or not p.parts or rel != str(p) \
                or p.parts[0] == COMPLETE_MARKER or not isinstance(digest, str):
            return f"its completion marker lists {rel!r}, not a file inside the step"
    for needed in (METADATA, TRAIN_STATE):
        if needed not in files:
            return f"its completion marker does not list {needed}"
    return None


def check_data_only(step_dir: Path, marker: dict) -> str | None:
    """Read the metadata and every non-tensor entry as data; None if all of it is plain data. Cheap: the
    entries are a few bytes each (optimizer hyper-parameters)."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    try:
        md = read_metadata_file(step_dir / METADATA)
        storage = getattr(md, "storage_data", None) or {}
        listed = marker["files"]
        for index, info in storage.items():
            rel = getattr(info, "relative_path", None)
            if not isinstance(rel, str) or rel not in listed:
                return f"its {METADATA} points into {rel!r}, which the completion marker does not list"
            if getattr(info, "transform_descriptors", None):
                return f"its {METADATA} asks for transforms {info.transform_descriptors} (never written here)"
            if isinstance(md.state_dict_metadata.get(index.fqn), BytesStorageMetadata):
                with open(step_dir / rel, "rb") as f:
                    f.seek(int(info.offset))
                    load_data(io.BytesIO(f.read(int(info.length))))
    except UnsafeCheckpoint as e:
        return f"refused: {e}"
    except (OSError, AttributeError, TypeError, ValueError) as e:
        return f"unreadable: {type(e).__name__}: {e}"
    return None
