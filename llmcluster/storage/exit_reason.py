"""Why a rank stopped, for the batch script that decides whether to requeue (no torch here).

The launcher points LLMCLUSTER_EXIT_DIR at the attempt's rank-log directory; each rank writes
`exit-rank<r>` with one word and a detail. `fatal` = a restart would repeat the failure (bad config, the
non-finite-step limit): not requeued. `preempted` / `failed` (an exception: NCCL timeout, a lost peer) are
requeued; a rank killed outright (OOM killer, segfault) writes nothing, which the script also requeues.
"""

from __future__ import annotations

import os
from pathlib import Path

from llmcluster.storage.owned import replace_atomically

EXIT_DIR_ENV = "LLMCLUSTER_EXIT_DIR"
# dropped: an ft group left as a straggler; no_quorum: an ft group gave up waiting for the others' quorum
REASONS = ("completed", "preempted", "failed", "fatal", "dropped", "no_quorum")


def write(reason: str, detail: str = "") -> None:
    where = os.environ.get(EXIT_DIR_ENV)
    if not where:
        return
    assert reason in REASONS, reason
    line = " ".join(f"{reason} {detail}".split())[:500]   # one line, whatever the exception said
    try:
        path = Path(where) / f"exit-rank{int(os.environ.get('RANK', '0'))}"
        replace_atomically(path, line + "\n")      # no planted temp name or link written through
    except (OSError, ValueError):
        pass   # the reason is advice: a missing one means "requeue", never a second failure
