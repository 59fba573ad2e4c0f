"""An ft group's quorum on a cluster's terms (issues 49, 52): the address the group listens on, who may be in its
quorum, waiting for one, and the end of the run seen from a group that was away. `self` below is ft/group.py's
Replica."""

from __future__ import annotations

import json
import time

from llmcluster.errors import EXIT_FAILURE, EXIT_FT_NO_QUORUM, RunFailure, UserError
from llmcluster.ft.membership import QuorumUnproved
from llmcluster.launch.ft_auth import RunKey, shown
from llmcluster.storage.layout import COMPLETE_MARKER
from llmcluster.storage.owned import replace_atomically
from llmcluster.storage.run_end import END_RECORD, recorded_end



def own_address(lighthouse_url: str) -> str:
    """The address of this host on the network that reaches the Lighthouse (127.0.0.1 for a local run): what the
    group's ManagerServer and heal server bind and advertise, instead of torchft's `[::]` and short host name
    (which pods of a JobSet cannot resolve). No packet is sent: a UDP socket's connect only picks the route."""
    import socket
    from urllib.parse import urlsplit

    u = urlsplit(lighthouse_url if "//" in lighthouse_url else f"http://{lighthouse_url}")
    try:
        info = socket.getaddrinfo(u.hostname, u.port or 1, type=socket.SOCK_DGRAM)[0]
        with socket.socket(info[0], socket.SOCK_DGRAM) as s:
            s.connect(info[4])
            return s.getsockname()[0]
    except (OSError, TypeError, IndexError) as e:
        raise UserError(f"ft: cannot find this host's address towards the Lighthouse {u.netloc!r}: {e}") from None


class StrangerInQuorum(Exception):
    """A quorum that holds a member this run's secret did not make: refused before torchft configures its process
    group with it (raised in torchft's quorum thread, caught in Replica.start_step)."""


class QuorumNotFormed(Exception):
    """The Lighthouse formed no quorum with this group within ft.quorum_timeout_s: asked again (group.py)."""


class StopAsked(Exception):
    """A stop signal came while the group waited for a quorum: the trainer checkpoints and exits (group.py)."""


class RunFinished(Exception):
    """The run reached its final step while this group was away: the group ends without training (group.py)."""


QUORUM_TRIES = 10   # quorums not formed in a row before a group gives up (with the default 60 s: 10 minutes)


class BoundManagerServer:
    """torchft's ManagerServer, bound to the group's own address (torchft hard-codes `[::]`) and registered under a
    replica id that proves the run's secret (launch/ft_auth.py). Put in place of the class only while the Manager
    is built."""

    def __init__(self, address: str, key: RunKey):
        self.address, self.key = address, key

    def __call__(self, *, replica_id: str, hostname: str, bind: str, **kw):
        from torchft._torchft import ManagerServer

        host = f"[{self.address}]" if ":" in self.address else self.address
        return ManagerServer(replica_id=self.key.replica_id(replica_id), hostname=host,
                             bind=f"{host}:{bind.rsplit(':', 1)[1]}", **kw)


class QuorumTap:
    """Delegates to torchft's ManagerClient and keeps the last quorum it answered (the replica ids and who heals
    from whom, which the Manager does not expose): what ft_quorum / ft_heal record."""

    def __init__(self, client, key: RunKey, groups: int):
        self._inner, self.last, self._key, self._groups = client, None, key, groups

    def _quorum(self, *a, **kw):
        try:
            q = self._inner._quorum(*a, **kw)
        except (RuntimeError, TimeoutError) as e:   # no quorum within ft.quorum_timeout_s (< min_replicas groups)
            raise QuorumNotFormed(" ".join(str(e).split())[:200]) from None
        strangers = self._key.strangers(list(q.replica_ids), self._groups)
        if strangers:
            raise StrangerInQuorum(", ".join(sorted({shown(r) for r in strangers})))
        self.last = q
        return q

    def __getattr__(self, name):
        return getattr(self._inner, name)


def prove_members(self) -> None:
    """The new quorum's membership proof (ft/membership.py), agreed by every rank of this group: one rank's refusal
    is the group's (its ranks ask for the next quorum together). Raises QuorumUnproved."""
    from llmcluster.distributed import process_groups as D

    q, prover = self.tap.last, self.prover
    if q is None or q.quorum_id == prover.proved:
        return
    refused = None
    try:
        prover.prove(self.manager._pg, q, self.replica_id)
    except QuorumUnproved as e:
        refused = e
    if D.all_reduce_max(1.0 if refused else 0.0, self.t.env) and not refused:
        prover.proved = None
        refused = QuorumUnproved(f"another rank of group {self.group} refused quorum {q.quorum_id}")
    if refused:
        raise refused


def ask_quorum(self) -> None:
    """torchft's quorum, refused while it holds a member that is not one of this run's groups: the step is not
    started (no process group configured with the stranger, no heal from it, nothing sent to it) and the groups
    ask again. A stranger that keeps joining for ft.quorum_timeout_s stops the run in one line: torchft's
    Lighthouse cannot evict it, and a stranger inside the site's fence is an incident for a person, not a fault
    to absorb (docs/security.md, "torchft")."""
    t, said, since, waits = self.t, None, None, 0   # since: the first refusal (a wait for a quorum is not one)
    while True:
        try:
            self.manager.start_quorum()
            prove_members(self)
            return
        except QuorumNotFormed as e:   # the healthy groups wait for a slow restart; nothing crashes
            self.manager._quorum_future = None
            if t.preempt.set:   # a stop while waiting (the supervisor's SIGTERM, the Lighthouse lost)
                raise StopAsked() from None
            waits += 1
            end_if_finished(self)
            if waits >= QUORUM_TRIES:
                raise RunFailure(f"ft: group {self.group}: no quorum of ft.min_replicas={t.cfg.ft.min_replicas} "
                                 f"group(s) in {waits} tries of {t.cfg.ft.quorum_timeout_s:g} s "
                                 f"(ft.quorum_timeout_s): {e}", exit_code=EXIT_FT_NO_QUORUM) from None
            t.log(f"ft: step {t.step + 1}: no quorum of ft.min_replicas={t.cfg.ft.min_replicas} group(s) within "
                  f"{t.cfg.ft.quorum_timeout_s:g} s (ft.quorum_timeout_s); waiting for the others ({waits} of "
                  f"{QUORUM_TRIES})")
        except (StrangerInQuorum, QuorumUnproved) as e:
            self.manager._quorum_future = None   # the next start_quorum must not re-raise this one
            who, since = str(e), since or time.monotonic()
            if isinstance(e, QuorumUnproved):   # its process group summed nothing
                if e.who != said:
                    t.log(f"ft: step {t.step + 1}: refused quorum {self.tap.last.quorum_id} before any gradient: "
                          f"{who}; asking for a quorum again (ft/membership.py)")
                    t.events.emit("ft_stranger", t.step, replica_ids=e.who, quorum_id=self.tap.last.quorum_id)
                said = e.who
            elif who != said:
                t.log(f"ft: step {t.step + 1}: refused a quorum holding {who}, not a group of this run (no "
                      "proof of the run's secret): nothing is exchanged with it; asking for a quorum again")
                t.events.emit("ft_stranger", t.step, replica_ids=who)
                said = who
            if time.monotonic() - since > t.cfg.ft.quorum_timeout_s:
                raise RunFailure(f"ft: {who if isinstance(e, QuorumUnproved) else f'replica {who}'} kept joining this run's quorum for "
                                 f"{t.cfg.ft.quorum_timeout_s:g} s (ft.quorum_timeout_s) without the run's secret: "
                                 "stopping; fence the Lighthouse's port to the run's nodes (docs/security.md)",
                                 exit_code=EXIT_FAILURE) from None
            time.sleep(0.5)


def record_end(self) -> None:
    """Invariant 2's one writer: the group whose own save sealed the run's final step (train.last_step) records
    it, with its weights' digest, before it says it finished; every later quorum reads it (end_if_finished). A
    group that did not seal it (a reader, or a writer that found the step committed already) records nothing, so
    the digest is always the one of the weights in the final checkpoint. Rank 0 alone: the record is one file."""
    t = self.t
    final = t.storage.step_dir(t.cfg.run.name, t.step)
    if t.env.rank != 0 or not t.env.writer or t.ckpt.refused or not (final / COMPLETE_MARKER).is_file():
        return
    self.final_digest = self.digest()
    record = {"step": t.step, "weights_sha256": self.final_digest, "group": self.group, "checkpoint": final.name,
              "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    replace_atomically(t.ckpt.dir / END_RECORD, json.dumps(record) + "\n")


def _recorded_end(t) -> tuple[int, str] | None:
    """The run's recorded end (storage/run_end.py) when it lies above this group's step."""
    last = t.cfg.train.last_step
    return None if t.step >= last else recorded_end(t.ckpt.dir, last)


def _newest_committed(t) -> int:
    """The highest step_N of the run with its completion marker (0: none)."""
    steps = [int(d.name[5:]) for d in t.ckpt.dir.glob("step_*") if d.name[5:].isdigit()] if t.ckpt.dir.is_dir() else []
    return max((n for n in steps if (t.ckpt.dir / f"step_{n}" / COMPLETE_MARKER).is_file()), default=0)


def end_if_finished(self, behind: bool = False) -> None:
    """Before every step, in a quorum of any size, and while waiting for one: a group that finds the run's end
    recorded (a group back after the run finished, or a quorum of late groups) must not train the last steps
    again and write over the run's final checkpoint: it ends here, naming the writer's digest, not its own.
    Decided by the group's rank 0 and shared, so every rank of the group agrees."""
    from llmcluster.distributed import process_groups as D

    t = self.t
    end = _recorded_end(t) if t.env.rank == 0 else None
    newest = _newest_committed(t) if behind and t.env.rank == 0 and end is None else 0
    # invariant 1: a group whose quorum (after any heal) is behind a step the run committed trains another
    # trajectory (found by the schedule explorer, seed 3: a restart whose checkpoint read raced the writer's save
    # and retention started at step 0, then formed a quorum of its own once the writer's group was gone): it stops
    # and its launcher starts it again, to resume from that step
    code = D.all_reduce_max(2.0 if end else 1.0 if newest > t.step else 0.0, t.env)
    if code == 1:
        raise RunFailure(f"ft: group {self.group}: its quorum is at step {t.step}, behind step {newest} the run "
                         "committed: it must not train another trajectory; it stops and its launcher starts it again "
                         "from the newest checkpoint")
    if code > 0:
        step, digest = end or (t.cfg.train.last_step, "?")   # the line is rank 0's
        self.ended = True
        raise RunFinished(f"ft: group {self.group}: the run finished at step {step} (weights sha256 {digest}) "
                          f"while this group was away (at step {t.step}): it ends without training; the final "
                          "checkpoint stays the writer's")
