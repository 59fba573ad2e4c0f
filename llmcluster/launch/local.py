"""local: `torchrun --standalone` on this machine (the embedded default), per-rank logs under logs/<run>/ranks.

The launch runs in the foreground: its exit code is the job's, and `jobs status` reads it from job.json.
job.secret_env is inherited from the launching shell (checked present, never written anywhere).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from llmcluster.errors import UserError
from llmcluster.distributed import LOOPBACK_ENV
from llmcluster.launch.scheduler import Command, Scheduler
from llmcluster.launch.spec import LaunchSpec
from llmcluster.render import comment_text, shell_export, shell_join


SERVER_MODULE = b"vllm.entrypoints.openai.api_server"   # a serving job's process (serve/start.py)
SERVER_LOG = "server.log"
CANCEL_WAIT_S = 90     # vLLM takes up to a minute to shut down: `jobs cancel` waits that long before it says CANCELLED


def local_env(spec: LaunchSpec) -> dict[str, str]:
    """The ranks' environment on this machine: every listener on loopback (distributed/loopback.py: the TCPStores,
    gloo's pairs), which keeps the network out, not the machine's other users."""
    return {**spec.rank_env(), **LOOPBACK_ENV}


def missing_secrets(spec: LaunchSpec) -> list[str]:
    return [n for n in spec.job.secret_env if n not in os.environ]


AGENTS = {b"torch.distributed.run", b"llmcluster.distributed.loopback"}   # the modules a rank's agent runs as


def _cmdline(pid: int) -> list[bytes]:
    """The process's argv as /proc has it (OSError: no such process); empty while it is caught in its exec, and for
    a zombie."""
    raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    return raw.removesuffix(b"\0").split(b"\0") if raw else []


class Local(Scheduler):
    name = "local"
    artifact = "launch.sh"
    runs_commands = True

    def __init__(self):
        self.started: list[subprocess.Popen] = []   # command jobs of this process, reaped as they end

    def check(self, spec: LaunchSpec) -> None:
        if spec.job.nodes > 1:
            raise UserError(f"--scheduler local runs on this machine only; job.nodes is {spec.job.nodes} "
                            "(use --scheduler slurm or k8s)")

    def argv(self, spec: LaunchSpec) -> list[str]:
        if spec.ft and not spec.generic:
            # ft: the supervisor `train --procs-per-node P` is (launch/ft_local.py): the Lighthouse and one
            # torchrun world per replica group, each restarted alone
            return [spec.python, *spec.command, "--procs-per-node", str(spec.job.procs)]
        # --standalone: a c10d store on a free local port, so --max-restarts works (static can't)
        return spec.torchrun(spec.python, "standalone", "", str(spec.logs / "ranks"), loopback=True)

    def render(self, spec: LaunchSpec) -> str:
        """The command as a shell script (what --dry-run prints and launch.sh holds)."""
        lines = ["#!/bin/bash",
                 f"# llmcluster launch: run {comment_text(spec.run)} on this machine, {spec.job.procs} process(es)",
                 "set -euo pipefail", "umask 027"]
        if spec.job.secret_env:
            lines.append("# from the launching environment (never written here): "
                         + comment_text(" ".join(spec.job.secret_env)))
        lines += [shell_export(k, v) for k, v in local_env(spec).items()]
        lines.append("exec " + shell_join(self.argv(spec)))
        return "\n".join(lines) + "\n"

    def submit(self, spec: LaunchSpec, artifact: Path, record: dict, write_record, **flags) -> int:
        """Run to completion in the foreground."""
        if missing := missing_secrets(spec):
            raise UserError(f"job.secret_env: {', '.join(missing)} not set in this environment")
        if spec.ft and not spec.generic:
            return self._supervise_ft(spec, record)
        (spec.logs / "ranks").mkdir(parents=True, exist_ok=True)
        proc = subprocess.Popen(self.argv(spec), env={**os.environ, **local_env(spec)}, start_new_session=True)
        write_record({**record, "job_id": f"local-{proc.pid}", "pid": proc.pid, "state": "RUNNING"})
        try:
            rc = proc.wait()
        except KeyboardInterrupt:
            # Ctrl-C: torchrun forwards SIGINT to the ranks; give them their checkpoint grace period
            proc.send_signal(signal.SIGINT)
            rc = proc.wait()
        write_record({**record, "job_id": f"local-{proc.pid}", "pid": proc.pid,
                      "state": "COMPLETED" if rc == 0 else "FAILED", "exit_code": rc})
        print(f"[llmcluster] run {spec.run} exited with {rc}; logs in {spec.logs}", file=sys.stderr)
        return rc

    def _supervise_ft(self, spec: LaunchSpec, record: dict) -> int:
        """In this process, as `train --procs-per-node` does: the supervisor keeps job.json (every group's pids and
        state, on top of this launch's record) and handles Ctrl-C / SIGTERM (every group checkpoints)."""
        from llmcluster.config.load import load_job_config
        from llmcluster.launch.ft_local import Supervisor

        cfg = load_job_config(str(spec.config_path), [])
        group_argv = self.argv(spec)[3:]     # after `python -m llmcluster`
        return Supervisor(cfg, spec.root, group_argv, spec.job.procs, base=record, env=local_env(spec)).run()

    def _alive(self, logs: Path, rec: dict) -> int | None:
        """The launcher's pid if it is alive AND is this run's torchrun (a serving job's: its vLLM server, on
        the recorded port) AND leads its process group (we start ours in a session of their own, so killpg
        reaches only it): job.json is a user-writable file, so a pid in it is checked before anything is
        signalled."""
        pid = self._ours(logs, rec)
        try:
            return pid if pid is not None and os.getpgid(pid) == pid else None
        except OSError:
            return None

    def _ours(self, logs: Path, rec: dict) -> int | None:
        """The recorded pid if it is alive and its command line is this job's (leader or not)."""
        try:
            pid = int(rec["pid"])
            cmd = _cmdline(pid)
        except (KeyError, ValueError, TypeError, OSError):
            return None
        if rec.get("kind") == "serve":
            port = str(rec.get("port")).encode()
            ours = SERVER_MODULE in cmd and any(a == b"--port" and b == port for a, b in zip(cmd, cmd[1:]))
        elif rec.get("ft"):   # ft's supervisor (launch/ft_local.py): `python -m llmcluster train|launch ...`
            ours = b"llmcluster" in cmd and (b"train" in cmd or b"launch" in cmd)
        else:
            # torchrun's agent, as spec.torchrun starts it (a local run's: through distributed/loopback.py)
            ours = bool(AGENTS & set(cmd)) and str(logs / "ranks").encode() in cmd
        return pid if ours and pid > 1 else None

    def state(self, logs: Path, rec: dict) -> dict:
        if rec.get("state") == "RUNNING":
            if self._alive(logs, rec) is None and rec.get("cancel_requested"):
                return {"state": "CANCELLED"}
            if self._alive(logs, rec) is None:
                gone = "the server is gone (its log says why)" if rec.get("kind") == "serve" else \
                    "the launcher is gone without recording an exit code"
                return {"state": "LOST", "detail": gone}
            return {"state": "RUNNING"}
        return {"state": rec.get("state", "UNKNOWN"), "exit_code": rec.get("exit_code")}

    def log_files(self, logs: Path, rec: dict) -> list[Path]:
        if rec.get("kind") == "serve":
            return [logs / SERVER_LOG]
        # torchrun --log-dir: ranks/<id>/attempt_<n>/<local rank>/{stdout,stderr}.log
        return sorted((logs / "ranks").glob("*/attempt_*/*/std*.log"))

    def cancel(self, logs: Path, rec: dict) -> str | None:
        """SIGTERM to the job's process group. A serving job (no foreground launcher records its end) is waited
        for, up to CANCEL_WAIT_S, and recorded CANCELLED once gone; the line to print when it is not yet."""
        what = "vLLM server" if rec.get("kind") == "serve" else "torchrun"
        if self._ours(logs, rec) is None:
            raise UserError(f"{rec['run']} is not running (no live {what} of it)")
        pid = self._alive(logs, rec)
        if pid is None:   # we start ours in a session of their own: a pid that leads no group is not one we started
            pid = rec["pid"]
            raise UserError(f"{rec['run']}: pid {pid} is alive but does not lead its process group, so it is not "
                            f"the {what} llmcluster started; nothing signalled")
        try:
            os.killpg(pid, signal.SIGTERM)  # torchrun forwards it (the ranks checkpoint); vLLM shuts down
        except ProcessLookupError:
            pass
        if rec.get("kind") != "serve":
            return None
        from llmcluster.storage.job_record import write_record

        write_record(logs, {**rec, "cancel_requested": True})
        print(f"stopping {rec['run']} (vLLM pid {pid}; up to {CANCEL_WAIT_S} s)", file=sys.stderr, flush=True)
        deadline = time.monotonic() + CANCEL_WAIT_S
        while self._alive(logs, rec) is not None and time.monotonic() < deadline:
            time.sleep(0.5)
        if self._alive(logs, rec) is not None:
            return (f"{rec['run']} is still stopping after {CANCEL_WAIT_S} s (vLLM pid {pid}); "
                    f"`llmcluster jobs status {rec['run']}` says CANCELLED once it is gone")
        write_record(logs, {**rec, "state": "CANCELLED"})
        return None

    def submit_command(self, cmd: Command) -> dict:
        """Start it in the background, in a session of its own: a Ctrl-C to the caller does not reach it."""
        self.started = [p for p in self.started if p.poll() is None]
        with open(cmd.output, "ab") as f:
            p = subprocess.Popen(cmd.argv, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                 start_new_session=True)
        self.started.append(p)
        return {"job_id": f"local-{p.pid}", "pid": p.pid}

    def command_active(self, rec: dict, marks: tuple[str, ...]) -> bool:
        pid = rec.get("pid")
        if not isinstance(pid, int) or pid <= 0:
            return False
        try:
            # an ended job its parent has not reaped yet is a zombie: ended
            if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X"):
                return False
            argv = _cmdline(pid)
        except (OSError, IndexError):
            return False
        if not argv:   # a process caught in its exec shows no command line yet: alive, keep what it may read
            return True
        return all(m.encode() in argv for m in marks)
