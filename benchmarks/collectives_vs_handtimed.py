"""Does `llmcluster validate collectives` measure what a minimal hand-written loop measures?

Run under torchrun (2+ ranks). At one message size (default 64 MiB) all_reduce is timed two ways,
alternately: with validate's own timing (`timed_row`: the function whose time_us/algbw/busbw the
report prints) and with the plainest loop there is

    barrier; t0 = perf_counter(); for _ in range(iters): dist.all_reduce(buf); t = (perf_counter() - t0) / iters

both converted to busbw with the nccl-tests factor. On a shared machine single timings vary by 2-3x, so
the rounds go A B B A (a drift in load hits both methods equally), both buffers are allocated once,
and the medians over all rounds are compared. validate's result check runs once at the end.

    torchrun --standalone --nproc-per-node 2 benchmarks/collectives_vs_handtimed.py --json out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist

from llmcluster.validate.collectives import Buffers, check, synchronize, timed_row
from llmcluster.validate.distributed import init_process_group, shutdown
from llmcluster.validate.nccl_semantics import bandwidths, element_count, parse_size


def hand_timed(buf: torch.Tensor, iters: int) -> float:
    synchronize(buf.device)
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        dist.all_reduce(buf)
    synchronize(buf.device)
    return (time.perf_counter() - t0) / iters


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--size", default="64M")
    p.add_argument("--rounds", type=int, default=10, help="A B B A rounds: 2 samples per method each")
    p.add_argument("--iters", type=int, default=1, help="calls per sample")
    p.add_argument("--json")
    a = p.parse_args()
    device = init_process_group()
    rank, n = dist.get_rank(), dist.get_world_size()
    count = element_count(parse_size(a.size), n)
    bufs = Buffers("all_reduce", count, True, rank, n, device)
    bufs.fill()
    buf = torch.ones(count, dtype=torch.float32, device=device)
    for _ in range(2):   # warm both paths up once; the samples below need no per-sample warm-up
        bufs.run()
        dist.all_reduce(buf)
    ours, hand = [], []
    for _ in range(a.rounds):
        for which in ("ours", "hand", "hand", "ours"):
            if which == "ours":
                ours.append(timed_row(bufs, 0, a.iters)["busbw_GBps"])
            else:
                hand.append(bandwidths("all_reduce", count * 4, hand_timed(buf, a.iters), n)[1])
    wrong = check(bufs)
    if rank == 0:
        out = {"bytes": count * 4, "world_size": n, "backend": dist.get_backend(), "rounds": a.rounds,
               "iters": a.iters, "wrong": wrong, "validate_busbw_GBps": ours, "hand_busbw_GBps": hand,
               "validate_median": statistics.median(ours), "hand_median": statistics.median(hand)}
        out["ratio"] = out["validate_median"] / out["hand_median"]
        print(f"all_reduce {a.size} x {n} ranks ({out['backend']}): validate busbw {out['validate_median']:.3f} "
              f"GB/s, hand-timed {out['hand_median']:.3f} GB/s, ratio {out['ratio']:.3f}, wrong {wrong}", flush=True)
        if a.json:
            with open(a.json, "w") as f:
                json.dump(out, f, indent=2)
    shutdown()


if __name__ == "__main__":
    main()
