"""Token shards on disk, and the deterministic, rank-aware, resumable sampler over them.

The sampler's whole state is one integer: how many samples the run has consumed. Sample k of the run is
window `perm_e[k mod W]` of epoch e = k // W, where perm_e is a seeded permutation of the W windows. Step s
takes samples [s·G, (s+1)·G) of the global batch G, and each data-parallel rank takes its micro-batches out
of that range. So a resume - at the same or at a different world size - neither repeats nor skips a sample.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from llmcluster.data.prepare import META
from llmcluster.storage.layout import sha256_file
from llmcluster.errors import UserError
from llmcluster.storage.layout import Storage


@dataclass
class Dataset:
    path: Path
    meta: dict
    shards: dict[str, list[np.memmap]]

    @property
    def vocab_size(self) -> int:
        return int(self.meta["vocab_size"])


def resolve_dataset_dir(root: Path, name: str, kind: str) -> Path:
    """A dataset name under datasets/<kind>/, or a path to a prepared dataset directory."""
    p = Path(name)
    if (p / META).is_file():
        return p
    try:
        return Storage(root).dataset_dir(kind, name)
    except UserError:
        raise UserError(f"dataset {name!r}: not a dataset name nor a prepared dataset directory") from None


def open_dataset(root: Path, name: str, kind: str = "code", verify: bool = True,
                 max_vocab: int | None = None) -> Dataset:
    """Open and check a prepared dataset: sizes always, sha256 and token range when `verify`."""
    path = resolve_dataset_dir(root, name, kind)
    meta_path = path / META
    if not meta_path.is_file():
        raise UserError(f"dataset not found: {path} (run `llmcluster data prepare --name {name}"
                        f"{'' if kind == 'code' else ' --kind ' + kind} --root {root}`)")
    try:
        meta = json.loads(meta_path.read_text())
        dtype = np.dtype(meta["dtype"]).newbyteorder("<")
        specs = meta["shards"]
        vocab = int(meta["vocab_size"])
    except (ValueError, KeyError, TypeError) as e:
        raise UserError(f"dataset {path}: corrupt {META} ({e})") from None
    if max_vocab is not None and vocab > max_vocab:
        raise UserError(f"dataset {path} has vocab {vocab} but model.vocab_size is {max_vocab}: "
                        f"set model.vocab_size >= {vocab}")
    shards: dict[str, list[np.memmap]] = {}
    for split in ("train", "val"):
        shards[split] = []
        for spec in specs.get(split, []):
            f = path / spec["file"]
            if not f.is_file():
                raise UserError(f"dataset {path}: shard {spec['file']} is missing")
            expected = int(spec["tokens"]) * dtype.itemsize
            if f.stat().st_size != expected:
                raise UserError(f"dataset {path}: shard {spec['file']} is truncated or padded "
                                f"({f.stat().st_size} bytes, expected {expected})")
            if verify and sha256_file(f) != spec["sha256"]:
                raise UserError(f"dataset {path}: shard {spec['file']} is corrupt (sha256 mismatch)")
            arr = np.memmap(f, dtype=dtype, mode="r")
            if verify and len(arr) and int(arr.max()) >= (max_vocab or vocab):
                raise UserError(f"dataset {path}: shard {spec['file']} holds token id {int(arr.max())} "
                                f"outside the vocabulary ({max_vocab or vocab})")
            shards[split].append(arr)
    if not shards["train"]:
        raise UserError(f"dataset {path} has no training shards")
    return Dataset(path, meta, shards)


class WindowIndex:
    """All (shard, offset) windows of seq_len + 1 tokens in one split, stride seq_len."""

    def __init__(self, shards: list[np.memmap], seq_len: int):
        self.shards, self.seq_len = shards, seq_len
        counts = np.array([max(0, (len(s) - 1) // seq_len) for s in shards], dtype=np.int64)
        self.starts = np.concatenate([[0], np.cumsum(counts)])
        self.total = int(self.starts[-1])

    def gather(self, windows: np.ndarray) -> np.ndarray:
        """(n,) window ids -> (n, seq_len + 1) int64 tokens."""
        shard = np.searchsorted(self.starts, windows, side="right") - 1
        out = np.empty((len(windows), self.seq_len + 1), dtype=np.int64)
        for i, (s, w) in enumerate(zip(shard, windows)):
            off = (int(w) - int(self.starts[s])) * self.seq_len
            out[i] = self.shards[s][off: off + self.seq_len + 1]
        return out


class Sampler:
    """Deterministic sample order over the training windows; state = samples consumed."""

    def __init__(self, ds: Dataset, seq_len: int, seed: int):
        self.index = WindowIndex(ds.shards["train"], seq_len)
        if self.index.total == 0:
            raise UserError(f"dataset {ds.path}: no training sequence of {seq_len + 1} tokens "
                            f"(lower data.seq_len or add data)")
        self.seed = seed
        self.consumed = 0
        self._perm_epoch = -1
        self._perm: np.ndarray | None = None

    def _window_ids(self, sample_ids: np.ndarray) -> np.ndarray:
        W = self.index.total
        out = np.empty_like(sample_ids)
        epochs = sample_ids // W
        for e in np.unique(epochs):
            if e != self._perm_epoch:
                self._perm = np.random.default_rng([self.seed, int(e)]).permutation(W)
                self._perm_epoch = int(e)
            sel = epochs == e
            out[sel] = self._perm[sample_ids[sel] % W]
        return out

    def micro_batches(self, global_batch: int, dp_rank: int, dp_size: int, micro_batch: int):
        """This rank's micro-batches for the next optimizer step, as (sample_ids, x, y); advances state."""
        assert global_batch == dp_size * micro_batch * (global_batch // (dp_size * micro_batch))
        accum = global_batch // (dp_size * micro_batch)
        base = self.consumed
        self.consumed += global_batch
        for m in range(accum):
            first = base + (m * dp_size + dp_rank) * micro_batch
            ids = np.arange(first, first + micro_batch, dtype=np.int64)
            tokens = torch.from_numpy(self.index.gather(self._window_ids(ids)))
            yield ids, tokens[:, :-1], tokens[:, 1:]

    def state_dict(self) -> dict:
        return {"consumed": self.consumed, "seed": self.seed, "windows": self.index.total}

    def load_state_dict(self, state: dict) -> None:
        if state.get("windows") not in (None, self.index.total):
            raise UserError("the dataset changed since the checkpoint was written "
                            f"({state['windows']} windows then, {self.index.total} now): resuming would "
                            "not continue the same sample order")
        self.consumed = int(state["consumed"])


def eval_batches(ds: Dataset, seq_len: int, n_batches: int, micro_batch: int, dp_rank: int, dp_size: int):
    """A fixed, evenly spread set of validation windows; each rank takes its share of every batch."""
    split = "val" if ds.shards["val"] else "train"
    index = WindowIndex(ds.shards[split], seq_len)
    want = n_batches * micro_batch * dp_size
    if index.total == 0:
        return
    windows = np.linspace(0, index.total - 1, num=want).astype(np.int64)
    per_batch = micro_batch * dp_size
    for b in range(0, len(windows), per_batch):
        mine = windows[b: b + per_batch][dp_rank * micro_batch: (dp_rank + 1) * micro_batch]
        if len(mine):
            tokens = torch.from_numpy(index.gather(mine))
            yield tokens[:, :-1], tokens[:, 1:]
