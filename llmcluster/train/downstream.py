"""The `eval:` section: each new durable checkpoint (every `eval.interval_checkpoints`-th, and the last one)
is evaluated downstream by a job of its own, `llmcluster eval --model RUN --step N [--tasks ...]`, submitted
by rank 0 to the scheduler the run itself runs on (read from its environment: a Slurm job, a Kubernetes
pod, else local) through its `Scheduler` object (launch/scheduler.py: submit_command, command_active), the same
code for each. On the local scheduler the job shares the training's cores, so it runs only when `eval.local: true`;
on Slurm it is an sbatch job of its own; Kubernetes is not supported yet (said once).

A submitted evaluation is pending until `logs/<run>/eval.jsonl` has a line for its step or its job has
ended: `logs/<run>/eval/pending/step_<N>.json` records it. Its task files are checked as data (eval/taskdata.py)
before each submission, as `llmcluster eval` checks them again when the job runs, and checkpoint retention keeps a step whose
evaluation is pending (`pending_steps`). No torch here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from llmcluster.errors import UserError
from llmcluster.launch.scheduler import Command, get, under
from llmcluster.storage import eval_log
from llmcluster.storage.owned import replace_atomically

PENDING = "pending"


def eval_argv(run: str, step: int, root: Path, tasks: list[str] | None) -> list[str]:
    """The evaluation job's command (a list: nothing of the config is ever put through a shell)."""
    argv = [sys.executable, "-m", "llmcluster", "eval", "--model", run, "--step", str(step), "--root", str(root)]
    return argv + (["--tasks", ",".join(tasks)] if tasks else [])


def command(run: str, step: int, argv: list[str], out: Path) -> Command:
    """The evaluation of `step` as a job of its own, for whichever scheduler runs it."""
    return Command(f"{run}-eval-{step}", f"downstream evaluation of {run} step {step}", argv, out)


def marks(step: int) -> tuple[str, ...]:
    """Words the evaluation job's command line carries (a recorded pid is believed only while it does)."""
    return ("eval", str(step))


def render_sbatch(run: str, step: int, argv: list[str]) -> str:
    """The evaluation job's batch script as the Slurm scheduler writes it (pure: the text only)."""
    from llmcluster.launch.slurm import command_script

    return command_script(command(run, step, argv, Path()).title, argv)


def sbatch_argv(run: str, step: int, out: Path, script: Path) -> list[str]:
    """sbatch's command line for the evaluation job as the Slurm scheduler runs it (pure)."""
    from llmcluster.launch import slurm

    return slurm.sbatch_argv(script, slurm.command_options(command(run, step, [], out).name, out))


def pending_steps(logs: Path) -> set[int]:
    """Checkpoint steps whose downstream evaluation has neither a result nor ended."""
    folder = logs / "eval" / PENDING
    if not folder.is_dir():
        return set()
    done = eval_log.steps(logs)
    out = set()
    for f in folder.glob("step_*.json"):
        try:
            rec = json.loads(f.read_text())
            step = int(rec["step"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if step in done:
            continue
        try:
            sched = get(str(rec.get("scheduler", "local")))
        except UserError:      # not a scheduler we submit to: nothing of ours is running
            continue
        if sched.command_active(rec, marks(step)):
            out.add(step)
    return out


class Downstream:
    """Rank 0's submitter; `checkpointed(step)` after each durable checkpoint. Disabled: a no-op."""

    def __init__(self, cfg, root: Path, logs: Path, enabled: bool, log=print, environ=os.environ):
        self.cfg, self.root, self.logs, self.log = cfg.eval, root, logs, log
        self.run = cfg.run.name
        self.scheduler = under(environ)
        self.count = 0
        self.enabled = enabled and self.cfg is not None
        self.sched = get(self.scheduler) if self.enabled else None
        if self.enabled and self.scheduler == "local" and not self.cfg.local:
            self.log("eval: downstream evaluation jobs are off on the local scheduler (they compete for the "
                     "training's cores): set eval.local=true to run them")
            self.enabled = False
        elif self.enabled and not self.sched.runs_commands:
            self.log(f"eval: submitting evaluation jobs on {self.scheduler} is not supported yet: run "
                     "`llmcluster eval --model RUN --step N` for the checkpoints you want")
            self.enabled = False

    @property
    def procs(self) -> list:
        """The evaluation jobs this process started as its children and has not reaped (the local scheduler's)."""
        return getattr(self.sched, "started", [])

    def checkpointed(self, step: int, final: bool = False) -> None:
        if not self.enabled:
            return
        self.count += 1
        if self.count % self.cfg.interval_checkpoints and not final:
            return
        from llmcluster.eval.tasks import resolve

        try:   # task files read as data now (no harness, no torch), so a refused file costs no job
            resolve(",".join(self.cfg.tasks) if self.cfg.tasks else None)
        except UserError as e:
            self.log(f"warning: eval: the evaluation of step {step} is not submitted: {e}")
            return
        argv = eval_argv(self.run, step, self.root, self.cfg.tasks)
        folder = self.logs / "eval" / PENDING
        folder.mkdir(parents=True, exist_ok=True)
        out = self.logs / "eval" / f"job-step_{step}.log"
        rec = {"step": step, "scheduler": self.scheduler, "argv": argv,
               "submitted_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        try:
            rec.update(self.sched.submit_command(command(self.run, step, argv, out)))
        except (OSError, subprocess.SubprocessError, UserError) as e:
            self.log(f"warning: eval: could not submit the evaluation of step {step}: {e}")
            return
        replace_atomically(folder / f"step_{step}.json", json.dumps(rec) + "\n")   # storage/owned.py
        self.log(f"eval: step {step} submitted ({rec.get('job_id')}); results in {self.logs / 'eval.jsonl'}")
