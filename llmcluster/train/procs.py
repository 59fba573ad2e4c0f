"""`llmcluster train|bench --procs-per-node N`: the ranks of one node, started in this process with torch's
elastic launch API (what torchrun runs, standalone rendezvous on 127.0.0.1), in the tool's own voice.

torchrun answers a failed rank with its ChildFailedError traceback and exit 1, and a Ctrl-C with a SignalException
traceback: the rank's one line is buried and its exit code lost (75 "checkpointed, requeue me" becomes 1). Here
rank 0 writes to the terminal as it would alone; the other ranks' output goes to files (N copies of every line
help nobody), and the one line of the rank that failed first is printed from its file if rank 0 did not fail
too. The exit code is the ranks' own: 2 bad input, 75 preempted (SIGTERM, SIGUSR2, Ctrl-C: the agent forwards
the signal, the ranks checkpoint), 1 a crash.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import tempfile
import uuid
from pathlib import Path

from llmcluster.distributed import LOOPBACK_FLAG
from llmcluster.errors import EXIT_FAILURE, EXIT_FT_DROPPED, EXIT_FT_NO_QUORUM, EXIT_PREEMPTED, EXIT_USAGE, UserError
from llmcluster.storage import exit_reason

LAUNCHED_ENV = "TORCHELASTIC_RUN_ID"      # set for every rank a torch launcher starts
# An exit-reason word (storage/exit_reason.py) -> the exit code the ranks left with.
REASON_CODES = {"completed": 0, "preempted": EXIT_PREEMPTED, "fatal": EXIT_USAGE, "failed": EXIT_FAILURE,
                "dropped": EXIT_FT_DROPPED, "no_quorum": EXIT_FT_NO_QUORUM}


def under_launcher() -> bool:
    return LAUNCHED_ENV in os.environ or "LOCAL_RANK" in os.environ


def launch_ranks(argv: list[str], nprocs: int) -> int:
    """Run `python -m llmcluster ARGV` as `nprocs` ranks on this node; the ranks' exit code."""
    if nprocs < 1:
        raise UserError(f"--procs-per-node must be at least 1, got {nprocs}")
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, SignalException, Std
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    # The agent's own INFO/WARNING lines ("Sending process N closing signal SIGTERM", "Received 2 death signal,
    # shutting down workers" on every Ctrl-C) are not the tool's. Each of its modules' loggers has its own level
    # (torch's elastic get_logger sets it at import), so the parent's is not enough: every one of them.
    for name in list(logging.root.manager.loggerDict):
        if name.startswith(("torch.distributed.elastic", "torch.distributed.launcher")):
            logging.getLogger(name).setLevel(logging.CRITICAL)
    with tempfile.TemporaryDirectory(prefix="llmcluster-ranks-") as tmp, _ranks_env(
            OMP_NUM_THREADS="1",                 # as torchrun: N ranks sharing the cores, not N x cores
            **{exit_reason.EXIT_DIR_ENV: tmp}):  # unless a batch script already collects the reasons
        reasons = Path(os.environ[exit_reason.EXIT_DIR_ENV])
        logs = DefaultLogsSpecs(log_dir=tmp, redirects={r: Std.ALL for r in range(1, nprocs)})
        config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nprocs, run_id=str(uuid.uuid4()),
                              rdzv_backend="c10d", rdzv_endpoint="127.0.0.1:0", max_restarts=0,
                              # a local run's group (distributed/loopback.py): its store listens on 127.0.0.1 only,
                              # so the ranks are told that address, not the host name's
                              local_addr="127.0.0.1" if os.environ.get(LOOPBACK_FLAG) == "1" else None,
                              logs_specs=logs, monitor_interval=0.1)
        try:
            elastic_launch(config, sys.executable)("-m", "llmcluster", *argv)
            return 0
        except ChildFailedError as e:
            return _failed_ranks_code(e.failures, Path(tmp))
        except SignalException:   # the agent forwarded it; the ranks have exited (checkpointed, or not)
            return _code_from_reasons(reasons, nprocs)


@contextlib.contextmanager
def _ranks_env(**defaults: str):
    """Defaults for the ranks' environment (which they inherit from this process), unset again afterwards."""
    added = {k: v for k, v in defaults.items() if k not in os.environ}
    os.environ.update(added)
    try:
        yield
    finally:
        for k in added:
            os.environ.pop(k, None)


def _failed_ranks_code(failures: dict, log_dir: Path) -> int:
    """The exit code of a failed launch, and the failing rank's one line when rank 0 did not write it. A rank
    that left with a code of its own speaks for the run; one that died of a signal (most often the agent's
    SIGTERM to the others once one rank failed, before rank 0 said anything) does not: both ranks refusing a bad
    config exit 2, and whichever exits first gets the other killed (seen: exit 1 with nothing printed)."""
    own = {rank: f.exitcode for rank, f in failures.items() if f.exitcode > 0}
    if 0 in own:                # rank 0 wrote its one line to the terminal already
        return own[0]
    if own:
        rank = min(own)
        line = _last_line(log_dir, rank)
        sys.stderr.write((line or f"rank {rank} failed with exit code {own[rank]}") + "\n")
        return own[rank]
    rank = min(failures)
    sys.stderr.write(f"rank {rank} was killed by {failures[rank].signal_name()}\n")
    return EXIT_FAILURE


def _last_line(log_dir: Path, rank: int) -> str:
    for f in sorted(log_dir.glob(f"**/attempt_*/{rank}/stderr.log")):
        lines = [ln for ln in f.read_text(errors="replace").splitlines() if ln.strip()]
        if lines:
            return lines[-1]
    return ""


def _code_from_reasons(reasons: Path, nprocs: int) -> int:
    """What the ranks said as they left (their exit-rank<r> files), the worst of it: 2, 1, 75, 76, else 0."""
    words = []
    for r in range(nprocs):
        try:
            words.append((reasons / f"exit-rank{r}").read_text().split()[0])
        except (OSError, IndexError):
            words.append("failed")   # killed outright after the agent's grace period: nothing written
    codes = {REASON_CODES.get(w, EXIT_FAILURE) for w in words}
    for code in (EXIT_USAGE, EXIT_FAILURE, EXIT_PREEMPTED, EXIT_FT_NO_QUORUM, EXIT_FT_DROPPED):   # the worst first
        if code in codes:
            return code
    return 0
