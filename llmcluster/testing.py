"""Test hooks (fault injection) act only with LLMCLUSTER_TESTING=1, and say so loudly when they do.

A stray `LLMCLUSTER_INJECT_NAN_AT_STEP` exported in a shell profile or a job template must not quietly
poison a real run: without the switch a set hook is ignored with a warning; with it, every process that
reads a hook says on stderr that it is a test.
"""

from __future__ import annotations

import os
import sys

TESTING_ENV = "LLMCLUSTER_TESTING"
_said: set[tuple[str, bool]] = set()   # said once per process


def test_hook(name: str, environ=os.environ) -> str:
    """The value of the test hook `name`, or "" when unset or when the testing switch is off."""
    value = environ.get(name, "")
    if not value:
        return ""
    active = environ.get(TESTING_ENV) == "1"
    if (name, active) not in _said:
        _said.add((name, active))
        if active:
            print(f"WARNING: test hook {name}={value} is active ({TESTING_ENV}=1): this is a test, not a real run",
                  file=sys.stderr, flush=True)
        else:
            print(f"warning: {name} is set but ignored: test hooks act only with {TESTING_ENV}=1",
                  file=sys.stderr, flush=True)
    return value if active else ""


# The specs of the step-indexed hooks, read here so that every room that has hooks (train, ft) reads them alike.
def hook_steps(spec: str) -> set[int]:
    """'3,7-9' -> {3, 7, 8, 9}."""
    out: set[int] = set()
    for part in filter(None, spec.split(",")):
        lo, _, hi = part.partition("-")
        out |= set(range(int(lo), int(hi or lo) + 1))
    return out


def per_rank(spec: str, rank: int) -> list[tuple[float, set[int] | None]]:
    """'rank:seconds[:steps],...' -> [(seconds, steps or None for every step)] of this rank."""
    out = []
    for item in filter(None, spec.split(",")):
        fields = item.split(":")
        if int(fields[0]) == rank:
            out.append((float(fields[1]), hook_steps(fields[2].replace(";", ",")) if len(fields) > 2 else None))
    return out
