"""A CPU training process keeps its freed large buffers (llmcluster/distributed/cpu_memory.py).

Real glibc, real page faults: a child process allocates, fills and frees a 48 MiB buffer five times (the shape of
a step's logits) and counts its minor page faults; with the setting applied the pages are reused, without it
glibc unmaps the buffer at every free and the kernel faults every page in again."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

from conftest import cli_env

CHILD = """
import resource
from llmcluster.distributed.cpu_memory import keep_freed_memory
print(keep_freed_memory())
del bytearray(48 << 20)[:]   # the first allocation faults in either way
f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(5):
    buf = bytearray(48 << 20)   # malloc + memset: every page touched
    del buf
print((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0) / 5)
"""

PAGES = (48 << 20) // 4096


def child(**env: str) -> tuple[str, float]:
    # The child starts with no allocator choice of the caller's (whatever ran the suite), then `env`'s.
    base = {k: v for k, v in cli_env().items()
            if k not in ("LD_PRELOAD", "GLIBC_TUNABLES") and not k.startswith("MALLOC_")}
    out = subprocess.run([sys.executable, "-c", CHILD], env={**base, **env}, capture_output=True, text=True,
                         timeout=60, check=True).stdout.split()
    return out[0], float(out[1])


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the settings are glibc's")
def test_freed_buffers_are_reused_unless_the_user_chose_an_allocator():
    applied, faults = child()
    assert applied == "True" and faults < PAGES / 20, faults
    # A user's own allocator settings win: nothing applied, glibc's default behaviour (a fault per page).
    applied, faults = child(MALLOC_ARENA_MAX="4")
    assert applied == "False" and faults > PAGES * 0.9, faults


def test_the_users_allocator_choice_is_recognised():
    from llmcluster.distributed.cpu_memory import allocator_chosen_by_user

    assert allocator_chosen_by_user({}) is None
    assert allocator_chosen_by_user({"LD_PRELOAD": "/usr/lib/libjemalloc.so.2"}) == "LD_PRELOAD"
    assert allocator_chosen_by_user({"MALLOC_MMAP_MAX_": "0"}) == "MALLOC_MMAP_MAX_"
    assert allocator_chosen_by_user({"GLIBC_TUNABLES": "glibc.malloc.mmap_max=0"}) == "GLIBC_TUNABLES"
    assert allocator_chosen_by_user({"GLIBC_TUNABLES": "glibc.cpu.hwcaps=-AVX2"}) is None
