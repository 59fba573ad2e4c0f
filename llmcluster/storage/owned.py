"""Files and folders that are the caller's own (issue 50): logs/ and checkpoints/ are shared and group-writable, so a
colleague can create logs/<run>/ first, plant a link where a record's temp file goes, or swap a launch's config.

The one rule, here and nowhere else: a run's folders (logs/<run>/, checkpoints/<run>/) must be directories owned
by the caller, checked with lstat (a link is not followed: it is refused); files are created with O_EXCL and
O_NOFOLLOW (a planted name or link makes the create fail, it never redirects the write), and read with O_NOFOLLOW
and checked on the open descriptor (fstat: a regular file of the caller's uid), so nothing can be swapped between
the check and the use. "The caller" is the process's effective uid: the submitting user on the submit host and on
Slurm nodes (Slurm runs the job as its submitter), and `job.k8s.run_as_user` in pods (the pod's runAsUser).
"""

from __future__ import annotations

import errno
import os
import secrets
import stat
from pathlib import Path

from llmcluster.errors import UserError

NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)


def caller_uid() -> int:
    return os.geteuid()


def check_own_dir(path: Path, what: str) -> None:
    """`path`, when it exists, must be a directory (not a link) owned by the caller: else one line (exit 2)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    except OSError as e:
        raise UserError(f"{what} {path}: cannot be checked ({e.strerror or e})") from None
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise UserError(f"{what} {path} is not a directory (a link or a file someone left there): refusing to use "
                        "it; remove it, or choose another run name")
    if st.st_uid != caller_uid():
        raise UserError(f"{what} {path} is owned by uid {st.st_uid}, not by you (uid {caller_uid()}): refusing to "
                        "write into it; ask its owner to remove it, or choose another run name")


def create_exclusive(path: Path, text: str, mode: int = 0o666) -> None:
    """A new file at `path` holding `text`: never one that exists, never through a link. `mode`: the default
    0o666 leaves it to the umask; any other is set exactly, on the open file."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | NOFOLLOW, mode)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            fd = -1
            f.write(text)
            if mode != 0o666:
                os.fchmod(f.fileno(), mode)
    finally:
        if fd >= 0:
            os.close(fd)


def replace_atomically(path: Path, text: str, mode: int = 0o666) -> None:
    """`path` replaced by a file holding `text`: written under a fresh name of this process (O_EXCL, no link
    followed: a planted temp name or link is never written through) and renamed over `path` (readers never see
    half a file; a link at `path` itself is replaced, not followed). `mode` as create_exclusive's."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}-{secrets.token_hex(4)}.tmp")
    try:
        create_exclusive(tmp, text, mode)
        os.replace(tmp, path)
    except FileExistsError:   # our fresh name taken: someone else's file, never removed here
        raise
    except BaseException:     # a full disk, an interrupt: no half-written temp file left behind
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def read_text(path: Path, own: bool = True, follow: bool = False) -> tuple[str | None, str | None]:
    """The text of `path` when it is a regular file (`own`: of the caller's uid): (text, None); (None, None) when
    it does not exist; (None, why not) otherwise. Opened without following a link (`follow`: a path the caller
    named, which may be one) nor blocking on a FIFO, and checked on the open file, so it cannot be swapped between
    the check and the read."""
    try:
        fd = os.open(path, os.O_RDONLY | (0 if follow else NOFOLLOW) | getattr(os, "O_NONBLOCK", 0))
    except FileNotFoundError:
        return None, None
    except OSError as e:
        return None, f"cannot be read ({'a symbolic link' if e.errno == errno.ELOOP else e.strerror or e})"
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            return None, "is not a regular file"
        if own and st.st_uid != caller_uid():
            return None, f"is owned by uid {st.st_uid}, not by you (uid {caller_uid()})"
        try:
            return f.read().decode("utf-8", errors="replace"), None
        except OSError as e:
            return None, f"cannot be read ({e.strerror or e})"


def require_own_file(path: Path, what: str) -> None:
    """`path`, when it exists, must be a regular file (not a link) of the caller's: else one line (exit 2)."""
    _, why = read_text(path)
    if why:
        raise UserError(f"{what} {path} {why}: refusing to use it")
