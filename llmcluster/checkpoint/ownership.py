"""One writer per run: rank 0 holds `checkpoints/<run>/.owner.json` while the run trains.

A duplicate submission, a node cut off after Slurm requeued its job, or a manual `train` beside a job would
otherwise write the same steps, delete each other's and prune each other's checkpoints. The lock is:
 - created with O_CREAT|O_EXCL (atomic on local filesystems and NFSv3+), mode 0664 so that a colleague of the
   group can open it for writing to probe it, and flock'ed at once, before its record (job id, host, pid,
   start, an attempt id that names this attempt's temporary directories) is written: a complete record
   without a held flock then means a dead owner, never one between its create and its flock;
 - flock'ed where the filesystem supports it: a held flock proves a live owner, and the kernel drops it when
   the process dies, whatever pid the host reuses. On NFS flock is a POSIX lock, which needs a descriptor open
   for writing (EBADF on a read-only one), so the probe opens the lock for writing;
 - touched by a thread of rank 0's from the moment it is taken until release: startup (dataset hashing, HF
   import, resume verification) and a long synchronous save are not step boundaries. The thread stops when
   the hang watchdog fires (no step boundary for `hang_s`: 2 x dist.timeout_s in a run, which a healthy
   step's collectives each stay within): a hung writer must not keep the run forever.
Whether an owner is alive is read, in order: a held flock (alive); on the same host a dead pid, or a complete
record that nobody flocks where flock works (dead: a reused pid), judged again after GRACE_S; otherwise its
heartbeat, which must change between two reads `checkpoint.lock_stale_s` apart. Before all of these, what the
caller's own records prove (`presume_gone`: an ft run's quorum, which every group agrees on, no longer holds the
group that held the lock): a record naming that holder is taken over at once, its flock and heartbeat unread (a
holder merely cut off holds both; it finds its lock lost at its next check). The heartbeat is the lock's
mtime as the file server sets it, compared only with itself: two machines' clocks are never compared, and an
error from the probe (ENOLCK, EBADF, EACCES) means "unknown", never "free". A lock found stale is taken over
with a log line; take-overs are serialised by a second exclusive file.
No torch here: `storage status` reads the same file.
"""

from __future__ import annotations

import errno
import json
import os
import secrets
import socket
import threading
import time
from pathlib import Path

from llmcluster.errors import UserError
from llmcluster.storage.layout import OWNER_LOCK, read_owner

try:
    import fcntl
except ImportError:  # not POSIX: exclusive create and heartbeat only
    fcntl = None

TAKEOVER = OWNER_LOCK + ".takeover"
LOCK_MODE = 0o664
HEARTBEAT_EVERY_S = 5.0   # the thread's beat, and at most one mine() check per this at step boundaries
GRACE_S = 2.0             # a same-host record nobody flocks is looked at twice, this far apart
FLOCK_RETRY_S = 2.0       # how long acquire retries its flock while a checker's probe holds it
_BUSY = (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES)  # flock/fcntl: another holder


def job_id() -> str | None:
    for var in ("SLURM_JOB_ID", "LLMCLUSTER_JOB_ID", "TORCHELASTIC_RUN_ID"):
        if os.environ.get(var):
            return os.environ[var]
    return None


def describe(holder: dict | None) -> str:
    if not holder:
        return "an owner whose record is not written yet (or unreadable)"
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
    """True: someone holds the flock (a live owner); False: nobody does; None: cannot tell here (no flock on
    this filesystem, or no write access to probe it)."""
    if fcntl is None:
        return None
    try:
        fd = os.open(path, os.O_WRONLY)
    except FileNotFoundError:
        return False
    except OSError:  # EACCES: a colleague's lock we may not open for writing
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    except OSError as e:
        return True if e.errno in _BUSY else None   # ENOLCK, EBADF, EOPNOTSUPP: unknown, never free
    finally:
        os.close(fd)


def _beat(path: Path) -> tuple[int, int, int] | None:
    """The lock's identity and heartbeat as the file server reports them; None once it is gone."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return st.st_ino, st.st_mtime_ns, st.st_size


class RunLock:
    def __init__(self, run_dir: Path, run: str, stale_s: float, log, hang_s: float | None = None):
        self.path, self.run, self.stale_s, self.log = run_dir / OWNER_LOCK, run, stale_s, log
        self.attempt = f"{time.strftime('%Y%m%dT%H%M%S', time.gmtime())}-{os.getpid()}-{secrets.token_hex(3)}"
        self.fd: int | None = None
        self.hang_s = hang_s
        self.extra: dict = {}   # more of the holder's identity in its record (an ft run: its group, its Lighthouse)
        self.gone: tuple[dict, str] | None = None   # presume_gone's: (the record's fields, why), for one take-over
        self.every_s = min(HEARTBEAT_EVERY_S, stale_s / 4)   # several beats within any judge's limit
        self.last_check = 0.0
        self._progress: float | None = None  # monotonic time of the last step boundary; None: not armed
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._watch: dict | None = None      # what a judgment in progress has seen (kept across calls)

    # -- taking the lock ---------------------------------------------------------------------------
    def acquire(self, for_s: float | None = None) -> bool:
        """Take the lock: True once taken; False when its holder is still being watched after `for_s`
        seconds (call again: the caller keeps its ranks in step meanwhile); a UserError naming a live holder."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        end = None if for_s is None else time.monotonic() + for_s
        removed = 0
        while removed < 5:
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_RDWR, LOCK_MODE)
            except FileExistsError:
                verdict = self._take_over_if_stale(end)
                if verdict == "pending":
                    return False
                removed += verdict == "removed"
                continue
            self._own(fd)
            return True
        raise UserError(f"run {self.run}: could not take the owner lock {self.path} (it keeps changing hands)")

    def _own(self, fd: int) -> None:
        try:
            os.fchmod(fd, LOCK_MODE)   # the umask took the group's write bit: a colleague probes for writing
        except OSError:
            pass
        if fcntl is not None:
            self._flock(fd)
        info = {"run": self.run, "job": job_id(), "host": socket.gethostname(), "pid": os.getpid(),
                "start": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "attempt": self.attempt, **self.extra}
        os.write(fd, json.dumps(info).encode())
        os.fsync(fd)
        self.fd, self.last_check, self._watch, self.gone = fd, time.monotonic(), None, None
        self._start_beating()

    def _start_beating(self) -> None:
        self._stop.clear()
        self._thread = threading.Thread(target=self._beat_loop, name="owner-lock-heartbeat", daemon=True)
        self._thread.start()

    def _flock(self, fd: int) -> None:
        """flock the lock just created. EWOULDBLOCK is another holder: a checker's probe holds it for an
        instant, so retry; one that holds it longer is refused (the lock is removed, it was ours)."""
        end = time.monotonic() + FLOCK_RETRY_S
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except OSError as e:
                if e.errno not in _BUSY:
                    return  # ENOLCK, EOPNOTSUPP: no flock here; exclusive create + heartbeat still hold
                if time.monotonic() > end:
                    if (_beat(self.path) or (None,))[0] == os.fstat(fd).st_ino:
                        self.path.unlink(missing_ok=True)
                    os.close(fd)
                    raise UserError(f"run {self.run}: the owner lock {self.path} was created but another "
                                    f"process holds its flock for over {FLOCK_RETRY_S:g} s: try again") from None
                time.sleep(0.01)

    def _take_over_if_stale(self, end: float | None) -> str:
        """Judge the existing lock: "removed" (stale), "gone" (look again), "pending" (the judgment needs
        more time than `end` allows); a UserError if its owner is alive."""
        while True:
            beat, holder = _beat(self.path), read_owner(self.path.parent)
            if beat is None:
                return "gone"
            why = self._stale_reason(beat, holder)
            if why is not None and self._remove(beat, holder, why):
                return "removed"
            if end is not None and time.monotonic() >= end:
                return "pending"
            time.sleep(min(0.05, self.every_s))

    def presume_gone(self, fields: dict | None, why: str = "") -> None:
        """The caller's records prove gone the holder whose record has these `fields` (every value given):
        its lock is taken over at once; None withdraws that."""
        ok = fields and all(v is not None for v in fields.values())
        self.gone = (fields, why) if ok else None

    def _stale_reason(self, beat, holder: dict | None) -> str | None:
        """Why the lock belongs to nobody alive, None while that is not known yet; a UserError if alive."""
        if self.gone and holder and all(holder.get(k) == v for k, v in self.gone[0].items()):
            self._watch = self._watch or {"beat": beat, "since": time.monotonic()}
            return self.gone[1]
        held = _flock_held(self.path)
        if held:
            self._refuse(holder)
        now, w = time.monotonic(), self._watch
        if w is None or w["beat"][0] != beat[0]:   # a lock not seen before (or a new one): start watching
            if holder is None or held is None or holder.get("host") != socket.gethostname():
                self.log(f"run {self.run}: the owner lock {self.path} belongs to {describe(holder)}; "
                         f"watching its heartbeat for {self.stale_s:g} s (checkpoint.lock_stale_s)")
            w = self._watch = {"beat": beat, "since": now}
        if beat != w["beat"]:
            self._refuse(holder)   # the heartbeat moved: a live owner
        if holder and holder.get("host") == socket.gethostname():
            if not _pid_alive(holder.get("pid")):
                return f"pid {holder.get('pid')} is not running on this host"
            if held is False and now - w["since"] >= GRACE_S:
                return f"pid {holder.get('pid')} does not hold the lock (a reused pid)"
        if now - w["since"] >= self.stale_s:
            return (f"its heartbeat did not change in {now - w['since']:.1f} s "
                    f"(checkpoint.lock_stale_s={self.stale_s:g})")
        return None

    def _refuse(self, holder: dict | None):
        self._watch = None
        raise UserError(f"run {self.run} already has a writer: {describe(holder)} (lock {self.path}); "
                        "stop it first, or choose another run.name")

    def _remove(self, beat, holder: dict | None, why: str) -> bool:
        """Remove the stale lock unless it changed meanwhile; False while another contender's take-over
        guard stands (one that died mid-take-over is removed when unchanged over the limit: no clocks)."""
        guard = self.path.parent / TAKEOVER
        try:
            os.close(os.open(guard, os.O_CREAT | os.O_EXCL | os.O_WRONLY, LOCK_MODE))
        except FileExistsError:
            g, now = _beat(guard), time.monotonic()
            seen = self._watch.setdefault("guard", (g, now))
            if g != seen[0]:
                self._watch["guard"] = (g, now)
            elif g is not None and now - seen[1] >= self.stale_s:
                guard.unlink(missing_ok=True)
            return False
        try:
            if _beat(self.path) != beat or read_owner(self.path.parent) != holder:
                return False  # not the lock we judged: judge again
            self.path.unlink(missing_ok=True)
            self.log(f"warning: run {self.run}: taking over the owner lock from {describe(holder)}: {why}")
            self._watch = None
            return True
        finally:
            guard.unlink(missing_ok=True)

    # -- holding it ----------------------------------------------------------------------------------
    def _beat_loop(self) -> None:
        while not self._stop.wait(self.every_s):
            if self.hang_s is not None and self._progress is not None \
                    and time.monotonic() - self._progress > self.hang_s:
                self.log(f"warning: run {self.run}: no step boundary for {self.hang_s:g} s: the owner lock's "
                         "heartbeat stops (a hung writer must not hold the run; it stops at its next step)")
                return
            try:
                os.utime(self.fd)   # this lock's inode, whatever the path now names
            except (OSError, TypeError):
                pass  # ESTALE after a take-over, or released meanwhile: mine() says so at the next step

    def progress(self) -> None:
        """A step boundary or a save phase: the hang watchdog is armed from the first one and reset by each."""
        self._progress = time.monotonic()

    def mine(self) -> bool:
        holder = read_owner(self.path.parent)
        return bool(holder) and holder.get("attempt") == self.attempt and holder.get("pid") == os.getpid()

    def heartbeat(self, force: bool = False) -> str | None:
        """At a step boundary: reset the hang watchdog; the reason if the lock is no longer ours (read at
        most every HEARTBEAT_EVERY_S unless forced: before sealing a step)."""
        if self.fd is None:
            return None
        self.progress()
        now = time.monotonic()
        if not force and now - self.last_check < self.every_s:
            return None
        self.last_check = now
        if not self.mine():
            return self.lost_message()
        if not self._thread.is_alive():  # the hang watchdog had fired, and nobody took the run meanwhile
            self.log(f"run {self.run}: a step boundary again: the owner lock's heartbeat resumes")
            self._start_beating()
        return None

    def lost_message(self) -> str:
        """The same line on every rank (only rank 0 reads the lock)."""
        return (f"run {self.run}: lost the owner lock {self.path} to another writer (this one was presumed "
                "dead): stopping without writing")

    def release(self) -> None:
        if self.fd is None:
            return
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        try:
            if self.mine():
                self.path.unlink(missing_ok=True)
        finally:
            os.close(self.fd)
            self.fd = None
