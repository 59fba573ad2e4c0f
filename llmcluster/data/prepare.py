"""`llmcluster data prepare` / `data merge`: sources -> tokenizer.json + token shards + meta.json.

Layout of datasets/<kind>/<name>/:
    tokenizer.json              the tokenizer (HF `tokenizers` format; an HF model's tokenizer_config.json too)
    train_000000.bin ...        flat token ids, little-endian uint16 (vocab <= 65536) or uint32
    val_000000.bin ...
    meta.json                   vocab size, dtype, BOS/EOS, token and document counts, per-shard sha256, sources

A document is a plain file or one record of a record corpus (see sources.py); it becomes [BOS] + ids + [EOS].
Documents go to train or val by a seeded hash of their key, so the split does not move when files are added.
The corpus is streamed: documents are read, tokenized (in `workers` processes) and written a batch at a time,
so memory is bounded by the batches in flight and one shard per split. A BPE is trained on the first
`tokenizer_sample_bytes` of the whole source list - the same sample whichever slice is being prepared.

`--shard I/N` prepares slice I (a contiguous run of source files) into scratch/; `data merge` re-cuts the slices'
token streams, in slice order, into shards - the same bytes a one-pass prepare writes. Everything is written
into a temporary directory and renamed into place at the end: a crash leaves no half dataset behind.
"""

from __future__ import annotations

import json
import os
import shutil
import sysconfig
import time
from collections import deque
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from llmcluster.data.shards import FORMAT, META, ShardWriter, is_val, publish, token_dtype
from llmcluster.data.sources import MAX_RECORD_BYTES, SKIP_DIRS, collect_units, iter_documents, shard_slice
from llmcluster.errors import UserError, remove_failed_write
from llmcluster.storage.layout import Storage, sha256_file

# The stdlib's generated data tables (pydoc's topic texts, codec maps) are megabytes of string literals, not code
# anyone writes: left in, a tiny model spends its few minutes learning to continue them.
STDLIB_DATA_DIRS = {"pydoc_data", "encodings"}
ENCODE_BATCH = 256  # documents per encode_batch call: big enough to keep every core busy
TOKENIZER_SAMPLE_BYTES = 100_000_000


def stdlib_source_dir() -> Path:
    """The running Python's standard library: real code present on every machine."""
    return Path(sysconfig.get_paths()["stdlib"])


def parse_shard(text: str | None) -> tuple[int, int] | None:
    if text is None:
        return None
    try:
        i, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise UserError(f"--shard {text!r}: expected I/N (slice I of N, 0 <= I < N)") from None
    if not 0 <= i < n:
        raise UserError(f"--shard {text}: need 0 <= I < N")
    return i, n


def slice_dir(st: Storage, kind: str, name: str, i: int, n: int) -> Path:
    return st.scratch(f"data-{name}") / kind / f"slice-{i:05d}-of-{n:05d}"


def _bounded(docs, max_bytes: int | None):
    """(key, segments) documents until max_bytes of their text have gone by."""
    total = 0
    for key, segs in docs:
        yield key, segs
        total += sum(len(t.encode("utf-8")) for t, _ in segs)
        if max_bytes and total >= max_bytes:
            return


# -- tokenizing, in this process or in worker processes ------------------------------------------------
_WORKER_TOK = None


def _init_worker(tok_json: str) -> None:
    global _WORKER_TOK
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one core per worker: the workers are the parallelism
    from tokenizers import Tokenizer

    _WORKER_TOK = Tokenizer.from_str(tok_json)


def _encode(tok, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """A batch of texts -> (all ids concatenated, per-text lengths): two arrays pickle far faster than lists."""
    encs = (tok or _WORKER_TOK).encode_batch(texts, add_special_tokens=False)
    parts = [np.asarray(e.ids, dtype=np.uint32) for e in encs]
    lengths = np.array([len(p) for p in parts], dtype=np.int64)
    return (np.concatenate(parts) if parts else np.zeros(0, np.uint32)), lengths


def _batches(docs):
    batch = []
    for d in docs:
        batch.append(d)
        if len(batch) == ENCODE_BATCH:
            yield batch
            batch = []
    if batch:
        yield batch


def _texts(batch) -> list[str]:
    return [t for _, segs in batch for t, _ in segs]


def _split(batch, flat: np.ndarray, lengths: np.ndarray, masked: bool):
    """Regroup a batch's encoded segments per document: (key, bytes, ids, loss mask or None)."""
    ends = np.cumsum(lengths)
    j = 0
    for key, segs in batch:
        n = len(segs)
        lo = int(ends[j - 1]) if j else 0
        hi = int(ends[j + n - 1]) if n else lo
        mask = None
        if masked:
            mask = np.repeat(np.array([tr for _, tr in segs], dtype=np.uint8), lengths[j: j + n])
        yield key, sum(len(t.encode("utf-8")) for t, _ in segs), flat[lo:hi], mask
        j += n


def encoded_documents(tok, docs, workers: int, masked: bool = False):
    """docs: (key, [(text, trained), ...]) -> (key, n_bytes, ids, mask) in input order; at most 2 batches per
    worker in flight."""
    if workers <= 1:
        for batch in _batches(docs):
            yield from _split(batch, *_encode(tok, _texts(batch)), masked)
        return
    import multiprocessing as mp

    # spawn, not fork: a forked child inherits the parent's tokenizers thread pool in an undefined state.
    with mp.get_context("spawn").Pool(workers, initializer=_init_worker, initargs=(tok.to_str(),)) as pool:
        pending: deque = deque()
        for batch in _batches(docs):
            pending.append((batch, pool.apply_async(_encode, (None, _texts(batch)))))
            if len(pending) >= 2 * workers:
                batch, res = pending.popleft()
                yield from _split(batch, *res.get(), masked)
        while pending:
            batch, res = pending.popleft()
            yield from _split(batch, *res.get(), masked)


# -- prepare -------------------------------------------------------------------------------------------
def prepare(root: Path, name: str, kind: str, sources: list[Path] | None, tokenizer_spec: str,
            val_fraction: float = 0.05, shard_tokens: int = 16 * 1024 * 1024, max_bytes: int | None = None,
            seed: int = 1337, force: bool = False, progress: bool = True, text_field: str = "text",
            workers: int = 1, tokenizer_sample_bytes: int = TOKENIZER_SAMPLE_BYTES,
            shard: tuple[int, int] | None = None, fmt: str = "text",
            max_record_bytes: int = MAX_RECORD_BYTES) -> Path:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    from llmcluster.data.tokenizer import make_tokenizer

    chat = fmt == "chat"
    text_field = text_field or ("messages" if chat else "text")

    if not 0.0 <= val_fraction < 1.0:
        raise UserError(f"--val-fraction must be in [0, 1), got {val_fraction}")
    if shard_tokens < 1024:
        raise UserError("--shard-tokens must be at least 1024")
    if workers < 1:
        raise UserError("--workers must be at least 1")
    if tokenizer_sample_bytes < 1:
        raise UserError("--tokenizer-sample-bytes must be at least 1")
    if max_record_bytes < 1:
        raise UserError("--max-record-bytes must be at least 1")
    if shard is not None and max_bytes:
        raise UserError("--max-bytes cannot be combined with --shard (each slice would stop at its own limit)")
    st = Storage(root)
    final = slice_dir(st, kind, name, *shard) if shard else st.dataset_dir(kind, name)
    if final.exists() and not force:
        raise UserError(f"{'slice' if shard else 'dataset'} {final} already exists (use --force to rebuild it)")
    st.require_writable(final.parent)
    t0 = time.time()
    src_dirs = sources or [stdlib_source_dir()]
    all_units = collect_units(src_dirs, kind, SKIP_DIRS if sources else SKIP_DIRS | STDLIB_DATA_DIRS)
    units = shard_slice(all_units, shard)

    # The tokenizer's sample is drawn from the whole source list, so every slice trains the same tokenizer.
    sample_limit = min(tokenizer_sample_bytes, max_bytes or tokenizer_sample_bytes)
    renderer = None

    def segmented(docs):  # (key, [(text, trained)]): a text document is one trained segment
        for key, value in docs:
            yield key, (renderer.segments(value, key) if chat else [(value, True)])

    if chat:  # a BPE trained here has no chat template: the documented default renders, its markers special
        from llmcluster.data.chat import CHAT_MARKERS, ChatRenderer
        renderer = ChatRenderer(None, None, None, max_record_bytes)
    dtok = make_tokenizer(tokenizer_spec, texts=lambda: (
        "".join(t for t, _ in segs) for _, segs in
        _bounded(segmented(iter_documents(all_units, text_field, chat, max_record_bytes)), sample_limit)),
        specials=CHAT_MARKERS if chat else ())
    if chat:
        conf = json.loads(dtok.hf_files.get("tokenizer_config.json", "{}"))
        tok_text = dtok.tok.id_to_token
        renderer = ChatRenderer(conf.get("chat_template") if isinstance(conf.get("chat_template"), str) else None,
                                tok_text(dtok.bos_id) if dtok.bos_id is not None else None, tok_text(dtok.eos_id),
                                max_record_bytes)
    vocab = dtok.vocab_size()
    dtype = token_dtype(vocab)

    tmp = final.parent / f".tmp-{final.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        writers = {s: ShardWriter(tmp, s, dtype, shard_tokens) for s in ("train", "val")}
        masks = {s: ShardWriter(tmp, s, np.dtype(np.uint8), shard_tokens, ".mask") for s in ("train", "val")} \
            if chat else {}
        n_docs, n_bytes = {"train": 0, "val": 0}, 0
        with Progress(TextColumn("tokenizing"), BarColumn(), MofNCompleteColumn(), TextColumn("files"),
                      TimeRemainingColumn(), disable=not progress, transient=True) as bar:
            task = bar.add_task("tok", total=len(units))
            read = {"units": 0, "with_text": 0}

            def docs():
                for u in units:
                    n = 0
                    for doc in segmented(iter_documents([u], text_field, chat, max_record_bytes)):
                        n += 1
                        yield doc
                    read["units"] += 1
                    read["with_text"] += n > 0
                    bar.update(task, completed=read["units"])

            bos = np.array([] if dtok.bos_id is None else [dtok.bos_id], dtype=np.uint32)
            eos = np.array([dtok.eos_id], dtype=np.uint32)
            for key, nb, ids, mask in encoded_documents(dtok.tok, _bounded(docs(), max_bytes), workers, chat):
                split = "val" if is_val(key, seed, val_fraction) else "train"
                head = bos if not (len(bos) and len(ids) and ids[0] == bos[0]) else bos[:0]  # template's own BOS
                writers[split].add(np.concatenate([head, ids, eos]))
                if chat:  # BOS never a target; EOS is when the conversation ends on a reply (learn to stop)
                    end = mask[-1:] if len(mask) else np.zeros(1, np.uint8)
                    masks[split].add(np.concatenate([np.zeros(len(head), np.uint8), mask, end]))
                n_docs[split] += 1
                n_bytes += nb
        for w in (*writers.values(), *masks.values()):
            w.flush()
        if not n_docs["train"] + n_docs["val"] and not shard:
            raise UserError("no readable UTF-8 text in the sources")
        if not writers["train"].shards and not shard:
            raise UserError("every document went to validation: lower --val-fraction or add sources")
        dtok.tok.save(str(tmp / "tokenizer.json"))
        for fname, text in dtok.hf_files.items():
            (tmp / fname).write_text(text)
        meta = {
            "format": FORMAT,
            "name": name, "kind": kind,
            "vocab_size": vocab, "dtype": dtype.name, "eot_id": dtok.eos_id, "bos_id": dtok.bos_id,
            "tokenizer": tokenizer_spec, "text_field": text_field,
            "tokens": {s: w.tokens for s, w in writers.items()},
            "documents": n_docs,
            "val_fraction": val_fraction, "seed": seed, "shard_tokens": shard_tokens,
            "shards": {s: w.shards for s, w in writers.items()},
            "format_in": fmt, "masks": {s: w.shards for s, w in masks.items()} if chat else None,
            "sources": [str(s) for s in src_dirs], "files": read["with_text"], "bytes": n_bytes,
            "slice": list(shard) if shard else None,
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "seconds": round(time.time() - t0, 2),
        }
        (tmp / META).write_text(json.dumps(meta, indent=2))
        publish(tmp, final)
    except BaseException as e:
        remove_failed_write(e, tmp, f"dataset {name}", _intact(final))
        raise
    return final


def _intact(final: Path) -> str:
    """What a failed prepare or merge left as it was (the disk-full line names only what exists)."""
    what = f"the existing {final} is intact" if final.exists() else "nothing else was written"
    return f"the partial write is removed; {what}"


# -- merge ---------------------------------------------------------------------------------------------
def _read_slice(d: Path) -> dict:
    try:
        return json.loads((d / META).read_text())
    except (OSError, ValueError) as e:
        raise UserError(f"slice {d}: unreadable {META} ({e})") from None


def merge(root: Path, name: str, kind: str, n: int | None = None, force: bool = False) -> Path:
    """Seal the slices of `name` into one dataset: every slice present and verified, one tokenizer, one meta."""
    st = Storage(root)
    base = st.scratch(f"data-{name}") / kind
    dirs = sorted(base.glob("slice-*-of-*")) if base.is_dir() else []
    if not dirs:
        raise UserError(f"no slices of {name!r} under {base} (run `data prepare --shard I/N` first)")
    counts = {int(d.name.rsplit("-", 1)[1]) for d in dirs}
    if len(counts) != 1 or (n is not None and counts != {n}):
        raise UserError(f"slices of {name!r} under {base} disagree on N ({sorted(counts)}): remove the stale ones")
    n = counts.pop()
    have = {int(d.name.split("-")[1]) for d in dirs}
    if missing := sorted(set(range(n)) - have):
        raise UserError(f"slices of {name!r}: {len(missing)} of {n} missing (first: {missing[0]}/{n})")
    metas = [_read_slice(d) for d in dirs]
    tok_sha = {sha256_file(d / "tokenizer.json") for d in dirs}
    if len(tok_sha) != 1:
        raise UserError(f"slices of {name!r} were tokenized with different tokenizers: prepare them with the "
                        "same --tokenizer (a trained BPE needs the same sources and --tokenizer-sample-bytes)")
    m0 = metas[0]
    keys = ("vocab_size", "dtype", "eot_id", "bos_id", "val_fraction", "seed", "shard_tokens", "sources")
    for d, m in zip(dirs, metas):
        if any(m.get(k) != m0.get(k) for k in keys):
            bad = next(k for k in keys if m.get(k) != m0.get(k))
            raise UserError(f"slice {d}: {bad} differs from slice 0 ({m.get(bad)!r} vs {m0.get(bad)!r})")
    final = st.dataset_dir(kind, name)
    if final.exists() and not force:
        raise UserError(f"dataset {final} already exists (use --force to rebuild it)")
    st.require_writable(final.parent)
    t0 = time.time()
    dtype = np.dtype(m0["dtype"]).newbyteorder("<")
    tmp = final.parent / f".tmp-{name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        cap = int(m0["shard_tokens"])
        streams = [("shards", {s: ShardWriter(tmp, s, np.dtype(m0["dtype"]), cap) for s in ("train", "val")},
                    dtype)]
        if m0.get("masks"):  # chat data: the loss masks are re-cut at the same places as the tokens
            streams.append(("masks", {s: ShardWriter(tmp, s, np.dtype(np.uint8), cap, ".mask")
                                      for s in ("train", "val")}, np.dtype(np.uint8)))
        for d, m in zip(dirs, metas):
            for key, ws, dt in streams:
                for split, w in ws.items():
                    for spec in (m.get(key) or {}).get(split, []):
                        f = d / spec["file"]
                        if not f.is_file() or sha256_file(f) != spec["sha256"]:
                            raise UserError(f"slice {d}: {spec['file']} is missing or corrupt (sha256)")
                        w.add(np.fromfile(f, dtype=dt))
        writers = streams[0][1]
        for _, ws, _ in streams:
            for w in ws.values():
                w.flush()
        if not writers["train"].shards:
            raise UserError(f"slices of {name!r} hold no training tokens")
        for f in dirs[0].iterdir():
            if f.suffix == ".json" and f.name != META:
                shutil.copy(f, tmp / f.name)
        total = lambda k: sum(m[k] for m in metas)  # noqa: E731
        meta = {**{k: m0[k] for k in ("format", "name", "kind", "vocab_size", "dtype", "eot_id", "bos_id",
                                      "tokenizer", "text_field", "val_fraction", "seed", "shard_tokens")},
                "tokens": {s: w.tokens for s, w in writers.items()},
                "documents": {s: sum(m["documents"][s] for m in metas) for s in ("train", "val")},
                "shards": {s: w.shards for s, w in writers.items()}, "format_in": m0.get("format_in", "text"),
                "masks": {s: w.shards for s, w in streams[1][1].items()} if len(streams) > 1 else None,
                "sources": m0["sources"], "files": total("files"), "bytes": total("bytes"),
                "slice": None, "merged_slices": n,
                "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "seconds": round(time.time() - t0 + sum(m["seconds"] for m in metas), 2)}
        (tmp / META).write_text(json.dumps(meta, indent=2))
        publish(tmp, final)
    except BaseException as e:
        remove_failed_write(e, tmp, f"dataset {name}", _intact(final) + f"; its {n} slices are intact")
        raise
    # The slices are in the dataset now (verified on the way in). Only they go: scratch/data-<name>/ also
    # holds the slices of the name's other kinds, and a slice still being written (.tmp-*) is not ours.
    for d in dirs:
        shutil.rmtree(d)
    for d in (base, base.parent):
        try:
            d.rmdir()
        except OSError:  # not empty: another kind's slices, or work in progress
            break
    return final


def _summary(out: Path) -> str:
    meta = json.loads((out / META).read_text())
    toks = sum(meta["tokens"].values())
    docs = sum(meta["documents"].values())
    return (f"{out}: {meta['files']} files, {docs:,} documents, {meta['bytes'] / 1e6:.1f} MB -> "
            f"{meta['tokens']['train']:,} train + {meta['tokens']['val']:,} val tokens "
            f"(vocab {meta['vocab_size']}, {meta['dtype']}, {meta['bytes'] / max(1, toks):.2f} bytes/token) "
            f"in {meta['seconds']:.1f} s")


def _warn_without_validation(out: Path) -> None:
    """A dataset without validation tokens trains, but nothing measures it: say so where it is made."""
    import sys

    meta = json.loads((out / META).read_text())
    if not meta["tokens"]["val"]:
        print(f"warning: {out.name} has no validation tokens ({sum(meta['documents'].values())} document(s), "
              f"--val-fraction {meta['val_fraction']}): documents go to val whole, by a hash; add documents "
              "for a validation loss", file=sys.stderr)


def prepare_cli(args, root: Path) -> int:
    import sys

    sources = [Path(s) for s in args.source] if args.source else None
    shard = parse_shard(args.shard)
    out = prepare(root, args.name, args.kind, sources, args.tokenizer, args.val_fraction, args.shard_tokens,
                  args.max_bytes, args.seed, force=args.force, progress=sys.stderr.isatty(),
                  text_field=args.text_field, workers=args.workers,
                  tokenizer_sample_bytes=args.tokenizer_sample_bytes, shard=shard, fmt=args.format,
                  max_record_bytes=args.max_record_bytes)
    print(("slice " if shard else "dataset ") + _summary(out))
    if not shard:
        _warn_without_validation(out)
    return 0


def merge_cli(args, root: Path) -> int:
    out = merge(root, args.name, args.kind, force=args.force)
    print("dataset " + _summary(out))
    _warn_without_validation(out)
    return 0
