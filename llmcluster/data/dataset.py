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

from llmcluster.data.shards import META
from llmcluster.errors import UserError
from llmcluster.storage.layout import DATASET_KINDS as KINDS
from llmcluster.storage.layout import Storage, sha256_file


@dataclass
class Dataset:
    path: Path
    meta: dict
    shards: dict[str, list[np.memmap]]
    masks: dict[str, list[np.memmap]] | None = None  # chat data: 1 where a token is a training target

    @property
    def vocab_size(self) -> int:
        return int(self.meta["vocab_size"])


def resolve_dataset_dir(root: Path, name: str, kind: str | None) -> Path:
    """A dataset name under datasets/<kind>/ (kind None: whichever kind holds it), or a path to one."""
    p = Path(name)
    if (p / META).is_file():
        return p
    try:
        if kind is not None:
            return Storage(root).dataset_dir(kind, name)
        hits = [d for k in KINDS if ((d := Storage(root).dataset_dir(k, name)) / META).is_file()]
    except UserError:
        raise UserError(f"dataset {name!r}: not a dataset name nor a prepared dataset directory") from None
    if len(hits) > 1:
        raise UserError(f"dataset {name!r} exists in several kinds ({', '.join(str(h) for h in hits)}): "
                        "name it by path")
    if not hits:
        raise UserError(f"dataset {name!r}: not found under {Storage(root).datasets}/{{{','.join(KINDS)}}} "
                        f"(run `llmcluster data prepare --name {name}`)")
    return hits[0]


def data_sources(root: Path, data) -> list[tuple[str, Path, float]]:
    """(name, directory, weight) of every dataset a `data` config section reads."""
    if data.mixture is None:
        return [(data.dataset, resolve_dataset_dir(root, data.dataset, data.kind), 1.0)]
    return [(n, resolve_dataset_dir(root, n, None), float(w)) for n, w in data.mixture.items()]


def tokenizer_dir(root: Path, data) -> Path:
    """The dataset directory whose tokenizer (and meta.json BOS/EOS) the run uses: the first source's."""
    return data_sources(root, data)[0][1]


def read_meta(path: Path) -> dict:
    try:
        return json.loads((path / META).read_text())
    except (OSError, ValueError) as e:
        raise UserError(f"dataset {path}: unreadable {META} ({e})") from None


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
    masks: dict[str, list[np.memmap]] | None = {} if meta.get("masks") else None
    for split in ("train", "val"):
        shards[split] = [_open_shard(path, spec, dtype, verify, max_vocab or vocab)
                         for spec in specs.get(split, [])]
        if masks is not None:
            masks[split] = [_open_shard(path, spec, np.dtype(np.uint8), verify, 2)
                            for spec in meta["masks"].get(split, [])]
            if [len(m) for m in masks[split]] != [len(a) for a in shards[split]]:
                raise UserError(f"dataset {path}: the {split} loss masks do not match its token shards")
    if not shards["train"]:
        raise UserError(f"dataset {path} has no training shards")
    return Dataset(path, meta, shards, masks)


def _open_shard(path: Path, spec: dict, dtype: np.dtype, verify: bool, limit: int) -> np.memmap:
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
    if verify and len(arr) and int(arr.max()) >= limit:
        raise UserError(f"dataset {path}: shard {spec['file']} holds token id {int(arr.max())} "
                        f"outside the vocabulary ({limit})")
    return arr


class WindowIndex:
    """All (shard, offset) windows of seq_len + 1 tokens in one split, stride seq_len."""

    def __init__(self, shards: list[np.memmap], seq_len: int, masks: list[np.memmap] | None = None):
        self.shards, self.seq_len, self.masks = shards, seq_len, masks
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

    def targets(self, windows: np.ndarray, tokens: np.ndarray) -> np.ndarray:
        """(n, seq_len) next-token targets; with loss masks, untrained ones are -100 (cross_entropy's
        ignore_index, so the trainer's loss skips them with no code of its own)."""
        y = tokens[:, 1:].copy()
        if self.masks is None:
            return y
        shard = np.searchsorted(self.starts, windows, side="right") - 1
        for i, (s, w) in enumerate(zip(shard, windows)):
            off = (int(w) - int(self.starts[s])) * self.seq_len
            y[i][self.masks[s][off + 1: off + self.seq_len + 1] == 0] = -100
        return y


class Sampler:
    """Deterministic sample order over the training windows; state = samples consumed."""

    def __init__(self, ds: Dataset, seq_len: int, seed: int, name: str | None = None):
        self.name = name or ds.path.name
        self.ds = ds   # a mixture evaluates each source on its own validation windows
        self.index = WindowIndex(ds.shards["train"], seq_len, ds.masks["train"] if ds.masks else None)
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
            windows = self._window_ids(ids)
            tokens = self.index.gather(windows)
            yield ids, torch.from_numpy(tokens[:, :-1]), torch.from_numpy(self.index.targets(windows, tokens))

    def tokens_by_source(self) -> dict[str, int]:
        return {self.name: self.consumed * self.index.seq_len}

    def state_dict(self) -> dict:
        return {"consumed": self.consumed, "seed": self.seed, "windows": self.index.total}

    def load_state_dict(self, state: dict) -> None:
        if state.get("windows") not in (None, self.index.total):
            raise UserError("the dataset changed since the checkpoint was written "
                            f"({state['windows']} windows then, {self.index.total} now): resuming would "
                            "not continue the same sample order")
        self.consumed = int(state["consumed"])


class MixtureSampler:
    """Several datasets drawn in proportion to their weights, deterministically and resumably.

    Sample k of the run goes to the source furthest behind its share: argmax_i(w_i·(k+1) - n_i), n_i the
    samples source i has had (ties: the first source). So after any k samples every share is within 1/k of
    its weight, and the whole state is the per-source counts. Each source walks its own windows exactly as
    a single-dataset Sampler does (seeded by the run seed + its position in the mixture).
    """

    def __init__(self, sources: list[tuple[str, Dataset, float]], seq_len: int, seed: int):
        self.samplers = [Sampler(ds, seq_len, seed + i, name) for i, (name, ds, _) in enumerate(sources)]
        w = np.array([wt for _, _, wt in sources], dtype=np.float64)
        self.weights = w / w.sum()
        self.seq_len = seq_len

    @property
    def consumed(self) -> int:
        return sum(s.consumed for s in self.samplers)

    def _assign(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        """Source and in-source sample index of the next n samples; advances the per-source counts."""
        counts = np.array([s.consumed for s in self.samplers], dtype=np.int64)
        k0 = int(counts.sum())
        src = np.empty(n, dtype=np.int64)
        pos = np.empty(n, dtype=np.int64)
        for j in range(n):
            i = int(np.argmax(self.weights * (k0 + j + 1) - counts))
            src[j], pos[j] = i, counts[i]
            counts[i] += 1
        for s, c in zip(self.samplers, counts):
            s.consumed = int(c)
        return src, pos

    def micro_batches(self, global_batch: int, dp_rank: int, dp_size: int, micro_batch: int):
        accum = global_batch // (dp_size * micro_batch)
        base = self.consumed
        src, pos = self._assign(global_batch)  # every rank computes the whole step's assignment
        for m in range(accum):
            first = (m * dp_size + dp_rank) * micro_batch
            xs, ys = [], []
            for i, p in zip(src[first:first + micro_batch], pos[first:first + micro_batch]):
                index = self.samplers[i].index
                w = self.samplers[i]._window_ids(np.array([p]))
                t = index.gather(w)
                xs.append(t[:, :-1])
                ys.append(index.targets(w, t))
            yield (np.arange(base + first, base + first + micro_batch), torch.from_numpy(np.concatenate(xs)),
                   torch.from_numpy(np.concatenate(ys)))

    def tokens_by_source(self) -> dict[str, int]:
        return {s.name: s.consumed * self.seq_len for s in self.samplers}

    def state_dict(self) -> dict:
        return {"consumed": self.consumed, "sources": {s.name: s.state_dict() for s in self.samplers}}

    def load_state_dict(self, state: dict) -> None:
        got = state.get("sources")
        if got is None or set(got) != {s.name for s in self.samplers}:
            raise UserError(f"data.mixture changed since the checkpoint was written (it read "
                            f"{sorted(got or ['one dataset'])}): resuming would not continue the same order")
        for s in self.samplers:
            s.load_state_dict(got[s.name])


def open_training_data(root: Path, data, seed: int, verify: bool, max_vocab: int | None):
    """(a Dataset for evaluation, the sampler) for a `data` config section: one dataset or a mixture, whose
    sources must share one tokenizer. A mixture evaluates on all its sources' validation windows."""
    sources = data_sources(root, data)
    if len({sha256_file(d / "tokenizer.json") for _, d, _ in sources if (d / "tokenizer.json").is_file()}) > 1:
        raise UserError("data.mixture: the datasets were prepared with different tokenizers; prepare them with "
                        "the same --tokenizer (a tokenizer.json or HF model directory)")
    opened = [(n, open_dataset(root, str(d), data.kind, verify, max_vocab), w) for n, d, w in sources]
    if data.mixture is None:
        return opened[0][1], Sampler(opened[0][1], data.seq_len, seed, opened[0][0])
    first = opened[0][1]
    pool = lambda get: {s: [a for _, ds, _ in opened for a in get(ds)[s]] for s in ("train", "val")}  # noqa: E731
    all_masked = all(ds.masks for _, ds, _ in opened)
    pooled = Dataset(first.path, first.meta, pool(lambda ds: ds.shards),
                     pool(lambda ds: ds.masks) if all_masked else None)
    return pooled, MixtureSampler(opened, data.seq_len, seed)


def eval_batches(ds: Dataset, seq_len: int, n_batches: int, micro_batch: int, dp_rank: int, dp_size: int):
    """A fixed, evenly spread set of validation windows; each rank takes its share of every batch."""
    split = "val" if ds.shards["val"] else "train"
    index = WindowIndex(ds.shards[split], seq_len, ds.masks[split] if ds.masks else None)
    want = n_batches * micro_batch * dp_size
    if index.total == 0:
        return
    windows = np.linspace(0, index.total - 1, num=want).astype(np.int64)
    per_batch = micro_batch * dp_size
    for b in range(0, len(windows), per_batch):
        mine = windows[b: b + per_batch][dp_rank * micro_batch: (dp_rank + 1) * micro_batch]
        if len(mine):
            tokens = index.gather(mine)
            yield torch.from_numpy(tokens[:, :-1]), torch.from_numpy(index.targets(mine, tokens))


def verify_cli(args, root: Path) -> int:
    ds = open_dataset(root, args.name, args.kind, verify=True)
    print(f"dataset {ds.path}: {len(ds.meta['shards']['train']) + len(ds.meta['shards']['val'])} shards OK "
          f"({sum(ds.meta['tokens'].values()):,} tokens)")
    return 0
