"""The writer's hand-over where the run's own records prove the old writer gone (issue 54): its group left the
quorum, so its lock is taken over at once on any host, not after checkpoint.lock_stale_s; the old holder, merely
cut off, finds its lock lost; a cut-off writer that comes back does not win the role back from the one that took
its lock over. The processes on two nodes are in tests/test_ft_netns.py."""

from __future__ import annotations

import json
import os
import time
from types import SimpleNamespace

import pytest

from llmcluster.checkpoint.ownership import RunLock
from llmcluster.errors import UserError
from llmcluster.storage.layout import OWNER_LOCK

LH = "http://n0.cluster.test:29510"


def _holder(d, group: int, lighthouse: str = LH) -> RunLock:
    """A live holder on "another host": its flock held, its heartbeat beating, its record naming its group."""
    owner = RunLock(d, "r", 600.0, lambda *_: None)
    owner.extra = {"ft_group": group, "lighthouse": lighthouse}
    assert owner.acquire()
    rec = json.loads((d / OWNER_LOCK).read_text())
    (d / OWNER_LOCK).write_text(json.dumps({**rec, "host": "elsewhere"}))   # the pid check does not apply
    return owner


def test_a_holder_whose_group_left_the_quorum_loses_its_lock_at_once_and_finds_it_lost(tmp_path):
    d = tmp_path / "ckpt"
    owner = _holder(d, 0)
    logs: list[str] = []
    new = RunLock(d, "r", 600.0, logs.append)
    new.extra = {"ft_group": 1, "lighthouse": LH}
    with pytest.raises(UserError, match="already has a writer"):   # its flock is held: alive, as before
        new.acquire(for_s=0.0)
    new.presume_gone({"ft_group": 0, "lighthouse": LH}, "its group 0 left the run's quorum")
    t0 = time.monotonic()
    assert new.acquire(for_s=0.0) and time.monotonic() - t0 < 5.0   # at once, not after lock_stale_s (600 s)
    assert any("taking over the owner lock" in m and "its group 0 left the run's quorum" in m for m in logs), logs
    assert new.gone is None and json.loads((d / OWNER_LOCK).read_text())["ft_group"] == 1
    assert "lost the owner lock" in owner.heartbeat(force=True)   # the cut-off writer: the existing lost path
    owner.release()
    assert (d / OWNER_LOCK).is_file()   # its release leaves the new writer's lock alone
    new.release()


def test_a_recreated_group_0_watching_its_dead_predecessors_lock_sees_the_peers_take_over_in_seconds(tmp_path):
    """A JobSet's new group 0 finds its predecessor's lock (another host, no flock: 600 s of watching); once the
    peer takes it over on the quorum's proof, the new lock is live and group 0 is told so (it starts as a reader:
    ft_writer.checkpointer), not after checkpoint.lock_stale_s."""
    d = tmp_path / "ckpt"
    dead = _holder(d, 0)
    dead._stop.set()
    os.close(dead.fd)   # its process died: its flock goes, its record stays
    recreated = RunLock(d, "r", 600.0, lambda *_: None)
    assert recreated.acquire(for_s=0.3) is False   # watching the heartbeat
    peer = RunLock(d, "r", 600.0, lambda *_: None)
    peer.extra = {"ft_group": 1, "lighthouse": LH}
    peer.presume_gone({"ft_group": 0, "lighthouse": LH}, "its group 0 left the run's quorum")
    assert peer.acquire(for_s=0.0)
    t0 = time.monotonic()
    with pytest.raises(UserError, match="already has a writer"):
        recreated.acquire(for_s=5.0)
    assert time.monotonic() - t0 < 4.0   # told at once, not after its 5 s of watching (room for a loaded machine)
    peer.release()


@pytest.mark.parametrize("record", [{"ft_group": 1}, {"lighthouse": "http://another-run:29510"}])
def test_the_evidence_takes_only_the_lock_it_names(tmp_path, record):
    """A lock of another group, or of another run's Lighthouse, is judged by the lock rules as ever (alive here)."""
    d = tmp_path / "ckpt"
    owner = _holder(d, record.get("ft_group", 0), record.get("lighthouse", LH))
    new = RunLock(d, "r", 600.0, lambda *_: None)
    new.presume_gone({"ft_group": 0, "lighthouse": LH}, "its group 0 left the run's quorum")
    with pytest.raises(UserError, match="already has a writer"):
        new.acquire(for_s=0.0)
    new.presume_gone({"ft_group": 0, "lighthouse": None}, "no Lighthouse: no evidence")
    assert new.gone is None
    owner.release()


def _role(group: int, writer: bool, log: list):
    from llmcluster.ft.writer import WriterRole

    lock = SimpleNamespace(gone=None, presume_gone=lambda fields, why="": setattr(lock, "gone", fields and (fields, why)),
                           release=lambda: None)
    ckpt = SimpleNamespace(lock=lock, take_lock=lambda wait: lock.gone is not None, wait_pending=lambda: None)
    trainer = SimpleNamespace(step=10, log=log.append, ckpt=ckpt, _log_saved=lambda _s: None,
                              env=SimpleNamespace(writer=writer, is_main=False),
                              events=SimpleNamespace(hand_over=lambda: None), metrics=SimpleNamespace(hand_over=lambda: None))
    return WriterRole(trainer, group=group, groups=2), lock


def test_the_take_over_carries_the_evidence_only_when_the_holder_was_seen_and_left(monkeypatch):
    monkeypatch.setenv("TORCHFT_LIGHTHOUSE", LH)
    log: list[str] = []
    role, lock = _role(1, False, log)
    # the first quorum without group 0 (it is starting): no holder ever seen, no evidence: the lock rules judge
    role.after_commit([0, 0], [1])
    assert role.mine and not role.holds and lock.gone is None
    role, lock = _role(1, False, log)
    role.after_commit([2, 0], [0, 1])            # group 0 holds the lock in this quorum
    assert role.held_by == 0 and not role.mine
    role.after_commit([0, 0], [1])               # ... and has left it: its lock at once
    assert role.holds and lock.gone[0] == {"ft_group": 0, "lighthouse": LH}
    assert role.entry() == 3                     # HOLDS + one take-over


def test_a_cut_off_writer_that_comes_back_hands_the_role_to_the_one_that_took_its_lock(monkeypatch):
    """Group 0 was cut off (entry 2: it still believes it holds), group 1 took its lock over (entry 3): group 1
    keeps the role, though it is the higher group; group 0 gives it up and writes nothing."""
    monkeypatch.setenv("TORCHFT_LIGHTHOUSE", LH)
    old, _ = _role(0, True, [])
    assert old.entry() == 2
    new, _ = _role(1, False, [])
    for role in (old, new):
        role.after_commit([2, 0], [0, 1])
    new.after_commit([0, 0], [1])                # the old writer cut off: group 1 takes its lock over
    assert new.holds and new.entry() == 3
    back = [old.entry(), new.entry()]
    for role in (old, new):
        role.after_commit(back, [0, 1])
    assert not old.mine and not old.holds and not old.t.env.writer
    assert new.holds and new.writer == old.writer == 1
