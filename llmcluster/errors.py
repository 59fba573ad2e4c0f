"""The package's failures and every exit code, in one place.

`UserError` is bad input (a config, a flag, a file, unusable storage): one line on stderr, exit 2, never a
traceback. `RunFailure` is a run that failed at run time through no fault of its input (a hung or dead peer rank,
a node that failed its checks): one line, exit 1, or 75 when it checkpointed and asks to be requeued. The CLI turns
both into one line; anything else is a bug or an environment failure and keeps its traceback.

A full disk is a failure of its own (`DiskFull`, exit EXIT_DISK_FULL): whatever the library raised (an errno, or
torch's zip writer's own words), `is_disk_full` decides once; the writer removes what it half-wrote and says one line
of what it needed, what was free and what is intact. A restart would fill the disk again: nothing restarts it.
"""

import errno
import os
import shutil

EXIT_OK = 0
EXIT_FAILURE = 1        # the run failed, or a check FAILed (validate)
EXIT_USAGE = 2          # bad config, bad input, unusable storage
EXIT_DOES_NOT_FIT = 3   # `plan`: the plan's own layout does not fit in GPU memory (the reason on its first line)
EXIT_DISK_FULL = 74     # EX_IOERR: a write found no space (or quota) left; what was written before is intact
EXIT_PREEMPTED = 75     # EX_TEMPFAIL: the run checkpointed on a signal; launchers requeue it
EXIT_FT_DROPPED = 76    # an ft replica group left the quorum as a straggler: started again after ft.straggler_backoff_s
EXIT_FT_NO_QUORUM = 77  # an ft group gave up waiting for a quorum (the others did not come): not its own failure
EXIT_INTERRUPTED = 130  # Ctrl-C (128 + SIGINT)


class _OneLine(Exception):
    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code

    def __str__(self) -> str:  # one line, always
        return " ".join(str(self.args[0]).split())


class UserError(_OneLine):
    """Bad input: printed as one line, exit code 2."""

    def __init__(self, message: str, exit_code: int = EXIT_USAGE):
        super().__init__(message, exit_code)


class RunFailure(_OneLine):
    """A run that failed at run time (not its input): printed as one line, exit 1 (or EXIT_PREEMPTED)."""

    def __init__(self, message: str, exit_code: int = EXIT_FAILURE):
        super().__init__(message, exit_code)


class DiskFull(UserError):
    """A write ran out of space: one line, exit EXIT_DISK_FULL (not retried: a restart would fill the disk again)."""

    def __init__(self, message: str):
        super().__init__(message, EXIT_DISK_FULL)


DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
# Libraries that raise their own exception with the errno's words in it: safetensors' SafetensorError "I/O error: No
# space left on device (os error 28)" (export)
NO_SPACE_WORDS = tuple(os.strerror(n) for n in DISK_FULL_ERRNOS)
# Libraries that swallow the errno of a short write and say so in their own words: torch's zip writer (torch.save,
# hence DCP's shards) raises RuntimeError "[enforce fail at inline_container.cc:...] unexpected pos ..." or "file
# write failed", numpy's tofile an OSError without errno "N requested and M written" (data prepare's shards)
SHORT_WRITE_WORDS = ("unexpected pos", "file write failed", "requested and")
# ...so a short write counts as a full disk when the target has less than this left after it (a failed write
# leaves its partial file in place: a full disk reads as ~0 free, another I/O error does not)
FULL_SLACK_BYTES = 64 << 20
DISK_FULL = "disk full"   # every DiskFull line starts so: checkpoint ranks agree on errors as strings


def free_bytes(path) -> int | None:
    """Bytes free to an unprivileged writer on the filesystem of `path` (its nearest existing ancestor)."""
    p = os.path.abspath(path)
    while True:
        try:
            st = os.statvfs(p)
            return st.f_bavail * st.f_frsize
        except OSError:
            if p == os.path.dirname(p):
                return None
            p = os.path.dirname(p)


def _chain(e: BaseException):
    """`e`, what caused it, and each rank's exception inside DCP's CheckpointException (its `failures`)."""
    todo, seen = [e], set()
    while todo:
        x = todo.pop()
        if x is None or id(x) in seen:
            continue
        seen.add(id(x))
        yield x
        todo += [x.__cause__, x.__context__]
        failures = getattr(x, "failures", None)
        for f in failures.values() if isinstance(failures, dict) else ():
            inner = f[0] if isinstance(f, tuple) else getattr(f, "exception", f)
            if isinstance(inner, BaseException):
                todo.append(inner)


def is_disk_full(e: BaseException, target=None) -> bool:
    """Whether `e` (from a write under `target`) means the disk or the quota is full."""
    for x in _chain(e):
        if isinstance(x, OSError) and x.errno in DISK_FULL_ERRNOS:
            return True
        if not isinstance(x, OSError) and any(w in str(x) for w in NO_SPACE_WORDS):
            return True
        short = isinstance(x, RuntimeError) or (isinstance(x, OSError) and not x.errno)
        if short and any(w in str(x) for w in SHORT_WRITE_WORDS):
            free = free_bytes(target) if target is not None else None
            return free is None or free < FULL_SLACK_BYTES
    return False


def disk_full_line(what: str, target, intact: str, need: int | None = None, hint: str = "") -> str:
    """The one line: what was written where, what it needed (when known), what is free now, what is intact."""
    free = free_bytes(target)
    needs = f"it needs about {max(need, 1) / 1e6:.1f} MB, " if need else ""
    room = f"{free / 1e6:.1f} MB free" if free is not None else "free space unknown"
    return f"{DISK_FULL} writing {what} to {target}: {needs}{room}; {intact}{f' ({hint})' if hint else ''}"


def unnamed_disk_full(e: BaseException) -> DiskFull | None:
    """The DiskFull line of a write that has none of its own (a record, a log line: appends, which leave what was
    written before as it was), or None when `e` is not a full disk. The file is the one the OSError names."""
    if not is_disk_full(e):
        return None
    intact = "what was written before it is intact"
    name = next((x.filename for x in _chain(e) if isinstance(x, OSError) and x.filename), None)
    if name is None:   # an open file's write() names no file: say what was raised, not some other disk's space
        return DiskFull(f"{DISK_FULL}: {' '.join(str(e).split())[:200]}; {intact}")
    where = os.path.abspath(os.fsdecode(name))
    return DiskFull(disk_full_line(os.path.basename(where), os.path.dirname(where), intact))


def remove_failed_write(e: BaseException, tmp, what: str, intact: str, need: int | None = None,
                        hint: str = "") -> None:
    """After `e` failed a write into the temporary directory `tmp`: `tmp` goes; a full disk raises one DiskFull line
    (decided before the removal: torch's words count only while its partial file still fills the disk). Otherwise
    returns, and the caller re-raises `e`."""
    full = isinstance(e, Exception) and not isinstance(e, UserError) and is_disk_full(e, tmp)
    shutil.rmtree(tmp, ignore_errors=True)
    if full:
        raise DiskFull(disk_full_line(what, os.path.dirname(os.path.abspath(tmp)), intact, need, hint)) from None

