"""Which replica group writes the run's checkpoints, events and metrics, and how the role passes (issue 37).

One group writes at a time; the others write nothing but their own log lines:
- group 0 takes the run's owner lock (checkpoint/ownership.py) as it starts, and writes. A group its launcher
  starts again while the others train (REJOIN_ENV: the local supervisor, the Slurm script) starts as a reader
  and heals, whichever group it is; and the lock's record names the group and the run's Lighthouse, so a group 0
  started again otherwise (a JobSet recreating its Job) that finds a live peer of its run holding the lock also
  starts as a reader instead of being refused.
- every step's cross-group all-reduce carries, per group, 0 (reads), 1 (writes) or 2 + n (writes and holds the
  lock; n: the take-overs of the run so far as the group knows them): after a committed step every rank of every
  group in the quorum has the same vector and takes the same decision:
    one writer            nothing changes (one still waiting for the lock looks again);
    none (it died)        the lowest group in the quorum takes the role over: it takes the dead writer's lock and
                          from then on writes checkpoints, events.jsonl (an ft_writer line first) and
                          metrics.jsonl. The lock is its own at once when the run's records prove its holder gone:
                          the group that held it (2 + n at the last committed step) is not in this quorum, and the
                          lock's record names that group and the run's Lighthouse (any host; a holder merely cut
                          off finds its lock lost at its next check, and writes nothing meanwhile: it commits no
                          step without the quorum). Otherwise the lock rules judge it (at once on the same host,
                          its pid gone; after checkpoint.lock_stale_s without a heartbeat elsewhere). Until the
                          lock is its own it writes nothing (said once): the lock stays the one proof of a writer
                          (a writer that is alive but not in the quorum yet, as at the start, keeps it);
    two (one came back)   the latest lock holder keeps the role (the highest n: a writer cut off while another
                          took its lock over holds a lock that is no longer its own), else the lower group; the
                          other hands it over: its pending save finishes, its lock (if any) is released, it stops
                          writing.
  A group that comes back heals and reads: the role does not move back to it.
W&B, MLflow and TensorBoard stay with the process that started them; a group that takes the role over appends
metrics.jsonl and shows the progress. Downstream evaluation jobs are submitted by the first writer only.
"""

from __future__ import annotations

import os

from llmcluster.errors import UserError
from llmcluster.launch.ft_local import LIGHTHOUSE_ENV, REJOIN_ENV
from llmcluster.storage.layout import read_owner

READS, WRITES, HOLDS = 0.0, 1.0, 2.0
FIRST_WRITER = 0


def _mute(ckpt) -> None:
    """A reader's checkpointer: it loads (every group resumes from the same checkpoint) and writes nothing."""
    ckpt.save = ckpt.wait_pending = ckpt.poll = ckpt.prepare_start = ckpt.close = lambda *a, **k: None
    ckpt.heartbeat = lambda: False


def _unmute(ckpt) -> None:
    for name in ("save", "wait_pending", "poll", "prepare_start", "close", "heartbeat"):
        ckpt.__dict__.pop(name, None)


def _peer_holds(ckpt, group: int) -> int | None:
    """The group of this run that holds the lock (its record names our Lighthouse), None if it is not one."""
    from llmcluster.checkpoint.checkpointer import _broadcast_obj

    holder = _broadcast_obj(read_owner(ckpt.dir) if ckpt.rank == 0 else None)
    if not isinstance(holder, dict) or holder.get("lighthouse") != os.environ.get(LIGHTHOUSE_ENV):
        return None
    g = holder.get("ft_group")
    return g if isinstance(g, int) and g != group else None


def checkpointer(group: int, ckpt):
    """The checkpointer of replica group `group`: its claim() returns whether this group starts as the writer."""
    ckpt.lock.extra = {"ft_group": group, "lighthouse": os.environ.get(LIGHTHOUSE_ENV)}
    claim = ckpt.take_lock = ckpt.claim   # take_lock(False): a take-over's look at the lock, once a step

    def first_claim(wait: bool = True) -> bool:
        if group != FIRST_WRITER or os.environ.get(REJOIN_ENV) == "1":   # a reader; a rejoining one too
            if os.environ.get(REJOIN_ENV) == "1" and ckpt.rank == 0:
                print(f"ft: group {group} started again while the others train: it joins as a reader", flush=True)
            _mute(ckpt)
            return False
        try:
            return claim(wait)
        except UserError:
            peer = _peer_holds(ckpt, group)
            if peer is None:
                raise   # another run's writer, or a second launch of this one: refused as before
            if ckpt.rank == 0:
                print(f"ft: group {group} starts as a reader: group {peer} of this run writes", flush=True)
            _mute(ckpt)
            return False
    ckpt.claim = first_claim
    return ckpt


class WriterRole:
    """This group's side of the decision above."""

    def __init__(self, trainer, group: int, groups: int):
        self.t, self.group, self.groups = trainer, group, groups
        self.mine = self.holds = bool(trainer.env.writer)   # group 0 holds the lock from its start
        self.writer = self.previous = FIRST_WRITER   # the writer as of the last committed step
        self.waiting_said = False
        self.taken = 0          # the run's take-overs as this group knows them (a holder's entry: HOLDS + taken)
        self.held_by = None     # the group the vector last showed holding the lock
        self.gone = None        # the holder this group's take-over found gone from the quorum (for the lock)

    def entry(self) -> float:
        return HOLDS + self.taken if self.holds else WRITES if self.mine else READS

    def after_commit(self, writers: list[float], present: list[int]) -> bool:
        """`writers`: the all-reduced vector (one entry per group); `present`: the groups in this step's quorum.
        True if this group has just started writing."""
        was = self.holds
        claimed = [g for g, w in enumerate(writers) if w > 0.5]
        holders = sorted((g for g in claimed if writers[g] > 1.5), key=lambda g: (-writers[g], g))   # latest first
        gone = self.held_by if self.held_by is not None and self.held_by not in present else None
        if holders:
            self.held_by, self.taken = holders[0], max(self.taken, round(writers[holders[0]] - HOLDS))
        if not claimed:
            self.taken += 1
            self._change(min(present), why="no writer in the quorum", gone=gone)
        elif len(claimed) > 1:
            self._change(holders[0] if holders else min(claimed), why=f"groups {claimed} claim it")
        else:
            self.writer = claimed[0]
        if self.mine and not self.holds:
            self._claim()
        return self.holds and not was

    def _change(self, new: int, why: str, gone: int | None = None) -> None:
        t, step = self.t, self.t.step + 1
        previous, self.writer = self.writer, new
        if self.mine and new != self.group:
            self._give(step, new)
        elif new == self.group and not self.mine:
            t.log(f"ft: group {self.group} takes the writer's role over after step {step} ({why}; it was group "
                  f"{previous})")
            self.mine, self.previous, self.gone = True, previous, gone

    def _claim(self) -> None:
        """Collective in the group: take the run's owner lock (one look a step until it is ours). Nothing is
        written before: the lock is the one proof that this group writes, whatever the others believe."""
        t = self.t
        if self.gone is not None:   # its holder's group left the quorum: its lock is taken over at once
            t.ckpt.lock.presume_gone({"ft_group": self.gone, "lighthouse": os.environ.get(LIGHTHOUSE_ENV)},
                                     f"its group {self.gone} left the run's quorum (ft: every group's writer entry)")
        try:
            self.holds = bool(t.ckpt.take_lock(False))
        except UserError:   # a live holder: a writer not in the quorum yet (starting), or hung/cut off until its
            self.holds = False   # heartbeat stops (2 x dist.timeout_s without a step boundary)
        if not self.holds:
            if not self.waiting_said:
                t.log(f"ft: group {self.group} writes nothing until the owner lock is its own (its holder is alive "
                      "or not judged dead yet: checkpoint.lock_stale_s)")
            self.waiting_said = True
            return
        self.waiting_said = False
        step = t.step + 1
        _unmute(t.ckpt)
        t.env.writer = True
        if t.env.is_main:   # the group's rank 0, as the first writer's: every rank had written each line once
            t.events.take_over(step, group=self.group, previous=self.previous)
            t.metrics.take_over(t.cfg, t.storage.run_logs(t.cfg.run.name), step)
        t.log(f"ft: group {self.group} holds the owner lock: it writes the run's checkpoints, events and metrics")

    def _give(self, step: int, new: int) -> None:
        t = self.t
        if self.holds:
            t.log(f"ft: group {self.group} hands the writer's role to group {new} after step {step}")
            t._log_saved(t.ckpt.wait_pending())
            t.ckpt.lock.release()
            _mute(t.ckpt)
            t.events.hand_over()
            t.metrics.hand_over()
        if self.gone is not None:   # a take-over that had not got the lock yet: its evidence goes with it
            t.ckpt.lock.presume_gone(None)
        self.mine = self.holds = t.env.writer = False
        self.gone = None
