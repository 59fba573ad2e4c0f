"""Keep freed buffers in a CPU training process instead of handing them back to the kernel at every step.

glibc's malloc serves each buffer of its mmap threshold or more (at most 32 MiB) with a fresh mmap and unmaps it
at free. A CPU training step frees and reallocates the same large buffers every step (the B·T·V logits, the
attention and MLP activations of a micro-batch), so every page of them is faulted in and zeroed by the kernel
again at every step: on llm_tiny (2 cores, bf16) ~35,000 minor page faults a step and ~30% of an eager step
(benchmarks/train_throughput.py prints the faults; docs/compat.md "CPU training throughput" the figures).
torch's own CPU launcher (torch.backends.xeon.run_cpu) preloads jemalloc or tcmalloc for the same reason;
glibc can do it in-process with two mallopt settings: no mmap for large blocks, and no trimming of the heap's
top, so a step's buffers are reused by the next step. The cost: the process keeps its peak heap (a training
process returns to that peak every step anyway).

Left alone where the user chose an allocator (LD_PRELOAD, glibc's MALLOC_* variables or a malloc tunable) or
where libc is not glibc.
"""

from __future__ import annotations

import ctypes
import os

M_TRIM_THRESHOLD = -1   # <malloc.h>
M_MMAP_MAX = -4
_TRIM_NEVER = 2**31 - 1  # mallopt takes an int: ~2 GiB of free heap top before glibc trims it


def allocator_chosen_by_user(environ=os.environ) -> str | None:
    """The variable by which the user chose an allocator or its settings, if any."""
    if environ.get("LD_PRELOAD"):
        return "LD_PRELOAD"
    for k in sorted(environ):
        if k.startswith("MALLOC_"):   # MALLOC_MMAP_MAX_, MALLOC_ARENA_MAX, ...
            return k
    if "malloc" in environ.get("GLIBC_TUNABLES", ""):
        return "GLIBC_TUNABLES"
    return None


def keep_freed_memory() -> bool:
    """Apply the two settings to this process (a forked child keeps them; an exec'd one starts with glibc's own).
    True when applied; False where the user chose an allocator or libc is not glibc."""
    if allocator_chosen_by_user():
        return False
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # glibc only: musl has no mallopt settings of these numbers
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    return bool(mallopt(M_MMAP_MAX, 0)) and bool(mallopt(M_TRIM_THRESHOLD, _TRIM_NEVER))
