"""Seeded initial weights as a pure function of (seed, parameter name, element index), computed on the CPU.

Why not `normal_` on the weights' device: CUDA's `normal_` depends on the GPU's SM count (an A100 and an H100
draw different weights from one seed), and even the CPU's float32 `normal_` takes a different kernel per
instruction set (Sleef on AVX2/AVX-512, libm otherwise: an AMD Rome host and a Sapphire Rapids host differ).

Here every value comes from integer bits of one CPU mt19937 generator per (seed, name, block of BLOCK elements
of the row-major weight) and is turned into a float by IEEE-exact float64 arithmetic only (+ - * / sqrt and
frexp, which every instruction set rounds the same): the inverse normal CDF (Acklam's rational approximation,
relative error 1.2e-9, far below float32's 6e-8) with a series logarithm instead of libm's. Rounded once to
float32, the result is the same bit for bit on any host, for any device the weights are copied to after.

A block can be generated on its own, so a rank draws only the blocks that its slice covers (FSDP rows, TP
rows or columns) and holds its slice plus a working set of a few blocks, never the whole weight.
"""

from __future__ import annotations

import hashlib
from typing import Callable

import torch

BLOCK = 1 << 20  # elements per generator; changing it changes every seeded weight
CHUNK = 1 << 16  # elements transformed at once: the float64 temporaries stay in cache (3-4x faster)

Draw = Callable[..., torch.Tensor]  # draw(rows=None, cols=None) -> float32 CPU tensor of that slice

_A = (-3.969683028665376e+01, 2.209460984245205e+02, -2.759285104469687e+02, 1.383577518672690e+02,
      -3.066479806614716e+01, 2.506628277459239e+00)
_B = (-5.447609879822406e+01, 1.615858368580409e+02, -1.556989798598866e+02, 6.680131188771972e+01,
      -1.328068155288572e+01, 1.0)
_C = (-7.784894002430293e-03, -3.223964580411365e-01, -2.400758277161838e+00, -2.549671010243133e+00,
      4.374664141464968e+00, 2.938163982698783e+00)
_D = (7.784695709041462e-03, 3.224671290700398e-01, 2.445134137142996e+00, 3.754408661907416e+00, 1.0)
_P_LOW = 0.02425
_LN2 = 0.6931471805599453
_SQRT_HALF = 0.7071067811865476
_BITS = 52  # k + 0.5 and 2**52 - k - 0.5 are exact in float64, so p and 1 - p are


def _horner(coeffs: tuple[float, ...], x: torch.Tensor) -> torch.Tensor:
    acc = torch.full_like(x, coeffs[0])
    for c in coeffs[1:]:
        acc.mul_(x).add_(c)  # two separately rounded ops (no FMA): the same on every instruction set
    return acc


def _log(x: torch.Tensor) -> torch.Tensor:
    """ln(x), x > 0, float64: exponent from frexp, mantissa in [sqrt(1/2), sqrt(2)) by the atanh series."""
    m, e = torch.frexp(x)
    low = m < _SQRT_HALF
    m = torch.where(low, m * 2.0, m)
    e = (e - low.to(e.dtype)).to(torch.float64)
    s = (m - 1.0) / (m + 1.0)
    series = _horner(tuple(1.0 / (2 * k + 1) for k in range(13, -1, -1)), s * s)  # |s| <= 0.172: 1e-18
    return e * _LN2 + 2.0 * s * series


def standard_normal(bits: torch.Tensor) -> torch.Tensor:
    """float64 N(0, 1) values, one per integer in [0, 2**52)."""
    p = (bits.to(torch.float64) + 0.5) * 2.0 ** -_BITS
    q = p - 0.5
    r = q * q
    x = _horner(_A, r).mul_(q).div_(_horner(_B, r))
    tail = (p < _P_LOW) | (p > 1.0 - _P_LOW)
    if bool(tail.any()):
        pt = p[tail]
        t = torch.sqrt(-2.0 * _log(torch.minimum(pt, 1.0 - pt)))
        xt = _horner(_C, t) / _horner(_D, t)
        x[tail] = torch.where(pt > 0.5, -xt, xt)
    return x


def uniform_pm1(bits: torch.Tensor) -> torch.Tensor:
    """float64 U(-1, 1) values, one per integer in [0, 2**52)."""
    return (bits.to(torch.float64) + 0.5) * 2.0 ** (1 - _BITS) - 1.0


def block_bits(seed: int, name: str, block: int, size: int = BLOCK) -> torch.Tensor:
    """The integers of one block: a CPU generator seeded by a stable hash of (seed, name, block)."""
    key = hashlib.blake2b(f"{seed}\0{name}\0{block}".encode(), digest_size=8).digest()
    gen = torch.Generator().manual_seed(int.from_bytes(key, "little") >> 1)
    return torch.empty(size, dtype=torch.int64).random_(0, 1 << _BITS, generator=gen)


class _Blocks:
    """One weight's blocks, generated on demand; the last one is kept (chunks walk rows in order)."""

    def __init__(self, seed: int, name: str, block: int):
        self.seed, self.name, self.block = seed, name, block
        self.held: tuple[int, torch.Tensor | None] = (-1, None)

    def get(self, b: int) -> torch.Tensor:
        if self.held[0] != b:
            self.held = (b, block_bits(self.seed, self.name, b, self.block))
        return self.held[1]

    def span(self, start: int, end: int) -> torch.Tensor:
        """The integers of flat elements [start, end)."""
        n = self.block
        return torch.cat([self.get(b)[max(start, b * n) - b * n:min(end, (b + 1) * n) - b * n]
                          for b in range(start // n, (end - 1) // n + 1)])

    def gather(self, pos: torch.Tensor) -> torch.Tensor:
        """The integers of the flat elements at `pos` (any order)."""
        which = pos // self.block
        bits = torch.empty_like(pos)
        for b in range(int(which.min()), int(which.max()) + 1):
            sel = which == b
            if bool(sel.any()):
                bits[sel] = self.get(b)[pos[sel] - b * self.block]
        return bits


def draw(seed: int, name: str, shape: tuple[int, ...], scale: float,
         transform: Callable[[torch.Tensor], torch.Tensor] = standard_normal,
         rows: torch.Tensor | None = None, cols: torch.Tensor | None = None,
         block: int = BLOCK) -> torch.Tensor:
    """`scale * transform(bits)` for the elements at global `rows` x `cols` of the weight viewed as
    (shape[0], rest) (all of it when both are None), as float32 on the CPU. Transforms a chunk of about
    CHUNK outputs at a time and keeps one generated block: memory is the slice plus about one block."""
    n_rows, n_cols = shape[0], (torch.Size(shape).numel() // shape[0]) if shape[0] else 0
    whole = rows is None and cols is None
    all_cols = cols is None or (len(cols) == n_cols and bool((cols == torch.arange(n_cols)).all()))
    rows = torch.arange(n_rows) if rows is None else rows.to(torch.int64)
    cols = torch.arange(n_cols) if cols is None else cols.to(torch.int64)
    out = torch.empty(len(rows), len(cols), dtype=torch.float32)
    blocks = _Blocks(seed, name, block)
    step = max(1, CHUNK // max(1, len(cols)))
    for i in range(0, len(rows) if len(cols) else 0, step):
        r = rows[i:i + step]
        if all_cols and int(r[-1]) - int(r[0]) == len(r) - 1:  # consecutive whole rows: one flat span
            bits = blocks.span(int(r[0]) * n_cols, (int(r[-1]) + 1) * n_cols)
        else:
            bits = blocks.gather((r[:, None] * n_cols + cols[None, :]).reshape(-1))
        out[i:i + step] = (transform(bits) * scale).to(torch.float32).view(-1, len(cols))
    return out.view(shape) if whole else out


def given(full: torch.Tensor) -> Draw:
    """A Draw over a tensor already made whole (small ones, e.g. zeros): the slice of it."""
    def take(rows: torch.Tensor | None = None, cols: torch.Tensor | None = None) -> torch.Tensor:
        if rows is None and cols is None:
            return full
        flat = full.reshape(full.shape[0], -1)
        return flat[rows if rows is not None else slice(None)][:, cols if cols is not None else slice(None)]
    return take
