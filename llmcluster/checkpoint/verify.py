"""Verifying a checkpoint before it is chosen: every file against the sha256 of its completion marker, the
metadata and non-tensor entries read as data (safe_load.py). With several ranks each hashes its own share
(`owner_rank`) and the verdicts are agreed on, so every rank falls back to the same step.

A verdict is anything wrong with the step, an I/O error included: a share that cannot be read (EIO from a lost
storage target, ESTALE after a server failover, EACCES) makes that checkpoint unusable, not the run.
"""

from __future__ import annotations

import errno
from pathlib import Path

import torch.distributed as dist

from llmcluster.storage.layout import Storage, check_marker, sha256_file
from llmcluster.testing import test_hook
from llmcluster.distributed.process_groups import control_group
from llmcluster.checkpoint.safe_load import check_data_only, marker_problem

READ_ERROR_HOOK = "LLMCLUSTER_INJECT_READ_ERROR"  # test hook: step_N/file[,...]: reading it to verify is EIO


def owner_rank(rel: str, world: int) -> int:
    """Which rank hashes a checkpoint file: the rank that wrote it (DCP's __<rank>_<n>.distcp, rng/rank_<r>)
    modulo the world, rank 0 the shared ones. Save and resume verification use the same rule."""
    try:
        if rel.startswith("__") and rel.endswith(".distcp"):
            return int(rel[2:].split("_")[0]) % world
        if rel.startswith("rng/rank_") and rel.endswith(".json"):
            return int(rel[len("rng/rank_"):-5]) % world
    except ValueError:
        pass
    return 0


def verify_share(step_dir: Path, rank: int = 0, world: int = 1) -> str | None:
    """This rank's part of verifying a checkpoint: None if its files match the marker, else what is wrong.
    Every rank checks the marker's file list; rank 0 also reads the metadata and non-tensor entries as data.
    A file that cannot be read (EIO from a lost storage target, ESTALE, EACCES) is a verdict like a mismatch:
    raised, it would end every requeue in the same traceback instead of falling back to an older step."""
    try:
        return _verify_share(step_dir, rank, world)
    except OSError as e:  # the marker or the metadata (a share's own error names the share)
        return _unreadable(Path(e.filename).name if e.filename else step_dir.name, e)


def _unreadable(name: str, e: OSError) -> str:
    return f"cannot read {name}: {e.strerror or e} ({errno.errorcode.get(e.errno, e.errno)})"


def _verify_share(step_dir: Path, rank: int, world: int) -> str | None:
    marker = check_marker(step_dir)
    if isinstance(marker, str):   # missing, not JSON, or not a marker's shape ([], "x", {"step": "a"}, NaN)
        return marker
    problem = marker_problem(step_dir, marker)
    if problem:
        return problem
    for rel, digest in marker["files"].items():
        if owner_rank(rel, world) != rank:
            continue
        f = step_dir / rel
        if not f.is_file():
            return f"{rel} is missing"
        try:
            if f"{step_dir.name}/{rel}" in test_hook(READ_ERROR_HOOK).split(","):
                raise OSError(errno.EIO, "Input/output error (injected)")
            if sha256_file(f) != digest:
                return f"{rel} does not match its checksum"
        except OSError as e:
            return _unreadable(rel, e)
    return check_data_only(step_dir, marker) if rank == 0 else None


def verify_checkpoint(step_dir: Path) -> str | None:
    """None if the marker exists, lists only files inside the step, every file matches its checksum and the
    metadata and non-tensor entries are plain data; else what is wrong. One process."""
    return verify_share(step_dir, 0, 1)


def gather_obj(obj) -> list:
    if not dist.is_initialized():
        return [obj]
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, obj, group=control_group())   # CPU objects: the gloo side group under NCCL
    return parts


def first_error(error: str | None) -> str | None:
    """Collective: the first rank's error, the same on every rank (None if no rank had one). An error seen
    by one rank alone would otherwise leave the others blocked in the next collective for dist.timeout_s."""
    return next((e for e in gather_obj(error) if e), None)


def newest_verified_checkpoint(storage: Storage, run: str, log, rank: int = 0, world: int = 1) -> Path | None:
    """The newest step_<N> of a run that verifies; each newer one is skipped with a warning through `log`
    (an interrupted, corrupted or tampered write costs the steps since the previous one, no more).
    Collective when world > 1: each rank hashes its share (owner_rank), one all-gather of the verdicts per
    candidate, newest first; every rank returns the same answer."""
    for _step, d, _complete in reversed(storage.checkpoint_steps(run)):
        problem = verify_share(d, rank, world) if world == 1 else first_error(verify_share(d, rank, world))
        if problem is None:
            return d
        if rank == 0:
            log(f"warning: skipping checkpoint {d}: {problem}")
    return None
