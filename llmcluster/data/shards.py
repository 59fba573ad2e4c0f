"""The on-disk token format shared by prepare, merge and the trainer's reader: shard files and meta.json.

Its own module so that the writer (prepare.py) and the reader (dataset.py) depend on it and not on each other.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

import numpy as np

from llmcluster.storage.layout import sha256_file

META = "meta.json"
FORMAT = "llmcluster-tokens-v1"


def token_dtype(vocab: int) -> np.dtype:
    return np.dtype(np.uint16 if vocab <= 2**16 else np.uint32)


def is_val(key: str, seed: int, fraction: float) -> bool:
    """A document's split from a seeded hash of its key: stable when documents are added or sliced."""
    h = hashlib.sha256(f"{seed}:{key}".encode()).digest()
    return int.from_bytes(h[:8], "little") / 2**64 < fraction


class ShardWriter:
    """Appends token arrays to fixed-size shards of one split (or, suffix .mask, their uint8 loss masks:
    fed the same lengths, the two cut at the same places)."""

    def __init__(self, out: Path, split: str, dtype: np.dtype, shard_tokens: int, suffix: str = ".bin"):
        self.out, self.split, self.dtype, self.cap, self.suffix = out, split, dtype, shard_tokens, suffix
        self.shards: list[dict] = []
        self._buf: list[np.ndarray] = []
        self._n = 0

    def add(self, ids) -> None:
        arr = np.asarray(ids, dtype=self.dtype)
        while len(arr):
            take = min(len(arr), self.cap - self._n)
            self._buf.append(arr[:take])
            self._n += take
            arr = arr[take:]
            if self._n == self.cap:
                self.flush()

    def flush(self) -> None:
        if not self._n:
            return
        name = f"{self.split}_{len(self.shards):06d}{self.suffix}"
        path = self.out / name
        np.concatenate(self._buf).astype(self.dtype.newbyteorder("<"), copy=False).tofile(path)
        self.shards.append({"file": name, "tokens": self._n, "sha256": sha256_file(path)})
        self._buf, self._n = [], 0

    @property
    def tokens(self) -> int:
        return sum(s["tokens"] for s in self.shards) + self._n


def publish(tmp: Path, final: Path) -> None:
    """Move a finished dataset directory into place; an existing one (--force) is swapped out first, so a
    crash never leaves neither."""
    final.parent.mkdir(parents=True, exist_ok=True)
    if final.exists():
        old = final.parent / f".old-{final.name}-{os.getpid()}"
        final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        tmp.rename(final)
