"""Does `llmcluster validate collectives` measure what a minimal hand-written loop measures?

Run under torchrun (2+ ranks): at one message size (default 64 MiB), alternately time all_reduce with
validate's own `measure()` and with the plainest loop there is

    barrier; t0 = perf_counter(); for _ in range(iters): dist.all_reduce(buf); t = (perf_counter() - t0) / iters

then convert both to busbw with the nccl-tests factor and compare the medians over `--reps` rounds.
Interleaving and medians make the comparison fair on a noisy shared machine: whatever slows one round
slows both methods in it. Rank 0 prints the ratio and writes it to --json.

    torchrun --standalone --nproc-per-node 2 benchmarks/collectives_vs_handtimed.py --json out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist

from llmcluster.validate.collectives import measure
from llmcluster.validate.distributed import init_process_group, shutdown
from llmcluster.validate.nccl_semantics import bandwidths, parse_size


def hand_timed(nbytes: int, warmup: int, iters: int, device) -> float:
    buf = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    for _ in range(warmup):
        dist.all_reduce(buf)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        dist.all_reduce(buf)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - t0) / iters


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--size", default="64M")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--json")
    a = p.parse_args()
    device = init_process_group()
    n, nbytes = dist.get_world_size(), parse_size(a.size)
    ours, hand = [], []
    for rep in range(a.reps):
        # alternate which goes first, so neither always gets the warmer machine
        for which in (("ours", "hand") if rep % 2 == 0 else ("hand", "ours")):
            if which == "ours":
                row = measure("all_reduce", nbytes, True, a.warmup, a.iters, device)
                ours.append(row["busbw_GBps"])
                assert row["wrong"] == 0, row
            else:
                hand.append(bandwidths("all_reduce", nbytes, hand_timed(nbytes, a.warmup, a.iters, device), n)[1])
    if dist.get_rank() == 0:
        out = {"bytes": nbytes, "world_size": n, "backend": dist.get_backend(), "reps": a.reps,
               "iters": a.iters, "validate_busbw_GBps": ours, "hand_busbw_GBps": hand,
               "validate_median": statistics.median(ours), "hand_median": statistics.median(hand)}
        out["ratio"] = out["validate_median"] / out["hand_median"]
        print(f"all_reduce {a.size} x {n} ranks ({out['backend']}): validate busbw {out['validate_median']:.3f} "
              f"GB/s, hand-timed {out['hand_median']:.3f} GB/s, ratio {out['ratio']:.3f}", flush=True)
        if a.json:
            with open(a.json, "w") as f:
                json.dump(out, f, indent=2)
    shutdown()


if __name__ == "__main__":
    main()
