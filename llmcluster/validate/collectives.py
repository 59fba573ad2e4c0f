"""nccl-tests with torch.distributed: time, algbw, busbw and #wrong per collective and message size.

Runs on every rank of an initialised process group (NCCL on GPUs, gloo on CPU). For each op, size and
placement: `warmup` untimed calls, a barrier, `iters` back-to-back calls timed (CUDA events on GPU, the
wall clock on CPU where gloo calls block until done), the per-rank time averaged over ranks as nccl-tests
does; then the inputs are refilled, the op runs once more and every output element is compared with the
value it must have. See nccl_semantics for what `bytes` and busbw mean per op.
"""

from __future__ import annotations

import os
import time
import warnings

import torch
import torch.distributed as dist

from llmcluster.testing import test_hook
from llmcluster.distributed import compat
from llmcluster.validate.nccl_semantics import (
    OPS, PATTERN_PERIOD, PLACEMENTS, bandwidths, element_count)
from llmcluster.validate.result import FAIL, PASS, SKIP, CheckResult, fmt_bytes

CORRUPT_ENV = "LLMCLUSTER_VALIDATE_CORRUPT"   # test hook: the last rank damages its reduction results

_all_gather = compat.all_gather_single
_reduce_scatter = compat.reduce_scatter_single


SLICE = 1 << 26   # elements per slice when filling/checking: a multi-GB buffer needs no full-size temporary


def periodic(start: int, length: int, device) -> torch.Tensor:
    """(start + i) % 97 for i < length, as float32, built by tiling 0..96 (cheap even for huge buffers)."""
    off = start % PATTERN_PERIOD
    base = torch.arange(PATTERN_PERIOD, dtype=torch.float32, device=device)
    return base.repeat((off + length) // PATTERN_PERIOD + 1)[off: off + length]


class Buffers:
    """Send/receive buffers for one op and size, laid out as nccl-tests lays them out."""

    def __init__(self, op: str, count: int, inplace: bool, rank: int, nranks: int, device):
        self.op, self.count, self.inplace, self.rank, self.n = op, count, inplace, rank, nranks
        self.chunk = count // nranks
        big = torch.empty(count, dtype=torch.float32, device=device)
        if op in ("all_reduce", "broadcast"):
            self.send = self.recv = big
        elif op == "all_gather":      # count = receive size; each rank contributes a chunk
            self.recv = big
            self.send = (big[rank * self.chunk:(rank + 1) * self.chunk] if inplace
                         else torch.empty(self.chunk, dtype=torch.float32, device=device))
        elif op == "reduce_scatter":  # count = send size; each rank keeps the sum of its chunk
            self.send = big
            self.recv = (big[rank * self.chunk:(rank + 1) * self.chunk] if inplace
                         else torch.empty(self.chunk, dtype=torch.float32, device=device))
        elif op == "all_to_all":
            self.send, self.recv = big, torch.empty_like(big)
        else:
            raise ValueError(op)
        self.device = device

    def fill(self) -> None:
        """The inputs every rank starts from (recomputed before each check: timing overwrote them)."""
        for lo in range(0, self.send.numel(), SLICE):
            hi = min(lo + SLICE, self.send.numel())
            torch.add(periodic(lo, hi - lo, self.device), self.rank + 1, out=self.send[lo:hi])

    def run(self, group=None) -> None:
        op = self.op
        if op == "all_reduce":
            dist.all_reduce(self.send, group=group)
        elif op == "broadcast":
            dist.broadcast(self.send, src=0, group=group)
        elif op == "all_gather":
            _all_gather(self.recv, self.send, group=group)
        elif op == "reduce_scatter":
            _reduce_scatter(self.recv, self.send, group=group)
        else:
            dist.all_to_all_single(self.recv, self.send, group=group)

    def expected_segments(self):
        """(out_start, length, pattern_start, scale, add): output[out_start:+length] must equal
        periodic(pattern_start, length) * scale + add. In closed form from the inputs' pattern."""
        n, r, c = self.n, self.rank, self.chunk
        total = n * (n + 1) // 2             # sum over ranks s of (s + 1)
        if self.op == "broadcast":
            return [(0, self.count, 0, 1, 1)]
        if self.op == "all_reduce":
            return [(0, self.count, 0, n, total)]
        if self.op == "reduce_scatter":      # my chunk r of the sum
            return [(0, c, r * c, n, total)]
        if self.op == "all_gather":          # output chunk s is rank s's input
            return [(s * c, c, 0, 1, s + 1) for s in range(n)]
        return [(s * c, c, r * c, 1, s + 1) for s in range(n)]   # all_to_all: chunk r of rank s's input

    def count_wrong(self) -> int:
        got = self.recv
        if test_hook(CORRUPT_ENV) == "1" and self.op in ("all_reduce", "reduce_scatter") \
                and self.rank == self.n - 1:
            got = got.clone()
            got[::1000] += 1.0    # the test hook: a reduction that came back wrong
        wrong = 0
        for out_start, length, start, scale, add in self.expected_segments():
            for lo in range(0, length, SLICE):
                m = min(SLICE, length - lo)
                want = periodic(start + lo, m, self.device).mul_(scale).add_(add)
                wrong += int((got[out_start + lo: out_start + lo + m] != want).sum().item())
        return wrong


def synchronize(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# The host clock of the CPU path; a module attribute so that a test can feed recorded timings instead of
# racing the machine (tests/test_validate_units.py).
clock = time.perf_counter


def time_collective(bufs: Buffers, warmup: int, iters: int, group=None) -> float:
    """Seconds per call on this rank (warm-up, barrier, `iters` back-to-back calls)."""
    for _ in range(warmup):
        bufs.run(group)
    synchronize(bufs.device)
    dist.barrier(group=group)
    if bufs.device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            bufs.run(group)
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / iters
    t0 = clock()
    for _ in range(iters):
        bufs.run(group)
    return (clock() - t0) / iters


def mean_over_ranks(x: float, device, group=None) -> float:
    t = torch.tensor([x], dtype=torch.float64, device=device)
    dist.all_reduce(t, group=group)
    return t.item() / dist.get_world_size(group)


def sum_over_ranks(x: int, device, group=None) -> int:
    t = torch.tensor([x], dtype=torch.int64, device=device)
    dist.all_reduce(t, group=group)
    return int(t.item())


def timed_row(bufs: Buffers, warmup: int, iters: int, group=None) -> dict:
    """The timing half of a row: time_us (mean over ranks, as nccl-tests), algbw and busbw."""
    seconds = mean_over_ranks(time_collective(bufs, warmup, iters, group), bufs.device, group)
    size = bufs.count * 4
    algbw, busbw = bandwidths(bufs.op, size, seconds, bufs.n)
    return {"op": bufs.op, "bytes": size, "count": bufs.count, "type": "float32", "inplace": bufs.inplace,
            "time_us": seconds * 1e6, "algbw_GBps": algbw, "busbw_GBps": busbw}


def check(bufs: Buffers, group=None) -> int:
    """Fresh inputs, one more call, and the number of wrong output elements summed over ranks."""
    bufs.fill()
    bufs.run(group)
    synchronize(bufs.device)
    return sum_over_ranks(bufs.count_wrong(), bufs.device, group)


def measure(op: str, nbytes: int, inplace: bool, warmup: int, iters: int, device, group=None) -> dict:
    """One row of the nccl-tests table, identical on every rank."""
    rank, n = dist.get_rank(group), dist.get_world_size(group)
    bufs = Buffers(op, element_count(nbytes, n), inplace, rank, n, device)
    bufs.fill()
    row = timed_row(bufs, warmup, iters, group)
    row["wrong"] = check(bufs, group)
    return row


def sweep(ops, sizes, warmup: int, iters: int, device, group=None, on_row=None) -> tuple[list, dict]:
    """All rows, and {op: reason} for ops this backend cannot run (e.g. an old gloo's reduce_scatter)."""
    rows, unsupported = [], {}
    warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed")
    for op in ops:
        assert op in OPS, op
        for nbytes in sizes:
            for inplace in PLACEMENTS[op]:
                try:
                    row = measure(op, nbytes, inplace, warmup, iters, device, group)
                except (RuntimeError, NotImplementedError) as e:
                    if "not supported" not in str(e).lower() and "not implemented" not in str(e).lower():
                        raise
                    unsupported[op] = " ".join(str(e).split())[:160]
                    break
                rows.append(row)
                if on_row:
                    on_row(row)
            if op in unsupported:
                break
    return rows, unsupported


def tune(sizes, warmup: int, iters: int, device) -> list[dict]:
    """all_reduce busbw for each NCCL_ALGO x NCCL_PROTO setting (NCCL reads both when a communicator is
    created, so each setting gets a new group). A setting NCCL refuses is recorded as unavailable."""
    rows = []
    for algo in ("Ring", "Tree", "NVLS", "CollnetDirect"):
        for proto in ("LL", "LL128", "Simple"):
            os.environ["NCCL_ALGO"], os.environ["NCCL_PROTO"] = algo, proto
            group = dist.new_group(backend="nccl")
            for nbytes in sizes:
                try:
                    row = measure("all_reduce", nbytes, True, warmup, iters, device, group)
                except RuntimeError as e:   # NCCL refuses the combination (e.g. NVLS without NVSwitch)
                    rows.append({"algo": algo, "proto": proto, "bytes": nbytes, "error": str(e)[:160]})
                    break
                rows.append({"algo": algo, "proto": proto, **row})
            dist.destroy_process_group(group)
    for k in ("NCCL_ALGO", "NCCL_PROTO"):
        os.environ.pop(k, None)
    return rows


def best_settings(rows: list[dict]) -> list[dict]:
    """Per message size, the NCCL_ALGO/NCCL_PROTO with the highest busbw."""
    best: dict[int, dict] = {}
    for r in rows:
        if "busbw_GBps" in r and r["wrong"] == 0 and (r["bytes"] not in best
                                                      or r["busbw_GBps"] > best[r["bytes"]]["busbw_GBps"]):
            best[r["bytes"]] = r
    return [best[b] for b in sorted(best)]


def summarize(rows: list[dict], unsupported: dict, spec, backend: str, world_size: int,
              warmup: int, iters: int, tuned: list[dict] | None = None) -> CheckResult:
    """The collectives CheckResult: #wrong per op (any is FAIL), busbw at the largest size, the gate."""
    r = CheckResult("collectives")
    algo = os.environ.get("NCCL_ALGO")
    r.data = {"backend": backend, "world_size": world_size, "warmup": warmup, "iters": iters,
              "nccl_algo": algo, "nccl_proto": os.environ.get("NCCL_PROTO"), "results": rows}
    for op in OPS:
        if op in unsupported:
            r.add(op, SKIP, detail=f"{backend} cannot run it: {unsupported[op]}")
            continue
        mine = [x for x in rows if x["op"] == op]
        if not mine:
            continue
        wrong = sum(x["wrong"] for x in mine)
        top = max(x["bytes"] for x in mine)
        best = max((x for x in mine if x["bytes"] == top), key=lambda x: x["busbw_GBps"])
        value = f"{best['busbw_GBps']:.2f} GB/s @ {fmt_bytes(top)}"
        if wrong:
            bad = sorted({(fmt_bytes(x["bytes"]), "in-place" if x["inplace"] else "out-of-place")
                          for x in mine if x["wrong"]})
            r.add(op, FAIL, value, f"{wrong} wrong elements ({', '.join(f'{s} {p}' for s, p in bad[:4])})")
        elif op == "all_reduce" and spec.min_busbw_GBps:
            ok = best["busbw_GBps"] >= spec.min_busbw_GBps
            r.add(op, PASS if ok else FAIL, value,
                  f"busbw {'>=' if ok else '<'} {spec.min_busbw_GBps:g} GB/s expected; NCCL_ALGO={algo or 'auto'}")
        else:
            note = "" if backend != "nccl" or algo == "Ring" else \
                "; NCCL_ALGO unset: busbw is only comparable with link bandwidth for Ring"
            r.add(op, PASS, value, f"0 wrong over {len(mine)} measurements{note}")
    if tuned is not None:
        r.data["tune"] = tuned
        for b in best_settings(tuned):
            r.add(f"tune {fmt_bytes(b['bytes'])}", PASS, f"{b['busbw_GBps']:.2f} GB/s",
                  f"best: NCCL_ALGO={b['algo']} NCCL_PROTO={b['proto']}")
    return r
