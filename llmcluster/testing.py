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
