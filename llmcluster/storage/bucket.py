"""Checkpoints that outlive the cluster: each sealed step copied to a bucket, and the newest one brought back.

A bucket mounted through rclone (SkyPilot's MOUNT / MOUNT_CACHED) cannot hold the checkpointer's protocol: no
exclusive create or flock, no directory rename after every rank wrote, no fsync. So the checkpointer writes to the
nodes' filesystem as everywhere else, and only a **sealed** step (its COMPLETE.json written: checkpoint/checkpointer.py)
is copied, file by file, its marker last:

    push  <root>/checkpoints/<run>/step_N/  ->  <bucket>/<run>/step_N/   (each file checked against the marker)
    pull  <bucket>/<run>/step_N/ (newest with a marker)  ->  <root>/checkpoints/<run>/step_N/

A step in the bucket without its marker is an interrupted push and is never pulled. A pull stages into
checkpoints/<run>/.pull-step_N/, checks every file's sha256 against the marker while copying (a corrupt file is
refused in one line), keeps what an interrupted pull already staged and verified, writes the marker last and renames
the stage to step_N: the trainer's `--resume auto` then finds it like any step it wrote itself. The bucket is a
directory here (the nodes' mount point, or any directory in Phase 3's `storage pull`); no cloud API is called.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path, PurePosixPath

from llmcluster.errors import UserError
from llmcluster.render import show_value
from llmcluster.storage.layout import (
    COMPLETE_MARKER,
    STEP_DIR_RE,
    Storage,
    check_marker,
    sha256_file,
)

PULL_PREFIX = ".pull-"    # checkpoints/<run>/.pull-step_N/: a pull in progress (never a step the trainer lists)
PART = ".part"            # a file being copied; an interrupted copy starts over


def _files(marker: dict, where: Path) -> dict[str, str]:
    """The marker's {relative path: sha256}, each a plain path inside the step (it came from a bucket others write)."""
    out = {}
    for rel, digest in marker["files"].items():
        p = PurePosixPath(rel)
        if p.is_absolute() or ".." in p.parts or not p.parts or rel == COMPLETE_MARKER or \
                not (isinstance(digest, str) and len(digest) == 64):
            raise UserError(f"{where}: {COMPLETE_MARKER} lists {show_value(rel)}, not a file of the step: refused")
        out[rel] = digest
    return out


def _copy_checked(src: Path, dst: Path, digest: str, what: str) -> None:
    """src -> dst through dst.part, hashing as it copies; a digest other than the marker's is refused."""
    if src.is_symlink():     # a bucket is written by others: a link would copy some other file of this machine
        raise UserError(f"{what}: {src} is a symbolic link, not a file of the step: refused")
    dst.parent.mkdir(parents=True, exist_ok=True)
    part = dst.with_name(dst.name + PART)
    h = hashlib.sha256()
    try:
        with open(src, "rb") as fin, open(part, "wb") as fout:
            while chunk := fin.read(1 << 22):
                h.update(chunk)
                fout.write(chunk)
            fout.flush()
            os.fsync(fout.fileno())
    except FileNotFoundError:
        part.unlink(missing_ok=True)
        raise UserError(f"{what}: {src} is missing (its marker lists it): refused") from None
    if h.hexdigest() != digest:
        part.unlink()
        raise UserError(f"{what}: {src} is corrupt (sha256 {h.hexdigest()[:12]}..., its marker says "
                        f"{digest[:12]}...): refused")
    os.replace(part, dst)


def _write_marker(src_step: Path, dst_step: Path) -> None:
    """The marker last, through a temp name: a reader sees the step complete or not at all."""
    tmp = dst_step / (COMPLETE_MARKER + PART)
    shutil.copyfile(src_step / COMPLETE_MARKER, tmp)
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, dst_step / COMPLETE_MARKER)


def sealed_steps(run_dir: Path) -> list[tuple[int, Path, dict]]:
    """(step, dir, marker) of every step_N under run_dir with a marker of its shape, oldest first."""
    out = []
    if run_dir.is_dir():
        for d in run_dir.iterdir():
            m = STEP_DIR_RE.fullmatch(d.name)
            if m and d.is_dir():
                marker = check_marker(d)
                if isinstance(marker, dict):
                    out.append((int(m.group(1)), d, marker))
    return sorted(out, key=lambda t: t[0])


def push(root: Path, run: str, bucket: Path) -> list[int]:
    """Copy every sealed step of `run` newer than the bucket's newest to bucket/<run>/; the steps copied."""
    ours = sealed_steps(Storage(root).run_checkpoints(run))
    dest = bucket / run
    there = [s for s, _, _ in sealed_steps(dest)]
    copied = []
    for step, d, marker in ours:
        if there and step <= there[-1]:
            continue
        out = dest / d.name
        for rel, digest in _files(marker, d).items():
            _copy_checked(d / rel, out / rel, digest, f"push of {run} {d.name}")
        _write_marker(d, out)
        copied.append(step)
    return copied


def pull(source: Path, run: str, root: Path) -> tuple[int | None, int, int]:
    """Bring the newest step of `run` with a marker in `source` (a bucket: source/<run>/step_N, or a storage root's
    checkpoints/<run>/step_N) into root's checkpoints; (step or None when there is none, files copied, files kept)."""
    src_run = source / run if (source / run).is_dir() else source / "checkpoints" / run
    if not source.is_dir():
        raise UserError(f"storage pull: {source} is not a directory")
    steps = sealed_steps(src_run)
    if not steps:
        return None, 0, 0
    step, src, marker = steps[-1]
    run_dir = Storage(root).run_checkpoints(run)
    final = run_dir / src.name
    if (final / COMPLETE_MARKER).is_file():
        return step, 0, 0                      # already here, sealed
    if final.exists():
        raise UserError(f"storage pull: {final} exists without its marker (an interrupted write): move it aside "
                        "first")
    files = _files(marker, src)
    stage = run_dir / f"{PULL_PREFIX}{src.name}"
    stage.mkdir(parents=True, exist_ok=True)
    copied = kept = 0
    for rel, digest in files.items():
        dst = stage / rel
        if dst.is_file() and sha256_file(dst) == digest:     # staged and verified by an interrupted pull
            kept += 1
            continue
        _copy_checked(src / rel, dst, digest, f"storage pull {run} {src.name}")
        copied += 1
    for left in [p for p in stage.rglob("*") if p.is_file() and p.relative_to(stage).as_posix() not in files]:
        if not left.name.endswith(PART):   # not a half copy of ours: never deleted, the pull stops instead
            raise UserError(f"storage pull {run}: {left} is in the pull's staging folder but not in the step's "
                            "marker, and was not written by a pull: move it aside first")
        left.unlink()        # a half-copied .part of an interrupted pull: the verifier refuses unlisted files
    _write_marker(src, stage)
    os.rename(stage, final)
    fd = os.open(run_dir, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    return step, copied, kept
