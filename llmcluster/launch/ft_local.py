"""`llmcluster train --procs-per-node P` with ft.enabled: the Lighthouse and one supervised world per replica group.

The contract (docs/fault-tolerance.md, "Per-step fault tolerance"): the Lighthouse is a process of its own
(`torchft_lighthouse`, torchft's console script, bound to 127.0.0.1); each group is its own `llmcluster train
--procs-per-node P` (its own elastic launch, its own rendezvous on a free port; a group of one rank is that rank
alone, `llmcluster train` without the flag) with TORCHFT_LIGHTHOUSE,
LLMCLUSTER_FT_GROUP and LLMCLUSTER_FT_GROUPS in its environment. A group that exits non-zero is recorded
(ft_group_failed) and started again alone, at most MAX_RESTARTS times within RESTART_WINDOW_S; the others keep
stepping. A stop signal
(SIGTERM, Ctrl-C) is passed to every group (they checkpoint, as without ft); the Lighthouse dying stops the run the
same way: the groups cannot form a quorum without it, and the run resumes from its checkpoint when started again.
No torch here (a launcher): the groups import it.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from llmcluster.distributed import HOST_RANKS_ENV
from llmcluster.errors import (EXIT_DISK_FULL, EXIT_FAILURE, EXIT_FT_DROPPED, EXIT_FT_NO_QUORUM, EXIT_PREEMPTED,
                               EXIT_USAGE, UserError)
from llmcluster.launch.ft_auth import SECRET_ENV, create_secret
from llmcluster.render import argv_element
from llmcluster.testing import test_hook
from llmcluster.storage.events import EVENTS, read_events
from llmcluster.storage.job_record import write_record
from llmcluster.storage.run_end import recorded_end

GROUP_ENV, GROUPS_ENV, LIGHTHOUSE_ENV = "LLMCLUSTER_FT_GROUP", "LLMCLUSTER_FT_GROUPS", "TORCHFT_LIGHTHOUSE"
# "1" for a group started again while the others train: it joins as a reader (ft/writer.py), never
# re-taking the writer's lock its dead predecessor left (a live peer takes the role over instead).
REJOIN_ENV = "LLMCLUSTER_FT_REJOIN"
NOT_INSTALLED = "ft.enabled: true needs torchft, which is not installed here: pip install 'llmcluster[ft]'"
# Test hook (acts only with LLMCLUSTER_TESTING=1): seconds before a dead group is started again, so that a test can
# see the others commit steps without it however fast a restart is on the machine.
RESTART_DELAY_ENV = "LLMCLUSTER_TEST_FT_RESTART_DELAY_S"
MAX_RESTARTS = 3        # per group: a group that keeps dying is a bug or a bad node, not a transient fault
RESTART_WINDOW_S = 1800  # ... within this long: three faults a week apart in a month-long run are not a bad node
PROCS_FLAGS = ("--procs-per-node", "--nproc-per-node")
STOP_WAIT_S = 120.0     # after SIGTERM, how long the groups get to checkpoint before SIGKILL
POLL_S = 0.2


def in_group() -> bool:
    """This process is a group's own launch (started by the supervisor below)."""
    return GROUP_ENV in os.environ


def lighthouse_command() -> str:
    """torchft's console script beside this interpreter (a venv's bin), else on PATH; refused without the extra."""
    beside = Path(sys.executable).parent / "torchft_lighthouse"
    found = str(beside) if beside.is_file() else shutil.which("torchft_lighthouse")
    try:
        spec = importlib.util.find_spec("torchft")   # not imported: that would import torch
    except ImportError:
        spec = None
    if spec is None or found is None:
        raise UserError(NOT_INSTALLED)
    return found


def _die_with_parent() -> None:
    """In the child before exec (Linux): SIGTERM when the supervisor dies, even by SIGKILL, so that neither the
    Lighthouse nor a group (each in a session of its own) outlives it: the groups checkpoint and stop."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM))   # 1: PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tree(pid: int) -> list[int]:
    """`pid` and its live descendants (from /proc): torch's elastic agent starts each rank in a session of its own,
    so a signal to the group's process group does not reach its ranks, and a launcher killed outright leaves them
    running; the supervisor signals the whole tree."""
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        try:
            ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            children.setdefault(ppid, []).append(int(d.name))
        except (OSError, ValueError, IndexError):
            continue
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += children.get(p, [])
    return out


def _ours(pid: int) -> bool:
    try:
        return b"llmcluster" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


class Supervisor:
    def __init__(self, cfg, root: Path, argv: list[str], procs: int, base: dict | None = None,
                 env: dict[str, str] | None = None):
        """`base`: the launch record `llmcluster launch` made (launch id, artifact, code version...), kept in every
        job.json this writes; `env`: the launcher's rank environment, given to every group."""
        if procs < 1:
            raise UserError(f"--procs-per-node must be at least 1, got {procs}")
        groups = cfg.parallel.dp_replicate
        if groups < 2:
            raise UserError(f"ft.enabled needs parallel.dp_replicate >= 2 replica groups (got {groups})")
        self.cfg, self.argv, self.groups = cfg, argv, groups
        self.base, self.env = base or {}, env or {}
        self.logs = root / "logs" / cfg.run.name
        self.exe = lighthouse_command()
        self.lighthouse = None
        self.address = cfg.ft.lighthouse or f"127.0.0.1:{_free_port()}"
        self.procs: list[subprocess.Popen | None] = [None] * groups
        self.restarts = [0] * groups
        self.failed_at: list[list[float]] = [[] for _ in range(groups)]   # each group's failures, for the window
        self.dropped = [0] * groups   # times each group left the quorum as a straggler (not failures)
        self.waited = [0] * groups    # times each group gave up waiting for a quorum (not failures: the others')
        self.done = [False] * groups
        self.trees: list[list[int]] = [[] for _ in range(groups)]   # each group's launcher and ranks, as last seen
        self.seen = 0.0
        self.restart_at: dict[int, float] = {}   # group -> when to start it again
        self.stopping = None   # why every group is being stopped (a signal, the Lighthouse's death)
        self.ckpt_dir = root / "checkpoints" / cfg.run.name
        self.end_seen: float | None = None   # when this supervisor saw the run's final step committed

    # -- processes ---------------------------------------------------------------------------------
    def _start_lighthouse(self) -> None:
        if self.cfg.ft.lighthouse:   # a running one, named by the config: not ours to start or stop
            return
        ft = self.cfg.ft
        argv = [self.exe, "--min_replicas", str(ft.min_replicas), "--join_timeout_ms",
                str(int(ft.join_timeout_s * 1000)), "--bind", argv_element(self.address, "the Lighthouse's address")]
        with open(self.logs / "ft" / "lighthouse.log", "ab") as out:
            self.lighthouse = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                               preexec_fn=_die_with_parent)

    def _start_group(self, g: int) -> None:
        env = {"RUST_LOG": "warn", **os.environ, **self.env, GROUP_ENV: str(g), GROUPS_ENV: str(self.groups),
               SECRET_ENV: str(self.secret), HOST_RANKS_ENV: str(self.groups * int(self.argv_procs())),
               LIGHTHOUSE_ENV: f"http://{self.address}", REJOIN_ENV: "1" if self.procs[g] is not None else "0"}
        cmd = [sys.executable, "-m", "llmcluster", *self._group_argv()]
        if g == 0:   # the writer's lines on the terminal, as a run without ft; the others' in their files
            self.procs[g] = subprocess.Popen(cmd, env=env, start_new_session=True, preexec_fn=_die_with_parent)
            return
        with open(self.logs / "ft" / f"group{g}.log", "ab") as out:
            self.procs[g] = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                             start_new_session=True, preexec_fn=_die_with_parent)

    def _group_argv(self) -> list[str]:
        """A group of one rank is that rank alone, without an elastic agent of its own: one torch start less (~2 s
        of CPU) at every start and restart, so a dead group is back sooner; the rank exits with the codes the agent
        would pass on (train/procs.py) and takes the supervisor's signals itself. A larger group: its own launch."""
        for i, a in enumerate(self.argv):
            flag, eq, value = a.partition("=")
            if flag in PROCS_FLAGS and (value if eq else self.argv[i + 1:i + 2]) in ("1", ["1"]):
                return self.argv[:i] + self.argv[i + (1 if eq else 2):]
        return self.argv

    def _look(self, force: bool = False) -> bool:
        """Each live group's launcher and ranks from /proc (at most once a second unless forced); True if one
        changed. A scan that raced its launcher's death is dropped: a launcher killed outright hands its ranks to
        init before wait() sees it dead, so that scan finds it alone, and the ranks the supervisor must kill were
        forgotten (seen under load: they trained on as a ghost group beside the group's restart, and the run hung)."""
        if not force and time.monotonic() - self.seen <= 1.0:
            return False
        self.seen = time.monotonic()
        changed = False
        for g, p in enumerate(self.procs):
            if p is not None and p.poll() is None:
                tree = _tree(p.pid)
                if p.poll() is None and tree != self.trees[g]:
                    self.trees[g], changed = tree, True
        return changed

    def _signal_group(self, g: int, sig: int) -> None:
        for pid in self.trees[g]:
            if _ours(pid):
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass

    def _signal_groups(self, sig: int) -> None:
        self._look(force=True)
        for g, p in enumerate(self.procs):
            if p is not None and (p.poll() is None or sig == signal.SIGKILL):
                self._signal_group(g, sig)

    # -- records -----------------------------------------------------------------------------------
    def _event(self, kind: str, **fields) -> None:
        """A supervisor's line in events.jsonl (the writer rank's file; appended in one write)."""
        path = self.logs / EVENTS
        recs = read_events(path, warn=None) if path.is_file() else []
        attempt = max((r["attempt"] for r in recs), default=1)
        step = max((r["step"] for r in recs), default=0)
        line = json.dumps({"t": round(time.time(), 6), "attempt": attempt, "event": kind, "step": step, **fields})
        with open(path, "a") as f:
            f.write(line + "\n")

    def _record(self, state: str, code: int | None = None) -> None:
        self._look(force=True)
        groups = [{"group": g, "pid": p.pid if p else None, "pids": self.trees[g], "restarts": self.restarts[g],
                   "dropped": self.dropped[g], "waited": self.waited[g], "state": self._state(g, p)}
                  for g, p in enumerate(self.procs)]
        rec = {**self.base, "run": self.cfg.run.name, "scheduler": "local", "kind": "train", "job_id": f"local-{os.getpid()}",
               "pid": os.getpid(), "state": state, "procs_per_node": int(self.argv_procs()),
               "ft": {"lighthouse": self.address, "lighthouse_pid": self.lighthouse.pid if self.lighthouse else None,
                      "groups": groups}}
        if code is not None:
            rec["exit_code"] = code
        write_record(self.logs, rec)

    def _state(self, g: int, p) -> str:
        if self.done[g]:
            return "COMPLETED"
        if p is not None and p.poll() is None:
            return "RUNNING"
        return "DROPPED" if p is not None and p.returncode == EXIT_FT_DROPPED else "DOWN"

    def argv_procs(self) -> str:
        for flag in PROCS_FLAGS:
            if flag in self.argv:
                return self.argv[self.argv.index(flag) + 1]
        return "1"

    # -- the loop ----------------------------------------------------------------------------------
    def run(self) -> int:
        (self.logs / "ft").mkdir(parents=True, exist_ok=True)
        self.secret = create_secret(self.logs / "ft")   # who belongs to this launch of the run (launch/ft_auth.py)
        previous = {s: signal.signal(s, self._on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
        code = EXIT_FAILURE
        try:
            self._start_lighthouse()
            for g in range(self.groups):
                self._start_group(g)
            self._record("RUNNING")
            code = self._supervise()
        finally:
            self._signal_groups(signal.SIGKILL)
            if self.lighthouse is not None and self.lighthouse.poll() is None:
                self.lighthouse.terminate()
                self.lighthouse.wait()
            for s, h in previous.items():
                signal.signal(s, h)
            self._record("COMPLETED" if code == 0 else "FAILED", code)
        print(f"[llmcluster] run {self.cfg.run.name} exited with {code}; logs in {self.logs}", file=sys.stderr)
        return code

    def _on_signal(self, signum, _frame) -> None:
        if self.stopping is None:
            self.stopping = signal.Signals(signum).name

    def _supervise(self) -> int:
        while True:
            if self.stopping:
                return self._stop(f"{self.stopping}: stopping every group (they checkpoint)")
            if self.lighthouse is not None and self.lighthouse.poll() is not None:
                self._event("ft_lighthouse_lost", code=self.lighthouse.returncode)
                return self._stop(f"the Lighthouse exited ({self.lighthouse.returncode}): stopping every group; "
                                  "run the same command again to resume from the last checkpoint")
            if self._look():   # the ranks a launcher started: job.json (`jobs status`) names every pid of a group
                self._record("RUNNING")
            for g, at in list(self.restart_at.items()):
                if time.monotonic() >= at:
                    del self.restart_at[g]
                    self._start_group(g)
                    self._record("RUNNING")
            for g, p in enumerate(self.procs):
                rc = p.poll() if p is not None and not self.done[g] and g not in self.restart_at else None
                if rc is None:
                    continue
                if rc == 0 or self.end_seen is not None:   # after the run's end nothing is started again
                    self.done[g] = True
                elif rc in (EXIT_USAGE, EXIT_DISK_FULL):   # bad input: every group would say the same; a full
                    self._stop("")                          # disk: a restart would only fill it again
                    return rc
                elif rc == EXIT_FT_DROPPED:   # a straggler the others left behind: not a failure, back later
                    self.dropped[g] += 1
                    backoff = self.cfg.ft.straggler_backoff_s
                    print(f"[llmcluster] replica group {g} left the quorum as a straggler; starting it again in "
                          f"{backoff:g} s (ft.straggler_backoff_s)", file=sys.stderr, flush=True)
                    self.restart_at[g] = time.monotonic() + backoff
                elif rc == EXIT_FT_NO_QUORUM:   # it waited for groups that did not come: theirs is the failure
                    self._group_waited(g, rc)
                else:
                    if not self._group_failed(g, p, rc):
                        return self._stop(f"group {g} failed {MAX_RESTARTS + 1} times within "
                                          f"{RESTART_WINDOW_S // 60} min: stopping the run")
                self._record("RUNNING")
            if all(self.done) or self._after_end():
                return 0
            time.sleep(POLL_S)

    def _after_end(self) -> bool:
        """Invariant 4 (docs/fault-tolerance.md): once the run's final step is committed (storage/run_end.py), no
        group is started again, and the groups still running after ft.end_grace_s (a frozen or stuck one: a healthy
        group sees the end itself within a step or a quorum wait) are killed, not waited for: the run's end is
        durable, nothing of theirs is to save. True when the job may end (exit 0)."""
        if self.end_seen is None:
            end = recorded_end(self.ckpt_dir, self.cfg.train.last_step)
            if end is None:
                return False
            self.end_seen = time.monotonic()
            for g in list(self.restart_at):
                del self.restart_at[g]
                self.done[g] = True   # the run it would rejoin has ended
            self._event("ft_run_end_seen", last_step=end[0], weights_sha256=end[1],
                        running=[g for g, p in enumerate(self.procs) if p is not None and not self.done[g]])
        if time.monotonic() - self.end_seen < self.cfg.ft.end_grace_s:
            return False
        late = [g for g, p in enumerate(self.procs) if p is not None and not self.done[g] and p.poll() is None]
        if late:
            waited = round(time.monotonic() - self.end_seen, 1)
            print(f"[llmcluster] the run finished at step {self.cfg.train.last_step}; group(s) "
                  f"{', '.join(map(str, late))} still running after ft.end_grace_s={self.cfg.ft.end_grace_s:g} s: "
                  "stopped (nothing of theirs to save)", file=sys.stderr, flush=True)
            self._look(force=True)
            for g in late:
                self._signal_group(g, signal.SIGKILL)
                self.done[g] = True
            # goodput: the tail from the end to here is the job's, not a step's (launch/goodput.py)
            self._event("ft_groups_stopped_after_end", groups=late, waited_s=waited)
        return True

    def _group_failed(self, g: int, p: subprocess.Popen, rc: int) -> bool:
        """Record the failure; True when the group is started again: at most MAX_RESTARTS failures within the last
        RESTART_WINDOW_S (job.json's `restarts` counts them all)."""
        self._signal_group(g, signal.SIGKILL)   # ranks its launcher left behind must not train on as a ghost group
        now = time.monotonic()
        self.restarts[g] += 1
        self.failed_at[g] = [t for t in self.failed_at[g] if now - t < RESTART_WINDOW_S] + [now]
        recent = len(self.failed_at[g])
        self._event("ft_group_failed", group=g, pids=self.trees[g], exit_code=rc)
        again = recent <= MAX_RESTARTS
        print(f"[llmcluster] replica group {g} (pid {p.pid}) exited with {rc}; the other groups keep training"
              + (f"; restarting it ({recent} of {MAX_RESTARTS} within {RESTART_WINDOW_S // 60} min)" if again
                 else ""), file=sys.stderr, flush=True)
        if again:
            self.restart_at[g] = now + float(test_hook(RESTART_DELAY_ENV) or 0)
        return again

    def _group_waited(self, g: int, rc: int) -> None:
        """A group that gave up waiting for a quorum (ft/quorum.py, QUORUM_TRIES) is started again at once and not
        charged: a healthy group waiting on a hung or dead one must not use up its own restart budget (issue 62,
        invariant 3); the group that hung is charged by its own exit (its watchdog's SIGKILL)."""
        self._signal_group(g, signal.SIGKILL)
        self.waited[g] += 1
        self._event("ft_group_waited", group=g, pids=self.trees[g], exit_code=rc)
        print(f"[llmcluster] replica group {g} gave up waiting for a quorum (exit {rc}); starting it again, not "
              "counted as its failure", file=sys.stderr, flush=True)
        self.restart_at[g] = time.monotonic() + float(test_hook(RESTART_DELAY_ENV) or 0)

    def _stop(self, why: str) -> int:
        """SIGTERM every live group, wait for their checkpoint, SIGKILL what is left. The run's code: 75 (resume
        it), unless a group said worse."""
        if why:
            print(f"[llmcluster] {why}", file=sys.stderr, flush=True)
        self._signal_groups(signal.SIGTERM)
        deadline = time.monotonic() + STOP_WAIT_S
        while any(p is not None and p.poll() is None for p in self.procs) and time.monotonic() < deadline:
            time.sleep(POLL_S)
        codes = {p.returncode for g, p in enumerate(self.procs) if p is not None and not self.done[g]}
        return EXIT_USAGE if EXIT_USAGE in codes else EXIT_PREEMPTED


def supervise(args) -> int | None:
    """The run's exit code when this `train --procs-per-node` is an ft run's launch; None otherwise."""
    if args.procs_per_node is None or in_group():
        return None
    from llmcluster.config.load import load_job_config
    from llmcluster.config.cluster_load import storage_root

    cfg = load_job_config(args.config, args.overrides)
    if not cfg.ft.enabled:
        return None
    return Supervisor(cfg, storage_root(args.root, cfg.run.storage), args.argv, args.procs_per_node).run()
