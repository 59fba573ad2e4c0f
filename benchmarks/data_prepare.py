"""`data prepare` tokens/s with 1 and N workers, against a bare `tokenizers` encode_batch loop on the same text.

The corpus is the running Python's standard library, one .jsonl.zst record per source file (real text on every
machine); the tokenizer is a byte-level BPE trained once beforehand, so only reading, tokenizing and writing
are timed. The reference holds every text in memory and calls `Tokenizer.encode_batch` over batches of the
same size prepare uses (tokenizers' own thread pool on every core) - the ceiling for a streaming prepare that
also decompresses, parses JSON, splits train/val, hashes and writes shards. Rounds alternate A B C, C B A so
a drift in machine load hits every method alike; medians are compared.

    python benchmarks/data_prepare.py [--max-mb 8] [--workers 2] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sysconfig
import tempfile
import time
from pathlib import Path


def corpus(out: Path, max_bytes: int) -> tuple[Path, list[str]]:
    import zstandard

    texts, total = [], 0
    for f in sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py")):
        if "site-packages" in f.parts:
            continue
        try:
            t = f.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if t.strip():
            texts.append(t)
            total += len(t.encode())
        if total >= max_bytes:
            break
    path = out / "stdlib.jsonl.zst"
    path.write_bytes(zstandard.ZstdCompressor().compress(
        "".join(json.dumps({"text": t}) + "\n" for t in texts).encode()))
    return path, texts


def bare_loop(tok_path: Path, texts: list[str], batch: int) -> tuple[int, float]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tok_path))
    t0 = time.perf_counter()
    n = 0
    for i in range(0, len(texts), batch):
        n += sum(len(e.ids) + 1 for e in tok.encode_batch(texts[i:i + batch], add_special_tokens=False))
    return n, time.perf_counter() - t0


def prepare_run(root: Path, src: Path, tok_path: Path, workers: int) -> tuple[int, float]:
    from llmcluster.data.prepare import prepare

    t0 = time.perf_counter()
    out = prepare(root, "bench", "text", [src], str(tok_path), force=True, progress=False, workers=workers)
    dt = time.perf_counter() - t0
    meta = json.loads((out / "meta.json").read_text())
    return sum(meta["tokens"].values()), dt


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--max-mb", type=float, default=8.0)
    p.add_argument("--workers", type=int, default=os.cpu_count() or 2)
    p.add_argument("--rounds", type=int, default=2)
    a = p.parse_args()
    from llmcluster.data.prepare import ENCODE_BATCH
    from llmcluster.data.tokenizer import train_bpe

    tmp = Path(tempfile.mkdtemp(prefix="bench-data-"))
    try:
        src, texts = corpus(tmp, int(a.max_mb * 1e6))
        tok_path = tmp / "tokenizer.json"
        train_bpe(texts[:200], 4096).save(str(tok_path))
        mb = sum(len(t.encode()) for t in texts) / 1e6
        methods = {"bare encode_batch": lambda: bare_loop(tok_path, texts, ENCODE_BATCH),
                   "prepare --workers 1": lambda: prepare_run(tmp / "s", src, tok_path, 1),
                   f"prepare --workers {a.workers}": lambda: prepare_run(tmp / "s", src, tok_path, a.workers)}
        rates: dict[str, list[float]] = {k: [] for k in methods}
        tokens: dict[str, int] = {}
        order = list(methods)
        for r in range(a.rounds):
            for k in (order if r % 2 == 0 else order[::-1]):
                n, dt = methods[k]()
                tokens[k] = n
                rates[k].append(n / dt)
        ref = statistics.median(rates["bare encode_batch"])
        print(f"corpus: {len(texts)} stdlib files, {mb:.1f} MB as one .jsonl.zst; {os.cpu_count()} CPUs; "
              f"median of {a.rounds} rounds")
        for k in order:
            med = statistics.median(rates[k])
            print(f"{k:24s} {tokens[k]:>11,} tokens {med:>12,.0f} tokens/s   ratio to bare {med / ref:.2f}")
        assert len(set(tokens.values())) == 1, f"methods disagree on the token count: {tokens}"
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
