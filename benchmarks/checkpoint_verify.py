"""Resume verification time against checkpoint size and rank count: one rank hashing everything (what
main did: rank 0 alone, every other rank waiting under dist.timeout_s) vs each rank hashing its own share
(`newest_verified_checkpoint` with the save's ownership rule, one all-gather of verdicts).

A real DCP checkpoint of a small model is written, then padded with one shard per saving rank
(`__<r>_0.distcp`, random bytes) to the wanted size and re-sealed, as a checkpoint saved by `--shards`
ranks would be. Every measurement runs the real verification code in real processes (gloo); the files
are read once first so every configuration reads from the page cache (the ratio is then the hashing's,
the part that parallelises; on a shared filesystem reads add to both sides).

    python benchmarks/checkpoint_verify.py --sizes 64M,256M --ranks 1,2,4 --shards 4
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from llmcluster.storage.layout import COMPLETE_MARKER, Storage, sha256_file
from llmcluster.checkpoint.checkpointer import Checkpointer, newest_verified_checkpoint


def parse_size(s: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(float(s[:-1]) * units[s[-1].upper()]) if s[-1].upper() in units else int(s)


def make_checkpoint(root: Path, size: int, shards: int) -> Path:
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.AdamW(model.parameters())
    ck = Checkpointer(Storage(root), "bench", 0, 1, log=lambda *_: None)
    step = ck.save(1, model, opt, {})
    per = size // shards
    for r in range(shards):
        with open(step / f"__{r}_1.distcp", "wb") as f:  # beside DCP's own __0_0.distcp
            for _ in range(per >> 24):
                f.write(os.urandom(1 << 24))
            f.write(os.urandom(per % (1 << 24)))
    marker = json.loads((step / COMPLETE_MARKER).read_text())
    marker["files"] = {str(f.relative_to(step)): sha256_file(f) for f in sorted(step.rglob("*"))
                       if f.is_file() and f.name != COMPLETE_MARKER}
    (step / COMPLETE_MARKER).write_text(json.dumps(marker))
    return step


def worker(rank: int, world: int, root: str, store: str, out: str, repeats: int) -> None:
    torch.set_num_threads(1)
    if world > 1:
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    times = []
    for _ in range(repeats):
        if world > 1:
            dist.barrier()
        t0 = time.perf_counter()
        found = newest_verified_checkpoint(Storage(Path(root)), "bench", print, rank, world)
        times.append(time.perf_counter() - t0)
        assert found is not None
    if rank == 0:
        Path(out).write_text(json.dumps(times))
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()


def measure(root: Path, world: int, repeats: int) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "times.json"
        mp.start_processes(worker, args=(world, str(root), str(Path(tmp) / "store"), str(out), repeats),
                           nprocs=world, start_method="spawn", join=True)
        return min(json.loads(out.read_text()))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--sizes", default="64M,256M")
    p.add_argument("--ranks", default="1,2,4")
    p.add_argument("--shards", type=int, default=4, help="ranks that saved the checkpoint (files to share)")
    p.add_argument("--repeats", type=int, default=3, help="timings per configuration; the minimum is kept")
    a = p.parse_args()
    ranks = [int(r) for r in a.ranks.split(",")]
    print(f"cores: {len(os.sched_getaffinity(0))}; a checkpoint saved by {a.shards} ranks; minimum of "
          f"{a.repeats} runs; page cache warm")
    print(f"{'size':>8} {'ranks':>5} {'verify s':>9} {'GB/s':>6} {'vs 1 rank':>9}")
    for size_s in a.sizes.split(","):
        size = parse_size(size_s)
        with tempfile.TemporaryDirectory() as tmp:
            step = make_checkpoint(Path(tmp), size, a.shards)
            for f in step.rglob("*"):  # warm the page cache for every configuration alike
                if f.is_file():
                    f.read_bytes()
            base = None
            for world in ranks:
                t = measure(Path(tmp), world, a.repeats)
                base = base or t
                print(f"{size_s:>8} {world:>5} {t:9.3f} {size / t / 1e9:6.2f} {base / t:8.2f}x", flush=True)


if __name__ == "__main__":
    main()
