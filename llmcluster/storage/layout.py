"""The storage layout: datasets/{code,text,multimodal}, checkpoints/<run>/step_<N>/, logs/, models/, scratch/.

Checkpoint directories are only trusted once their completion marker exists (written last, after an atomic
rename), so a crash mid-write leaves a directory that every reader here ignores.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from llmcluster.storage import records
from llmcluster.errors import UserError

AREAS = ("datasets", "checkpoints", "logs", "models", "scratch")
DATASET_KINDS = ("code", "text", "multimodal")
STEP_DIR_RE = re.compile(r"step_(\d+)")
COMPLETE_MARKER = "COMPLETE.json"   # written last: {"step", "files": {relpath: sha256}, ...}
TMP_PREFIX = ".tmp-"                # checkpoints are written under .tmp-step_N-<attempt> and renamed
OWNER_LOCK = ".owner.json"          # the run's one writer (llmcluster/checkpoint/ownership.py)
ABANDONED_PREFIX = ".abandoned-"    # steps set aside by a roll-back or a rewrite: never resumed, never pruned
PROBE = ".write-probe-"            # require_writable's proof, removed at once (other ranks may see it)
# The areas every user writes into: sticky (chmod +t), so that only an entry's owner renames or removes it. Without
# it, a member of the group could rename another user's logs/<name> and put their own in its place, which a queued
# job then reads as its owner's (issue 65; docs/security.md). datasets/ is the data team's (2755): not shared.
STICKY_AREAS = ("checkpoints", "logs", "models", "scratch")
# Folders under logs/ that are not runs: `bench` records (llmcluster/train/bench.py).
RESERVED_LOG_DIRS = ("bench",)


def _make_sticky(area: Path) -> None:
    """chmod +t on an area this user owns (another's is theirs to set: the provisioning role sets the site's)."""
    import stat

    try:
        st = area.lstat()
        if stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid() and not st.st_mode & stat.S_ISVTX:
            os.chmod(area, stat.S_IMODE(st.st_mode) | stat.S_ISVTX)
    except OSError as e:
        raise UserError(f"cannot set the sticky bit on {area}: {e.strerror or e}") from None


def check_run_name(name: str, what: str = "run") -> str:
    """A name that becomes a directory under the storage root; `what` names it in the error (run, dataset)."""
    from llmcluster.config.schema import RUN_NAME_RE

    if not isinstance(name, str) or not RUN_NAME_RE.fullmatch(name) or ".." in name:
        from llmcluster.render import show_value

        raise UserError(f"invalid {what} name {show_value(name)}: use letters, digits, '.', '_' and '-' "
                        "(no '/', '..', spaces or shell metacharacters)")
    return name


@dataclass(frozen=True)
class Storage:
    root: Path

    @property
    def datasets(self) -> Path:
        return self.root / "datasets"

    def dataset_dir(self, kind: str, name: str) -> Path:
        return self.datasets / kind / check_run_name(name, "dataset")

    def run_checkpoints(self, run: str) -> Path:
        return self.root / "checkpoints" / check_run_name(run)

    def step_dir(self, run: str, step: int) -> Path:
        return self.run_checkpoints(run) / f"step_{step}"

    def run_logs(self, run: str) -> Path:
        return self.root / "logs" / check_run_name(run)

    def model_dir(self, run: str) -> Path:
        return self.root / "models" / check_run_name(run)

    def scratch(self, job: str) -> Path:
        return self.root / "scratch" / check_run_name(job)

    # -- creation -----------------------------------------------------------------------------
    def init(self) -> list[Path]:
        """Create every area (idempotent); returns the directories that did not exist before."""
        created = []
        wanted = [self.root / a for a in AREAS] + [self.datasets / k for k in DATASET_KINDS]
        for d in wanted:
            if not d.is_dir():
                try:
                    d.mkdir(parents=True, exist_ok=True)
                except OSError as e:
                    raise UserError(f"cannot create {d}: {e.strerror or e}") from None
                created.append(d)
        for a in STICKY_AREAS:
            _make_sticky(self.root / a)
        return created

    def require_run_dirs(self, run: str) -> list[Path]:
        """The run's logs/ and checkpoints/ folders, writable; returns those this call created, and those still
        empty and changed since this launch started: another rank of it made them a moment earlier, after its
        imports (>= 1 s in); the 0.5 s margin keeps a folder made by hand just before the launch out of the count."""
        from llmcluster.storage.events import process_start_time

        from llmcluster.storage.owned import check_own_dir

        since = process_start_time() + 0.5
        dirs = (self.run_logs(run), self.run_checkpoints(run))
        for d in dirs:                 # the caller's own (storage/owned.py), checked before anything is made
            check_own_dir(d, "run folder")
        fresh = [d for d in dirs if not d.exists() or _empty_since(d, since)]
        for d in dirs:
            self.require_writable(d)
            check_own_dir(d, "run folder")
        return fresh

    @staticmethod
    def remove_if_empty(dirs: list[Path]) -> None:
        """A refused run leaves nothing behind: drop the folders it created, if they are still empty (rmdir
        refuses a folder that is not, so what anyone wrote in the meantime stays)."""
        for d in dirs:
            try:
                d.rmdir()
            except OSError:
                pass

    def require_writable(self, path: Path) -> Path:
        """mkdir -p and prove we can write there, or a one-line error."""
        probe = path / f"{PROBE}{os.getpid()}"
        for again in (True, False):
            try:
                path.mkdir(parents=True, exist_ok=True)
                probe.write_bytes(b"")
                probe.unlink()
                return path
            except FileNotFoundError:
                if again:   # the empty folder was removed between mkdir and the probe (a refused rank's cleanup)
                    continue
                raise UserError(f"storage is not writable: {path}: it vanished while being created") from None
            except OSError as e:
                raise UserError(f"storage is not writable: {path}: {e.strerror or e}") from None
        return path

    # -- checkpoints -----------------------------------------------------------------------------
    def checkpoint_steps(self, run: str) -> list[tuple[int, Path, bool]]:
        """(step, dir, complete) for every step_<N> of a run, oldest first. Temp dirs are not listed."""
        base = self.run_checkpoints(run)
        out = []
        if base.is_dir():
            for d in base.iterdir():
                m = STEP_DIR_RE.fullmatch(d.name)
                if m and d.is_dir():
                    out.append((int(m.group(1)), d, (d / COMPLETE_MARKER).is_file()))
        return sorted(out)

    def latest_complete_step(self, run: str) -> int | None:
        steps = [s for s, _, ok in self.checkpoint_steps(run) if ok]
        return steps[-1] if steps else None

    def runs(self) -> list[str]:
        names = set()
        for area in ("checkpoints", "logs", "models"):
            d = self.root / area
            if d.is_dir():
                names.update(p.name for p in d.iterdir() if p.is_dir() and not p.name.startswith(".")
                             and not (area == "logs" and p.name in RESERVED_LOG_DIRS))
        return sorted(names)


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while b := f.read(chunk):
            h.update(b)
    return h.hexdigest()


# COMPLETE.json's shape (checkpoint.py writes it): anything else is not a marker of ours, and the step is
# skipped like an interrupted write - resume falls back to the previous one instead of crashing every requeue.
MARKER_REQUIRED = {"step": records.integer(0), "files": records.OBJECT}
MARKER_OPTIONAL = {"bytes": records.integer(0), "world_size": records.integer(1), "attempt": records.TEXT,
                   "written_s": records.number(0), "time": records.TEXT}


def check_marker(step_dir: Path) -> dict | str:
    """The step's completion marker, or what is wrong with it (missing, not JSON, not of its shape). An
    unreadable one (EIO, EACCES) raises OSError: the verifier reports it as a read error of that step."""
    try:
        text = (step_dir / COMPLETE_MARKER).read_text()
    except FileNotFoundError:
        return "no completion marker (interrupted write)"
    try:
        marker = records.loads(text)
    except (ValueError, RecursionError):
        return f"{COMPLETE_MARKER} is not JSON"
    why = records.problem(marker, MARKER_REQUIRED, MARKER_OPTIONAL)
    m = STEP_DIR_RE.fullmatch(step_dir.name)
    if why is None and m and marker["step"] != int(m.group(1)):
        why = f"'step' is {marker['step']}, not the directory's {int(m.group(1))}"
    return f"{COMPLETE_MARKER} is not a completion marker: {why}" if why else marker


def read_marker(step_dir: Path) -> dict | None:
    """The step's completion marker if it has its shape, else None (unreadable too: EIO, EACCES)."""
    try:
        marker = check_marker(step_dir)
    except OSError:
        return None
    return marker if isinstance(marker, dict) else None


def read_owner(run_dir: Path) -> dict | None:
    """The owner lock's record ({run, job, host, pid, start, attempt}), or None."""
    try:
        return json.loads((run_dir / OWNER_LOCK).read_text())
    except (OSError, ValueError):
        return None


def disk_usage(path: Path) -> tuple[int, int]:
    """(bytes, files) under path, without following links."""
    total = files = 0
    for dirpath, _dirs, names in os.walk(path):
        for n in names:
            try:
                total += os.lstat(os.path.join(dirpath, n)).st_size
                files += 1
            except OSError:
                pass
    return total, files


def free_bytes(path: Path) -> int:
    p = path
    while not p.exists() and p != p.parent:
        p = p.parent
    return shutil.disk_usage(p).free


def _empty_since(d: Path, since: float) -> bool:
    """Made since `since` and holding nothing but another rank's write probe, there for a moment (require_writable):
    a probe once made rank 0 keep checkpoints/<run> of a refused two-rank launch (a fresh-clone CI run)."""
    try:
        return d.stat().st_mtime >= since and not any(not p.name.startswith(PROBE) for p in d.iterdir())
    except OSError:
        return False
