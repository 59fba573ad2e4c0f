"""nccl-tests semantics, without torch: message sizes, buffer shapes, bus bandwidth, the data pattern.

Follows nccl-tests' doc/PERFORMANCE.md so our numbers read like theirs:
  * `bytes` is the size nccl-tests prints: the all_reduce/broadcast buffer, the all_gather *receive*
    buffer, the reduce_scatter *send* buffer, the all_to_all buffer (each rank sends bytes/n to each peer);
  * algbw = bytes / time; busbw = algbw x factor, the factor making busbw comparable to the hardware's
    link bandwidth whatever the rank count: all_reduce 2(n-1)/n; all_gather, reduce_scatter and
    all_to_all (n-1)/n; broadcast 1;
  * GB/s are 1e9 bytes per second.
Every rank's input is a small-integer pattern, so any sum over ranks is exact in fp32 and a result can be
checked element by element (`wrong` counts the elements that differ, summed over ranks).
"""

from __future__ import annotations

import re

from llmcluster.errors import UserError

OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all")
ELEMENT_BYTES = 4          # float32, nccl-tests' default type
PATTERN_PERIOD = 97        # input[r][i] = i % 97 + r + 1: small integers, exact sums in fp32

# torch exposes all_reduce and broadcast in place only, and all_to_all out of place only (NCCL has
# no in-place all-to-all); all_gather and reduce_scatter are timed both ways like nccl-tests does.
PLACEMENTS = {"all_reduce": (True,), "broadcast": (True,), "all_to_all": (False,),
              "all_gather": (False, True), "reduce_scatter": (False, True)}


def bus_factor(op: str, nranks: int) -> float:
    n = nranks
    if op == "all_reduce":
        return 2 * (n - 1) / n
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n
    if op == "broadcast":
        return 1.0
    raise ValueError(f"unknown collective {op!r}")


def bandwidths(op: str, nbytes: int, seconds: float, nranks: int) -> tuple[float, float]:
    """(algbw, busbw) in GB/s for one collective of `nbytes` (nccl-tests' size) taking `seconds`."""
    algbw = nbytes / seconds / 1e9
    return algbw, algbw * bus_factor(op, nranks)


def element_count(nbytes: int, nranks: int) -> int:
    """Elements of the nccl-tests-size buffer, rounded down so it splits evenly over the ranks."""
    count = nbytes // ELEMENT_BYTES
    return max(nranks, count - count % nranks)


_SIZE_RE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(i?B?)\s*", re.IGNORECASE)


def parse_size(text: str) -> int:
    """'8', '64K', '64M', '1G', '256MiB' -> bytes (K/M/G are powers of 1024, as in nccl-tests)."""
    m = _SIZE_RE.fullmatch(str(text))
    if not m:
        raise UserError(f"bad size {text!r}: use a byte count with an optional K, M, G suffix (e.g. 64M)")
    mult = 1024 ** " KMGT".index(m.group(2).upper() or " ")
    return int(float(m.group(1)) * mult)


def size_sweep(begin: int, end: int, factor: float) -> list[int]:
    """nccl-tests' -b/-e/-f: begin, begin*f, ... up to end (inclusive)."""
    if begin <= 0 or end < begin:
        raise UserError(f"bad size range: -b {begin} -e {end} (need 0 < begin <= end)")
    if factor <= 1:
        raise UserError(f"bad step factor -f {factor}: must be > 1")
    sizes, s = [], float(begin)
    while s <= end * (1 + 1e-9):
        sizes.append(int(s))
        s *= factor
    return sizes
