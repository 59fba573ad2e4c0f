"""One writer per run: rank 0 holds `checkpoints/<run>/.owner.json` while the run trains.

A duplicate submission, a node cut off after Slurm requeued its job, or a manual `train` beside a job would
otherwise write the same steps, delete each other's and prune each other's checkpoints. The lock is:
 - created with O_CREAT|O_EXCL (atomic on local filesystems and NFSv3+), holding job id, host, pid, start and
   an attempt id (which names this attempt's temporary directories);
 - flock'ed by the holder where the filesystem supports it: a held flock proves a live owner, and the kernel
   drops it when the process dies, whatever pid the host reuses;
 - touched (mtime) at step boundaries: the heartbeat a writer on another host is judged by.
A lock is stale when its pid is dead (same host), or it is not flock'ed (same host, flock available), or its
heartbeat is older than `checkpoint.lock_stale_s`; a stale lock is taken over with a log line. Take-overs are
serialised by a second exclusive file, so two new writers cannot both take over the same stale lock.
No torch here: `storage status` reads the same file.
"""

from __future__ import annotations

import errno
import json
import os
import secrets
import socket
import time
from pathlib import Path

from llmcluster.errors import UserError
from llmcluster.storage.layout import OWNER_LOCK, read_owner

try:
    import fcntl
except ImportError:  # not POSIX: exclusive create and heartbeat only
    fcntl = None

TAKEOVER = OWNER_LOCK + ".takeover"
HEARTBEAT_EVERY_S = 5.0   # at most one mtime update per this, however short the steps


def job_id() -> str | None:
    for var in ("SLURM_JOB_ID", "LLMCLUSTER_JOB_ID", "TORCHELASTIC_RUN_ID"):
        if os.environ.get(var):
            return os.environ[var]
    return None


def describe(holder: dict | None) -> str:
    if not holder:
        return "an unreadable owner record"
    job = f"job {holder['job']}, " if holder.get("job") else ""
    return f"{job}pid {holder.get('pid')} on {holder.get('host')} since {holder.get('start')}"


def _pid_alive(pid) -> bool:
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except (PermissionError, ValueError, TypeError, OverflowError):
        return True
    return True


def _flock_held(path: Path) -> bool | None:
    """True: someone holds the flock (a live owner); False: nobody does; None: no flock here."""
    if fcntl is None:
        return None
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    except BlockingIOError:
        return True
    except OSError:  # ENOLCK, EOPNOTSUPP: the filesystem has none
        return None
    finally:
        os.close(fd)


def stale_reason(path: Path, holder: dict | None, stale_s: float) -> str | None:
    """Why the lock at `path` belongs to nobody alive, or None if its owner may be alive."""
    held = _flock_held(path)
    if held:
        return None
    if holder and holder.get("host") == socket.gethostname():
        if not _pid_alive(holder.get("pid")):
            return f"pid {holder.get('pid')} is not running on this host"
        if held is False:
            return f"pid {holder.get('pid')} does not hold the lock (a reused pid)"
    try:
        age = time.time() - path.stat().st_mtime
    except FileNotFoundError:
        return "it is gone"
    if age > stale_s:
        return f"its heartbeat is {age:.0f} s old (checkpoint.lock_stale_s={stale_s:g})"
    return None


class RunLock:
    def __init__(self, run_dir: Path, run: str, stale_s: float, log):
        self.path, self.run, self.stale_s, self.log = run_dir / OWNER_LOCK, run, stale_s, log
        self.attempt = f"{time.strftime('%Y%m%dT%H%M%S', time.gmtime())}-{os.getpid()}-{secrets.token_hex(3)}"
        self.fd: int | None = None
        self.last_beat = 0.0

    def acquire(self) -> None:
        """Take the lock or raise a one-line UserError naming its live holder."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        for _ in range(5):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                self._take_over_if_stale()
                continue
            info = {"run": self.run, "job": job_id(), "host": socket.gethostname(), "pid": os.getpid(),
                    "start": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "attempt": self.attempt}
            os.write(fd, json.dumps(info).encode())
            os.fsync(fd)
            if fcntl is not None:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except OSError:
                    pass  # no flock on this filesystem: exclusive create + heartbeat still hold
            self.fd, self.last_beat = fd, time.time()
            return
        raise UserError(f"run {self.run}: could not take the owner lock {self.path} (it keeps changing hands)")

    def _take_over_if_stale(self) -> None:
        holder = read_owner(self.path.parent)
        why = stale_reason(self.path, holder, self.stale_s)
        if why is None:
            raise UserError(f"run {self.run} already has a writer: {describe(holder)} (lock {self.path}); "
                            "stop it first, or choose another run.name")
        guard = self.path.parent / TAKEOVER
        try:
            os.close(os.open(guard, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
        except FileExistsError:
            try:
                if time.time() - guard.stat().st_mtime > 30:  # a contender died mid-take-over
                    guard.unlink()
                    return
            except FileNotFoundError:
                return
            raise UserError(f"run {self.run}: another writer is taking over the stale lock {self.path}") from None
        try:
            if read_owner(self.path.parent) == holder:  # still the lock we judged, not a newer one
                self.path.unlink(missing_ok=True)
                self.log(f"warning: run {self.run}: taking over the owner lock from {describe(holder)}: {why}")
        finally:
            guard.unlink(missing_ok=True)

    def mine(self) -> bool:
        holder = read_owner(self.path.parent)
        return bool(holder) and holder.get("attempt") == self.attempt and holder.get("pid") == os.getpid()

    def heartbeat(self, force: bool = False) -> str | None:
        """At a step boundary: refresh the heartbeat; the reason if the lock is no longer ours."""
        if self.fd is None:
            return None
        now = time.time()
        if not force and now - self.last_beat < HEARTBEAT_EVERY_S:
            return None
        if not self.mine():
            return self.lost_message()
        try:
            os.utime(self.path)
        except OSError as e:
            if e.errno != errno.ENOENT:
                raise
        self.last_beat = now
        return None

    def lost_message(self) -> str:
        """The same line on every rank (only rank 0 reads the lock)."""
        return (f"run {self.run}: lost the owner lock {self.path} to another writer (this one was presumed "
                "dead): stopping without writing")

    def release(self) -> None:
        if self.fd is None:
            return
        try:
            if self.mine():
                self.path.unlink(missing_ok=True)
        finally:
            os.close(self.fd)
            self.fd = None
