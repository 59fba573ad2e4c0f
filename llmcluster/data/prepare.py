"""`llmcluster data prepare`: source files -> tokenizer.json + token shards + meta.json.

Layout of datasets/<kind>/<name>/:
    tokenizer.json              the tokenizer (HF `tokenizers` format)
    train_000000.bin ...        flat token ids, little-endian uint16 (vocab <= 65536) or uint32
    val_000000.bin ...
    meta.json                   vocab size, dtype, token counts, split, per-shard sha256, sources

Documents (files) are split into train/val by a seeded hash of their path, so the split does not move when
files are added. Each document ends with the EOT token. Everything is written into a temporary directory and
renamed into place at the end: a crash leaves no half dataset behind.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sysconfig
import time
from pathlib import Path

import numpy as np

from llmcluster.errors import UserError
from llmcluster.storage.layout import Storage, sha256_file

META = "meta.json"
CODE_SUFFIXES = {".py", ".pyi", ".c", ".h", ".cc", ".cpp", ".hpp", ".rs", ".go", ".js", ".ts", ".java",
                 ".sh", ".toml", ".yaml", ".yml", ".json", ".md", ".rst", ".txt"}
SKIP_DIRS = {"site-packages", "__pycache__", ".git", "test", "tests", "idle_test", "node_modules"}
# The stdlib's generated data tables (pydoc's topic texts, codec maps) are megabytes of string literals, not code
# anyone writes: left in, a tiny model spends its few minutes learning to continue them.
STDLIB_DATA_DIRS = {"pydoc_data", "encodings"}
ENCODE_BATCH = 256  # documents per encode_batch call: big enough to keep every core busy


def stdlib_source_dir() -> Path:
    """The running Python's standard library: real code present on every machine."""
    return Path(sysconfig.get_paths()["stdlib"])


def collect_files(sources: list[Path], kind: str, skip_dirs: set[str] = SKIP_DIRS) -> list[Path]:
    files: list[Path] = []
    for src in sources:
        if src.is_file():
            files.append(src)
        elif src.is_dir():
            for dirpath, dirnames, names in os.walk(src):
                dirnames[:] = sorted(d for d in dirnames if d not in skip_dirs and not d.startswith("."))
                for n in sorted(names):
                    p = Path(dirpath) / n
                    if kind != "code" or p.suffix in CODE_SUFFIXES:
                        files.append(p)
        else:
            raise UserError(f"--source {src}: no such file or directory")
    files = sorted(set(files))
    if not files:
        raise UserError(f"no {kind} files found under {', '.join(map(str, sources))}")
    return files


def read_documents(files: list[Path], max_bytes: int | None) -> list[tuple[Path, str]]:
    docs, total = [], 0
    for p in files:
        try:
            text = p.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue  # binary or unreadable: not text for a language model
        if not text.strip():
            continue
        docs.append((p, text))
        total += len(text.encode("utf-8"))
        if max_bytes and total >= max_bytes:
            break
    if not docs:
        raise UserError("no readable UTF-8 text in the sources")
    return docs


def is_val(path: Path, seed: int, fraction: float) -> bool:
    h = hashlib.sha256(f"{seed}:{path}".encode()).digest()
    return int.from_bytes(h[:8], "little") / 2**64 < fraction


class ShardWriter:
    """Appends token arrays to fixed-size shards of one split."""

    def __init__(self, out: Path, split: str, dtype: np.dtype, shard_tokens: int):
        self.out, self.split, self.dtype, self.cap = out, split, dtype, shard_tokens
        self.shards: list[dict] = []
        self._buf: list[np.ndarray] = []
        self._n = 0

    def add(self, ids: list[int]) -> None:
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
        name = f"{self.split}_{len(self.shards):06d}.bin"
        path = self.out / name
        np.concatenate(self._buf).astype(self.dtype.newbyteorder("<"), copy=False).tofile(path)
        self.shards.append({"file": name, "tokens": self._n, "sha256": sha256_file(path)})
        self._buf, self._n = [], 0

    @property
    def tokens(self) -> int:
        return sum(s["tokens"] for s in self.shards) + self._n


def prepare(root: Path, name: str, kind: str, sources: list[Path] | None, tokenizer_spec: str,
            val_fraction: float = 0.05, shard_tokens: int = 16 * 1024 * 1024, max_bytes: int | None = None,
            seed: int = 1337, force: bool = False, progress: bool = True) -> Path:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    from llmcluster.data.tokenizer import encode_docs, eot_id, make_tokenizer

    if not 0.0 <= val_fraction < 1.0:
        raise UserError(f"--val-fraction must be in [0, 1), got {val_fraction}")
    if shard_tokens < 1024:
        raise UserError("--shard-tokens must be at least 1024")
    st = Storage(root)
    final = st.dataset_dir(kind, name)
    if final.exists() and not force:
        raise UserError(f"dataset {final} already exists (use --force to rebuild it)")
    st.require_writable(final.parent)
    t0 = time.time()
    src_dirs = sources or [stdlib_source_dir()]
    files = collect_files(src_dirs, kind, SKIP_DIRS if sources else SKIP_DIRS | STDLIB_DATA_DIRS)
    docs = read_documents(files, max_bytes)

    tok = make_tokenizer(tokenizer_spec, texts=lambda: (t for _, t in docs))
    vocab = tok.get_vocab_size()
    dtype = np.dtype(np.uint16 if vocab <= 2**16 else np.uint32)
    eot = eot_id(tok)

    tmp = final.parent / f".tmp-{name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        writers = {s: ShardWriter(tmp, s, dtype, shard_tokens) for s in ("train", "val")}
        n_docs = {"train": 0, "val": 0}
        with Progress(TextColumn("tokenizing"), BarColumn(), MofNCompleteColumn(), TextColumn("docs"),
                      TimeRemainingColumn(), disable=not progress, transient=True) as bar:
            task = bar.add_task("tok", total=len(docs))
            for i in range(0, len(docs), ENCODE_BATCH):
                batch = docs[i:i + ENCODE_BATCH]
                for (path, _), ids in zip(batch, encode_docs(tok, [t for _, t in batch])):
                    split = "val" if is_val(path, seed, val_fraction) else "train"
                    ids.append(eot)
                    writers[split].add(ids)
                    n_docs[split] += 1
                bar.advance(task, len(batch))
        for w in writers.values():
            w.flush()
        if not writers["train"].shards:
            raise UserError("every document went to validation: lower --val-fraction or add sources")
        tok.save(str(tmp / "tokenizer.json"))
        meta = {
            "format": "llmcluster-tokens-v1",
            "name": name, "kind": kind,
            "vocab_size": vocab, "dtype": dtype.name, "eot_id": eot,
            "tokenizer": tokenizer_spec,
            "tokens": {s: w.tokens for s, w in writers.items()},
            "documents": n_docs,
            "val_fraction": val_fraction, "seed": seed,
            "shards": {s: w.shards for s, w in writers.items()},
            "sources": [str(s) for s in src_dirs], "files": len(docs),
            "bytes": sum(len(t.encode("utf-8")) for _, t in docs),
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "seconds": round(time.time() - t0, 2),
        }
        (tmp / META).write_text(json.dumps(meta, indent=2))
        if final.exists():  # --force: swap, then delete the old one, so a crash never leaves neither
            old = final.parent / f".old-{name}-{os.getpid()}"
            final.rename(old)
            tmp.rename(final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def prepare_cli(args, root: Path) -> int:
    import sys

    sources = [Path(s) for s in args.source] if args.source else None
    out = prepare(root, args.name, args.kind, sources, args.tokenizer, args.val_fraction, args.shard_tokens,
                  args.max_bytes, args.seed, force=args.force, progress=sys.stderr.isatty())
    meta = json.loads((out / META).read_text())
    print(f"dataset {out}: {meta['files']} files, {meta['bytes'] / 1e6:.1f} MB -> "
          f"{meta['tokens']['train']:,} train + {meta['tokens']['val']:,} val tokens "
          f"(vocab {meta['vocab_size']}, {meta['dtype']}, {meta['bytes'] / max(1, sum(meta['tokens'].values())):.2f} bytes/token) "
          f"in {meta['seconds']:.1f} s")
    return 0


def verify_cli(args, root: Path) -> int:
    from llmcluster.data.dataset import open_dataset

    ds = open_dataset(root, args.name, args.kind, verify=True)
    print(f"dataset {ds.path}: {len(ds.meta['shards']['train']) + len(ds.meta['shards']['val'])} shards OK "
          f"({sum(ds.meta['tokens'].values()):,} tokens)")
    return 0
