"""What an unlucky shared disk does to a run (issue 23), each reproduced through the CLI: a checkpoint share
that cannot be read (EIO), a corrupt newest step that retention used to count, and the run's owner lock under
the NFS flock rule, a contended probe, the create->flock window, a long startup and a dead owner elsewhere.
Single-process runs go through the CLI entry point in this process; lock contenders are real processes."""

from __future__ import annotations

import errno
import fcntl
import json
import os
import re
import signal
import socket
import stat
import subprocess
import time

import pytest

from conftest import REPO, cli_inprocess
from faultkit import cli_cmd, copy_run, run, sets, torchrun_cmd, train_env, wait_for
from llmcluster.errors import UserError
from llmcluster.storage.layout import OWNER_LOCK
from llmcluster.checkpoint import ownership
from llmcluster.checkpoint.checkpointer import verify_checkpoint
from llmcluster.checkpoint.ownership import RunLock


@pytest.fixture
def root(fault_root):
    return fault_root


def cli(capsys, *args) -> tuple[int, str, str]:
    proc = cli_inprocess(capsys, *args)
    return proc.returncode, proc.stdout, proc.stderr


def train(capsys, root, **over):
    return cli(capsys, "train", "-c", "llm_tiny", "--root", root, *sets(**over))


def ckpts(root, run="llm-tiny"):
    return root / "checkpoints" / run


def status(capsys, root) -> dict:
    code, out, _ = cli(capsys, "storage", "status", "--root", root, "--json")
    assert code == 0
    return json.loads(out)["runs"]["llm-tiny"]


# -- an unreadable share is that checkpoint's verdict ----------------------------------------------
@pytest.mark.parametrize("how", ["proc-mem", "hook"])
def test_io_error_while_hashing_a_share_falls_back_in_resume_and_export(capsys, root, fault_run8, monkeypatch, how):
    copy_run(fault_run8, root)     # trained 8 steps, checkpoints 4 and 8
    shard = next((ckpts(root) / "step_8").glob("*.distcp"))
    if how == "proc-mem":  # a real EIO, for root too: reading /proc/self/mem at offset 0 (unmapped)
        shard.unlink()
        shard.symlink_to("/proc/self/mem")
    else:  # where the share is read for hashing (the real sha256 path runs for every other file)
        monkeypatch.setenv("LLMCLUSTER_TESTING", "1")
        monkeypatch.setenv("LLMCLUSTER_INJECT_READ_ERROR", f"step_8/{shard.name}")
    warning = rf"warning: skipping checkpoint \S*step_8: cannot read {shard.name}: Input/output error.* \(EIO\)"
    code, out, err = cli(capsys, "export", "--run", "llm-tiny", "--root", root)
    assert code == 0, err
    assert re.search(warning, err), err
    assert json.loads((root / "models/llm-tiny/config.json").read_text())["architectures"]
    code, out, err = train(capsys, root, train__steps=8, checkpoint__interval_steps=4)
    assert code == 0, err
    assert re.search(warning, out) and "step_4 (step 4)" in out, out
    # the unreadable step was set aside (not deleted: the error may be transient), then written again
    assert [p.name for p in ckpts(root).glob(".abandoned-*/step_8")] == ["step_8"]
    monkeypatch.delenv("LLMCLUSTER_INJECT_READ_ERROR", raising=False)
    assert verify_checkpoint(ckpts(root) / "step_8") is None


# -- retention counts verified checkpoints only ----------------------------------------------------
def test_a_step_skipped_by_resume_is_set_aside_not_counted_by_retention(capsys, root):
    code, out, err = train(capsys, root, train__steps=6, checkpoint__interval_steps=2, checkpoint__keep_last=2)
    assert code == 0, err
    assert sorted(p.name for p in ckpts(root).glob("step_*")) == ["step_4", "step_6"]
    shard = next((ckpts(root) / "step_6").glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    # resume falls back to step_4 and writes step_8; keep_last=2 used to keep the corrupt step_6 (its marker
    # exists) and delete the verified step_4
    code, out, err = train(capsys, root, train__steps=8, checkpoint__interval_steps=4, checkpoint__keep_last=2)
    assert code == 0, err
    assert "step_4 (step 4)" in out and "set aside step_6 (failed verification)" in out, out
    assert sorted(p.name for p in ckpts(root).glob("step_*")) == ["step_4", "step_8"]
    assert all(verify_checkpoint(ckpts(root) / f"step_{s}") is None for s in (4, 8))
    aside = list(ckpts(root).glob(".abandoned-*/step_6"))
    assert len(aside) == 1 and "does not match its checksum" in verify_checkpoint(aside[0])
    info = status(capsys, root)
    assert info["complete"] == 2 and info["latest_complete_step"] == 8 and not info["incomplete"]
    assert info["abandoned"] == [f"{aside[0].parent.name}/step_6"]


# -- the run's owner lock on NFS and on one host ---------------------------------------------------
def nfs_flock(real):
    """flock as the Linux NFS client does it (a POSIX lock underneath): LOCK_EX on a descriptor opened
    read-only is EBADF."""
    def flock(fd, op):
        if op & fcntl.LOCK_EX and fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE == os.O_RDONLY:
            raise OSError(errno.EBADF, os.strerror(errno.EBADF))
        return real(fd, op)
    return flock


def no_flock(fd, op):
    """A filesystem without flock (or mounted with nolock)."""
    raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))


@pytest.mark.slow
def test_a_live_owner_in_a_long_step_is_not_taken_over_and_a_frozen_one_is(capsys, root, tmp_path, monkeypatch):
    """The owner (a real `train`, its first step held 30 s by the sleep hook: no step boundary, as in a long
    startup or save) is judged by contenders that see the NFS flock rule, then no flock at all: both refuse
    (the probe opens for writing; the heartbeat thread beats). Frozen (SIGSTOP, as a node cut off), its
    heartbeat stops: a contender takes the run over, and the old owner, thawed, stops without writing."""
    real = fcntl.flock
    over = dict(train__steps=4, checkpoint__interval_steps=2, checkpoint__lock_stale_s=3)
    log = tmp_path / "owner.log"
    with open(log, "w") as f:
        a = subprocess.Popen(cli_cmd("train", "-c", "llm_tiny", "--root", root, *sets(**over)), cwd=REPO,
                             env=train_env(LLMCLUSTER_TESTING="1", LLMCLUSTER_INJECT_SLEEP="0:30:1"),
                             stdout=f, stderr=subprocess.STDOUT, text=True)
    try:
        assert wait_for(lambda: "step 0 val" in log.read_text(), 300, a), log.read_text()
        time.sleep(3.5)  # main read the lock's mtime age: past lock_stale_s now, although the owner lives
        monkeypatch.setattr(fcntl, "flock", nfs_flock(real))
        code, out, err = train(capsys, root, **over)
        assert code == 2 and f"already has a writer: pid {a.pid} on" in err, (code, out, err)
        assert "watching" not in out  # the flock answered: no need to watch
        # group-writable, so that a colleague's probe (which opens it for writing) is not EACCES
        assert stat.S_IMODE((ckpts(root) / OWNER_LOCK).stat().st_mode) == 0o664
        monkeypatch.setattr(fcntl, "flock", no_flock)
        code, out, err = train(capsys, root, **over)
        assert code == 2 and f"already has a writer: pid {a.pid} on" in err, (code, out, err)
        assert "watching its heartbeat for 3 s" in out
        a.send_signal(signal.SIGSTOP)
        code, out, err = train(capsys, root, **over)
        assert code == 0, err
        assert f"taking over the owner lock from pid {a.pid} on" in out and "did not change in" in out
        a.send_signal(signal.SIGCONT)
        a.wait(timeout=120)
    finally:
        a.send_signal(signal.SIGCONT)
        a.kill()
        a.wait()
    assert a.returncode == 2 and "lost the owner lock" in log.read_text(), log.read_text()
    assert verify_checkpoint(ckpts(root) / "step_4") is None


def test_ewouldblock_in_acquire_is_another_holder_not_no_flock(capsys, root, monkeypatch):
    """A checker's probe holds LOCK_EX for an instant just as the owner flocks its new lock: main went on
    without a flock, and the next checker took the live run over as 'a reused pid'."""
    real, calls = fcntl.flock, []

    def contended(fd, op):
        calls.append(op)
        if len(calls) <= 3:
            raise BlockingIOError(errno.EWOULDBLOCK, os.strerror(errno.EWOULDBLOCK))
        return real(fd, op)
    monkeypatch.setattr(fcntl, "flock", contended)
    owner = RunLock(ckpts(root), "llm-tiny", 2.0, lambda *_: None)
    assert owner.acquire()
    monkeypatch.setattr(fcntl, "flock", real)
    try:
        assert len(calls) == 4  # retried until the probe let go
        code, out, err = train(capsys, root, train__steps=2, checkpoint__lock_stale_s=2)
        assert code == 2 and f"already has a writer: pid {os.getpid()} on" in err, (code, out, err)
    finally:
        owner.release()
    # a holder that does not let go: refused, and the lock just created is removed
    def held_elsewhere(fd, op):
        raise BlockingIOError(errno.EWOULDBLOCK, os.strerror(errno.EWOULDBLOCK))
    monkeypatch.setattr(ownership, "FLOCK_RETRY_S", 0.1)
    monkeypatch.setattr(fcntl, "flock", held_elsewhere)
    with pytest.raises(UserError, match="another process holds its flock"):
        RunLock(ckpts(root), "llm-tiny", 2.0, lambda *_: None).acquire()
    assert not (ckpts(root) / OWNER_LOCK).exists()


def test_a_young_lock_is_live_in_the_create_flock_window_and_the_grace_period(capsys, root, monkeypatch):
    """A checker that arrives between the owner's exclusive create and its flock (empty record), or finds a
    complete record of a live pid not flocked yet (grace period), must not take the lock over."""
    real, d = fcntl.flock, ckpts(root)
    contender = RunLock(d, "llm-tiny", 60.0, lambda *_: None)
    seen = []

    def window(fd, op):
        if not seen:  # the owner has created its lock and not flocked it yet
            seen.append((d / OWNER_LOCK).read_bytes())
            assert contender.acquire(for_s=0.2) is False  # still judging: not taken
            assert (d / OWNER_LOCK).is_file()
        return real(fd, op)
    monkeypatch.setattr(fcntl, "flock", window)
    owner = RunLock(d, "llm-tiny", 1.0, lambda *_: None)
    assert owner.acquire()
    monkeypatch.setattr(fcntl, "flock", real)
    try:
        assert seen == [b""]  # flock before the record: an empty file, never a record without its flock
        with pytest.raises(UserError, match=f"already has a writer: pid {os.getpid()} on"):
            contender.acquire()
        assert owner.mine()
    finally:
        owner.release()
    # a complete record of a live pid on this host, not flocked (yet): live for GRACE_S, then a reused pid
    d.mkdir(parents=True, exist_ok=True)
    (d / OWNER_LOCK).write_text(json.dumps({"run": "llm-tiny", "host": socket.gethostname(),
                                            "pid": os.getpid(), "start": "x", "attempt": "a"}))
    judge = RunLock(d, "llm-tiny", 60.0, lambda *_: None)
    monkeypatch.setattr(ownership, "GRACE_S", 60.0)
    assert judge.acquire(for_s=0.2) is False and (d / OWNER_LOCK).is_file()
    monkeypatch.setattr(ownership, "GRACE_S", 0.3)
    assert judge.acquire()
    judge.release()


def test_hang_watchdog_stops_the_heartbeat_and_the_run_can_be_taken_over(root, monkeypatch):
    d = ckpts(root)
    logs = []
    owner = RunLock(d, "llm-tiny", 0.4, logs.append, hang_s=0.3)
    assert owner.acquire()
    try:
        owner.heartbeat()  # the first step boundary arms the watchdog; then no other comes
        assert wait_for(lambda: not owner._thread.is_alive(), 30)
        assert any("no step boundary for 0.3 s" in m for m in logs), logs
        monkeypatch.setattr(fcntl, "flock", no_flock)  # judged by its heartbeat alone, as from another host
        new = RunLock(d, "llm-tiny", 0.4, logs.append)
        assert new.acquire()
        assert owner.heartbeat(force=True) == owner.lost_message()
        new.release()
    finally:
        owner.release()


@pytest.mark.slow
def test_two_ranks_wait_while_rank_0_watches_a_lock_longer_than_dist_timeout(root):
    """Judging a lock by its heartbeat takes lock_stale_s, longer here than dist.timeout_s: rank 1 waits in
    rank 0's periodic reports instead of one broadcast that would time out."""
    d = ckpts(root)
    d.mkdir(parents=True)
    (d / OWNER_LOCK).write_text(json.dumps({"run": "llm-tiny", "host": "elsewhere", "pid": 1, "start": "x",
                                            "attempt": "old"}))
    over = dict(train__steps=2, checkpoint__interval_steps=2, checkpoint__lock_stale_s=30, dist__timeout_s=20)
    proc = run(torchrun_cmd(2, "train", "-c", "llm_tiny", "--root", root, *sets(**over)), timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "taking over the owner lock from pid 1 on elsewhere" in proc.stdout, proc.stdout
    assert verify_checkpoint(d / "step_2") is None
