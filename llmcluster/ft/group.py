"""Per-step fault tolerance across replica groups on torchft (issue 37; docs/fault-tolerance.md).

The trainer knows torchft only through this module. Each of parallel.dp_replicate's replicas is a replica group:
its own torchrun world (the launcher sets LLMCLUSTER_FT_GROUP / LLMCLUSTER_FT_GROUPS and TORCHFT_LIGHTHOUSE),
whose mesh is dp_shard x 1 x 1. Across groups, a step is:

    start_step   quorum with the Lighthouse (synchronous): a group behind the quorum's step heals here, from a
                 live peer (model, optimizer, lr schedule, step, data position), before it draws its batch
    average      the gradients (and the loss) averaged over the groups in the quorum on torchft's fault-tolerant
                 process group (gloo on CPU, nccl on GPU); a peer dying mid-all-reduce marks the step errored
    should_commit every group agrees; a step not committed is not applied and is retried with the same batch
                 (the data position is put back, the lr schedule does not step): no sample of the group's
                 shard is skipped or trained twice.

Stragglers (ft.straggler_steps > 0): the all-reduce also carries each group's compute time; a group slower than
the others' median x log.straggler_factor for that many committed steps in a row leaves the quorum (its ranks exit
76, `dropped`) and its launcher starts it again after ft.straggler_backoff_s: it heals like any returning group.

Data: each group reads its own shard of the global batch (dp_rank = group x dp_shard + rank in the group); a step
committed with fewer groups trains on those groups' shards only (fewer samples; the missing shards are not
replayed). One group writes checkpoints, events and metrics (group 0 from the start, the run's lock holder); the
others write nothing but their own log lines; when the writer dies, another group takes the role over
(ft/writer.py).
"""

from __future__ import annotations

import os
import statistics
import time
from datetime import timedelta

from llmcluster.errors import RunFailure, UserError
from llmcluster.ft import writer as ft_writer
from llmcluster.ft.membership import Prover
from llmcluster.ft.quorum import (BoundManagerServer, QuorumTap, ask_quorum, end_if_finished, own_address,
                                  record_end)
from llmcluster.ft.watchdog import Watchdog, append_event
from llmcluster.ft.writer import FIRST_WRITER
from llmcluster.launch.ft_auth import RunKey, secret_from_env, shown
from llmcluster.launch.ft_local import GROUP_ENV, GROUPS_ENV, LIGHTHOUSE_ENV, NOT_INSTALLED, REJOIN_ENV
from llmcluster.testing import test_hook
SLOW_GROUP_ENV = "LLMCLUSTER_TEST_FT_SLOW_GROUP"
SLOW_START_ENV = "LLMCLUSTER_TEST_FT_SLOW_START_S"   # test hook: seconds a restarted group waits before its quorum
# Test hook: group:step[,group:step...]: the group's training thread blocks before that step's all-reduce while its
# process lives (a stuck kernel); once per group, not in a restart (ft/watchdog.py must end it).
HANG_ENV = "LLMCLUSTER_TEST_FT_HANG_AT_STEP"
TIMINGS = ("quorum", "copy", "allreduce", "commit")   # ft's parts of a step, timed on every rank (metrics ft_s)


def require_torchft() -> None:
    """ft.enabled without the extra: one line that says how to install it."""
    try:
        import torchft  # noqa: F401
    except ImportError:
        raise UserError(NOT_INSTALLED) from None


def group() -> tuple[int, int]:
    """(this process's replica group, the number of groups), from the launcher's environment."""
    try:
        g, n = int(os.environ[GROUP_ENV]), int(os.environ[GROUPS_ENV])
    except (KeyError, ValueError):
        raise UserError(f"ft.enabled: this process was not started as a replica group ({GROUP_ENV}/{GROUPS_ENV} "
                        "unset): start the run with `llmcluster train --config C --procs-per-node P` or "
                        "`llmcluster launch`") from None
    if not 0 <= g < n:
        raise UserError(f"ft.enabled: {GROUP_ENV}={g} is not a group of {GROUPS_ENV}={n}")
    return g, n


def group_config(cfg):
    """The config a group's own world is built from: dp_replicate is across groups (torchft), so 1 inside."""
    if not cfg.ft.enabled:
        return cfg
    require_torchft()
    _g, n = group()
    if cfg.parallel.dp_replicate not in (-1, n):
        raise UserError(f"ft.enabled: parallel.dp_replicate is {cfg.parallel.dp_replicate} but the launcher "
                        f"started {n} replica groups")
    inner = cfg.model_copy(deep=True)
    inner.parallel.dp_replicate = 1
    return inner


def data_shard(cfg, dp_rank: int, dp_size: int) -> tuple[int, int]:
    """Every group reads its own shard of the global batch: the groups are the outer data-parallel dimension."""
    if not cfg.ft.enabled:
        return dp_rank, dp_size
    g, n = group()
    return g * dp_size + dp_rank, n * dp_size


def is_writer(cfg) -> bool:
    """Before the lock is claimed: group 0 expects to write (ft_writer.checkpointer decides)."""
    return not cfg.ft.enabled or group()[0] == FIRST_WRITER


def sample_log_tag(cfg) -> str:
    """Every group has a rank 0: its sample log is its own (log.sample_log)."""
    return f"group{group()[0]}-" if cfg.ft.enabled else ""


def port_slot(cfg, local_rank: int, local_world: int) -> int:
    """The Prometheus port offset of this rank: groups sharing a host get ports of their own."""
    return local_rank + (group()[0] * local_world if cfg.ft.enabled else 0)


class Replica:
    """This process's side of the replica groups: the torchft Manager and the per-step protocol above."""

    def __init__(self, trainer):
        from torchft import Manager, ProcessGroupGloo, ProcessGroupNCCL

        from llmcluster.ft.transport import SignedTransport

        self.t = trainer
        cfg, env = trainer.cfg, trainer.env
        if os.environ.get(REJOIN_ENV) == "1" and (hold := test_hook(SLOW_START_ENV)):
            print(f"ft: group {group()[0]} held {hold} s before its quorum (test hook {SLOW_START_ENV})", flush=True)
            time.sleep(float(hold))   # a group slow to come back (a long model build or checkpoint read)
        self.group, self.groups = group()
        timeout = timedelta(seconds=cfg.ft.timeout_s)   # across groups: short (a hung group leaves the quorum)
        pg = ProcessGroupNCCL(timeout=timeout) if env.device.type == "cuda" else ProcessGroupGloo(timeout=timeout)
        # Who belongs to the run, where the group listens, and a heal that carries data only (issue 49).
        key = RunKey(secret_from_env())
        address = own_address(os.environ.get(LIGHTHOUSE_ENV, "127.0.0.1"))
        store = {}
        if "MASTER_ADDR" not in os.environ:   # a group of one process without torchrun: a store of its own, at the
            from torch.distributed import TCPStore   # address the other groups reach (a quorum's store may be ours)

            self._store = TCPStore(address, 0, is_master=True, wait_for_workers=False)
            store = {"store_addr": address, "store_port": self._store.port, "rank": 0, "world_size": 1}
        self.transport = SignedTransport(key, address, timeout, self._own_state, self._params, log=trainer.log)
        import torchft.manager

        made = torchft.manager.ManagerServer
        torchft.manager.ManagerServer = BoundManagerServer(address, key)
        try:
            self.manager = Manager(pg=pg, load_state_dict=self._load, state_dict=self._state, min_replica_size=
                                   cfg.ft.min_replicas, use_async_quorum=False, timeout=timeout,
                                   quorum_timeout=timedelta(seconds=cfg.ft.quorum_timeout_s),
                                   connect_timeout=timedelta(seconds=max(cfg.ft.timeout_s, 30)),
                                   replica_id=f"llmcluster_group_{self.group}", init_sync=False, hostname=address,
                                   checkpoint_transport=self.transport, **store)
        finally:
            torchft.manager.ManagerServer = made
        self.transport.source, self.transport.step = f"llmcluster_group_{self.group}", self.manager.current_step
        self.tap = self.manager._client = QuorumTap(self.manager._client, key, self.groups)
        # Every new quorum is proved by all its members before its first all-reduce (ft/membership.py): this
        # group's full replica id (what the Lighthouse lists) and the addresses it proves it listens on.
        from torchft.manager import MANAGER_ADDR_KEY, REPLICA_ID_KEY

        self.replica_id = key.replica_id(self.manager._store.get(REPLICA_ID_KEY).decode())
        self.prover = Prover(key, (self.manager._store.get(MANAGER_ADDR_KEY).decode(), self.transport.dest),
                             env.device)
        served = f"ManagerServer {self.manager._manager.address()}, " if self.manager._manager is not None else ""
        trainer.log(f"ft: group {self.group} listens on {address}: {served}heal server {self.transport.metadata()} "
                    "(docs/security.md, torchft)")
        # The Manager's step is the trainer's (a resumed run's quorum compares the checkpoint's step).
        self.manager.load_state_dict({"step": trainer.step, "batches_committed": 0})
        self.committed = True
        self.before = None        # the data position at the start of the step: put back on a retry
        self.quorum_ids: list[str] | None = None
        self.sent_bytes = 0
        self.participants = self.groups   # the groups that took part in the last step (its tokens, its MFU)
        self.send_t0 = None
        self.heal_from = None
        # Stragglers (ft.straggler_steps): every group's compute time this step (None until averaged), the committed
        # steps in a row each group was slow (the same on every rank of every group: a healed group copies them),
        # and, once this group is dropped, the line that says why.
        self.busy: list[float] | None = None
        self.slow_steps = [0] * self.groups
        self.leaving: str | None = None
        self.ended = False                    # the run's end found recorded: this group said so, and trained none
        self.final_digest: str | None = None  # the weights of the final step, as recorded (quorum.record_end)
        # The writer's role (writer.py): the groups in this step's quorum, and every group's entry after the
        # step's all-reduce.
        self.role = ft_writer.WriterRole(trainer, self.group, self.groups)
        self.present = [self.group]
        self.writers = None
        self.timings: dict[str, list[float]] = {k: [] for k in TIMINGS}   # this rank's ft seconds, each step
        # A group that makes no progress leaves (watchdog.py): started with the training loop (Trainer._fit).
        self.watchdog = Watchdog(group=self.group, timeout_s=cfg.ft.timeout_s,
                                 first_step_deadline_s=cfg.ft.first_step_deadline_s,
                                 step_deadline_s=cfg.ft.step_deadline_s, on_expiry=self._hung, log=trainer.log)

    def _hung(self, step: int, waited: float, deadline: float) -> None:
        """The watchdog's record, before it kills this process: the group that hung is the one named."""
        t = self.t
        append_event(t.storage.run_logs(t.cfg.run.name), "hang", step, group=self.group, rank=t.env.rank,
                     waited_s=round(waited, 3), deadline_s=round(deadline, 3))

    def take_timings(self) -> dict[str, float]:
        """The median seconds of each of ft's parts of a step since the last call (the metrics record's ft_s)."""
        out = {k: round(statistics.median(v), 6) for k, v in self.timings.items() if v}
        for v in self.timings.values():
            v.clear()
        return out

    # -- the state a healing peer copies -----------------------------------------------------------
    def _state(self) -> dict:
        from llmcluster.ft.transport import tensor_bytes

        self.send_t0 = time.perf_counter()   # the sender's own time of the send starts here (start_step)
        state = self._own_state()
        self.sent_bytes = tensor_bytes(state)
        return state

    def _own_state(self) -> dict:
        """What a healing peer copies; also what a payload received is checked against (transport.checked)."""
        t = self.t
        return {"model": t.model.state_dict(), "optimizer": t.optimizer.state_dict(), "step": t.step,
                "train": t.train_state(), "slow_steps": list(self.slow_steps)}

    def _params(self) -> list:
        """The parameters in the optimizer's order (its state_dict's indices)."""
        return [p for g in self.t.optimizer.param_groups for p in g["params"]]

    def _load(self, state: dict) -> None:
        t = self.t
        t.model.load_state_dict(state["model"])
        t.optimizer.load_state_dict(state["optimizer"])
        t.step = int(state["step"])
        s = state["train"]
        self._reposition(s["sampler"])
        t.scheduler.load_state_dict(s["scheduler"])
        if s.get("scaler") and t.scaler.is_enabled():
            t.scaler.load_state_dict(s["scaler"])
        t.bad_total = int(s.get("bad_steps", 0))
        t.ft_skipped = int(s.get("ft_skipped_samples", 0))
        t.spikes.load_state_dict(s.get("loss_window"))
        self.slow_steps = [int(n) for n in state.get("slow_steps", self.slow_steps)]

    def _reposition(self, sampler_state: dict) -> None:
        """The prefetch thread has run ahead: a new one from `sampler_state` (the underlying sampler is kept)."""
        from llmcluster.data.prefetch import Prefetcher

        old = self.t.sampler
        old.close()
        self.t.sampler = Prefetcher(old.sampler, old.depth, old.pin)
        self.t.sampler.load_state_dict(sampler_state)

    # -- one step ----------------------------------------------------------------------------------
    def start_step(self) -> None:
        t = self.t
        t0 = time.perf_counter()
        step_before = t.step
        self.send_t0 = None
        with self.watchdog.suspended():   # bounded by ft.quorum_timeout_s x QUORUM_TRIES and ft.timeout_s (a heal)
            ask_quorum(self)
        if self.transport.refused:   # a payload that failed its proof or its check: the group starts again
            q = self.tap.last
            peer = shown(q.replica_ids[q.recover_src_replica_rank]) if q and q.recover_src_replica_rank is not None \
                else "?"
            raise RunFailure(f"ft: group {self.group} refused the heal from replica {peer} at step {t.step}: "
                             f"{self.transport.refused}; the group stops and its launcher starts it again")
        q = self.tap.last
        # every quorum, of any size: has the run ended without us (invariant 2), or is it behind a committed step?
        end_if_finished(self, behind=True)
        now = time.perf_counter()
        heal_s = now - t0
        send_s = now - self.send_t0 if self.send_t0 is not None else 0.0
        if q is not None:
            self._note_quorum(q, step_before, heal_s, send_s)
        self.timings["quorum"].append(heal_s)
        self.before = t.sampler.state_dict()

    def _note_quorum(self, q, step_before: int, heal_s: float, send_s: float = 0.0) -> None:
        t = self.t
        names = [r.split(":")[0] for r in q.replica_ids]   # llmcluster_group_<g>:<uuid>, in replica-rank order
        ids = sorted(set(names))

        def group_of(rank: int) -> int:
            return int(names[rank].rsplit("_", 1)[1])
        self.present = sorted({group_of(r) for r in range(len(names))})
        if q.heal:
            peer = group_of(q.recover_src_replica_rank)
            t.log(f"ft: group {self.group} healed from replica {peer} at step {t.step} (was at {step_before}) "
                  f"in {heal_s:.2f} s")
            t.events.emit("ft_heal", t.step, group=self.group, peer=peer, seconds=round(heal_s, 3),
                          bytes=None, side="receiver")
        # The sender knows the bytes; its seconds are its own time of the send (building the state and staging it
        # on the CPU: torchft's transport then lets the receiver pull it), not its quorum wait, which is the
        # receiver's heal over again. The receiver's line (when it writes) holds the whole heal.
        for r in q.recover_dst_replica_ranks:
            t.events.emit("ft_heal", t.step, group=group_of(r), peer=self.group, bytes=self.sent_bytes,
                          seconds=round(send_s, 3), side="sender")
        if sorted(q.replica_ids) != self.quorum_ids:   # with the uuids: a group replaced by its restart is news
            self.quorum_ids = sorted(q.replica_ids)
            t.log(f"ft: step {t.step + 1}: quorum of {len(ids)} of {self.groups} groups ({', '.join(ids)})")
            t.events.emit("ft_quorum", t.step, groups=len(ids), of=self.groups, replica_ids=ids)
            t.metrics.ft_groups(len(ids))

    def average(self, model, loss, busy_s):
        """Gradients and the loss, averaged over the groups in the quorum (one flat all-reduce). With
        ft.straggler_steps, the same all-reduce carries every group's compute time (`busy_s()`, this rank's; read
        only then: on CUDA it waits for the forward's end event) in a slot of its own, and every group's writer
        entry (writer.py)."""
        import torch

        grads = [getattr(p.grad, "_local_tensor", p.grad) for p in model.parameters() if p.grad is not None]
        slots = torch.zeros(self.groups if self.t.cfg.ft.straggler_steps else 0, device=loss.device)
        if slots.numel():
            slots[self.group] = self._slow_hook(self.t.step + 1) or busy_s()
        self._hang_hook(self.t.step + 1)
        writers = torch.zeros(self.groups, device=loss.device)
        writers[self.group] = self.role.entry()
        t0 = time.perf_counter()
        flat = torch.cat([g.reshape(-1).float() for g in grads] + [loss.detach().float().reshape(1), slots, writers])
        t1 = time.perf_counter()
        self.manager.allreduce(flat).wait()
        t2 = time.perf_counter()
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()
        self.timings["allreduce"].append(t2 - t1)   # host seconds: on CUDA what the host waited, not the kernels'
        self.timings["copy"].append(t1 - t0 + time.perf_counter() - t2)
        k = self.participants = self.manager.num_participants()   # averaged over the k groups in the quorum
        self.writers = flat[offset + 1 + slots.numel():] * k   # read in should_commit, after the loss's own sync
        if slots.numel():   # (0: absent)
            busy = flat[offset + 1:offset + 1 + slots.numel()] * k
            if self.t.env.distributed:   # a group is as slow as its slowest rank; every rank the same vector
                import torch.distributed as dist

                dist.all_reduce(busy, op=dist.ReduceOp.MAX)
            self.busy = busy.tolist()
        return flat[offset].to(loss.dtype)

    def should_commit(self) -> bool:
        t0 = time.perf_counter()
        self.committed = self.manager.should_commit()
        self.timings["commit"].append(time.perf_counter() - t0)
        if not self.committed:   # its batch again (the lr schedule does not step), or saved as not drawn on a stop
            self._reposition(self.before)
            self.t.log(f"ft: step {self.t.step + 1} not committed (a group failed during it): retried")
        else:   # the shards of the groups not in the step were not trained (the data position moved past them)
            self.t.ft_skipped += self.t.global_batch * (self.groups - self.participants) // self.groups
            writers = [round(w) for w in self.writers.tolist()]
            if self.role.after_commit(writers, self.present) and self.quorum_ids:   # the quorum it writes with
                ids = sorted({r.split(":")[0] for r in self.quorum_ids})
                self.t.events.emit("ft_quorum", self.t.step, groups=len(ids), of=self.groups, replica_ids=ids)
            if self.busy is not None:
                self._judge_stragglers(self.busy)
        self.busy = self.writers = None
        return self.committed

    def _hang_hook(self, step: int) -> None:
        """Test hook (LLMCLUSTER_TESTING=1): LLMCLUSTER_TEST_FT_HANG_AT_STEP=group:step, the training thread blocked
        for good before the all-reduce of the first step at or after `step` that this group runs itself, while the
        process (and torchft's heartbeat) lives; not in a group started again (REJOIN). "At or after": a group that
        starts late heals past the named step and would otherwise never hang (a CI run on a slow machine)."""
        spec = test_hook(HANG_ENV)
        if not spec or os.environ.get(REJOIN_ENV) == "1":
            return
        for item in filter(None, spec.split(",")):
            g, _, at = item.partition(":")
            if int(g) == self.group and step >= int(at):
                self.t.log(f"ft: group {self.group} hangs at step {step} (test hook {HANG_ENV})")
                import threading

                threading.Event().wait()   # forever: only the watchdog (or a kill) ends it

    def _slow_hook(self, step: int) -> float | None:
        """Test hook (LLMCLUSTER_TESTING=1): LLMCLUSTER_TEST_FT_SLOW_GROUP=group:seconds[:steps], the compute time a
        group reports (its ranks are all rank 0..P-1 of their own world, so LLMCLUSTER_INJECT_BUSY cannot single
        one group out)."""
        from llmcluster.testing import per_rank

        for seconds, steps in per_rank(test_hook(SLOW_GROUP_ENV), self.group):
            if steps is None or step in steps:
                return seconds
        return None

    def _judge_stragglers(self, busy: list[float]) -> None:
        """After a committed step: count each group's slow steps; the slowest group over ft.straggler_steps in a
        row leaves the quorum (never below ft.min_replicas; a writer's role passes to a peer, writer.py). Every
        rank of every group sees the same all-reduced times and counts, so all take the same decision; the dropped
        group leaves after this step (`leaving`), the writer records it (ft_straggler)."""
        t, ft = self.t, self.t.cfg.ft
        factor = t.cfg.log.straggler_factor
        present = [g for g, b in enumerate(busy) if b > 0]
        for g in range(self.groups):
            others = [busy[h] for h in present if h != g]
            slow = g in present and bool(others) and busy[g] > factor * statistics.median(others)
            self.slow_steps[g] = self.slow_steps[g] + 1 if slow else 0
        out = [g for g in present if self.slow_steps[g] >= ft.straggler_steps]   # the writer too: its role passes
        if not out or len(present) - 1 < ft.min_replicas:
            return
        g = max(out, key=lambda h: busy[h])
        median = statistics.median(busy[h] for h in present if h != g)
        step, n = t.step + 1, self.slow_steps[g]
        line = (f"ft: group {g} leaves the quorum after step {step}: its compute time {busy[g]:.3f} s is over the "
                f"others' median {median:.3f} s x {factor} (log.straggler_factor) for {n} steps in a row "
                f"(ft.straggler_steps); it is started again in {ft.straggler_backoff_s:g} s and heals from a peer")
        t.log(line)
        t.events.emit("ft_straggler", step, group=g, busy_s=round(busy[g], 4), median_s=round(median, 4), steps=n)
        self.slow_steps[g] = 0
        if g == self.group:
            self.leaving = line

    def record_end(self) -> None:
        record_end(self)

    def shutdown(self, reason: str | None) -> None:
        self.watchdog.stop()
        if reason == "completed" and not self.ended:   # the replicas' agreement, checkable from their logs (the
            digest = self.final_digest or self.digest()  # tests compare them); a group that ended said the writer's
            self.t.log(f"ft: group {self.group} finished at step {self.t.step}, weights sha256 {digest}")
        elif reason == "dropped" and self.role.mine:   # a peer takes the role over: the attempt goes on there
            self.t.events.hand_over()                   # (no exit line), and close() releases the lock for it
        self.manager.shutdown(wait=False)

    def digest(self) -> str:
        import hashlib

        h = hashlib.sha256()
        for name, v in sorted(self.t.model.state_dict().items()):
            h.update(name.encode())
            h.update(getattr(v, "_local_tensor", v).detach().cpu().contiguous().numpy().tobytes())
        return h.hexdigest()[:16]



def checkpointer(cfg, ckpt):
    """A group's checkpointer: every group reads checkpoints (a full stop resumes every group from the same one);
    one writes them (writer.py)."""
    return ft_writer.checkpointer(group()[0], ckpt) if cfg.ft.enabled else ckpt
