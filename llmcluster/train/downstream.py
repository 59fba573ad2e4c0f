"""The `eval:` section: each new durable checkpoint (every `eval.interval_checkpoints`-th, and the last one)
is evaluated downstream by a job of its own, `llmcluster eval --model RUN --step N [--tasks ...]`, submitted
by rank 0 to the scheduler the run itself runs on (read from its environment: a Slurm job, a Kubernetes
pod, else local). On the local scheduler the job shares the training's cores, so it runs only when
`eval.local: true`; on Slurm it is an sbatch job of its own; Kubernetes is not supported yet (said once).

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
from llmcluster.storage import eval_log

PENDING = "pending"


def eval_argv(run: str, step: int, root: Path, tasks: list[str] | None) -> list[str]:
    """The evaluation job's command (a list: nothing of the config is ever put through a shell)."""
    argv = [sys.executable, "-m", "llmcluster", "eval", "--model", run, "--step", str(step), "--root", str(root)]
    return argv + (["--tasks", ",".join(tasks)] if tasks else [])


def render_sbatch(run: str, step: int, argv: list[str]) -> str:
    """The evaluation job's batch script (pure: the text only). Every value goes through the rendering boundary:
    the comment through comment_text (it cannot end the line early), the command through shell_join."""
    from llmcluster.render import comment_text, shell_join

    return (f"#!/bin/bash\n# llmcluster: downstream evaluation of {comment_text(run)} step {comment_text(step)}\n"
            f"exec {shell_join(argv)}\n")


def sbatch_argv(run: str, step: int, out: Path, script: Path) -> list[str]:
    """sbatch's command line for the script (pure). The job name is a directive value (its small grammar); the
    output path a directive path (its grammar, '%' doubled: sbatch reads %j-style patterns in it); the script
    positional."""
    from llmcluster.render import argv_element, directive_path, directive_value

    return ["sbatch", "--parsable", f"--job-name={directive_value(f'{run}-eval-{step}', 'eval job name')}",
            f"--output={directive_path(out, 'eval job output')}", "--nodes=1",
            argv_element(script, "eval job script", positional=True)]


def _local_alive(pid: object, step: int) -> bool:
    """The pid is alive and is still our evaluation of `step` (a pid can be reused)."""
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        # an ended job the training (its parent) has not reaped is a zombie: ended
        if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X"):
            return False
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except (OSError, IndexError):
        return False
    if not raw:   # a process caught in its exec shows no command line yet: alive, keep what it may read
        return True
    argv = raw.split(b"\0")
    return b"eval" in argv and str(step).encode() in argv


def _slurm_active(job_id: object) -> bool:
    from llmcluster.launch.scheduler import ACTIVE_STATES

    if not isinstance(job_id, str) or not job_id.isdigit():
        return False
    try:
        p = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%T"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return True      # unknown: keep the checkpoint rather than delete what may still be read
    return p.stdout.strip() in ACTIVE_STATES


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
        alive = _slurm_active(rec.get("job_id")) if rec.get("scheduler") == "slurm" else \
            _local_alive(rec.get("pid"), step)
        if alive:
            out.add(step)
    return out


class Downstream:
    """Rank 0's submitter; `checkpointed(step)` after each durable checkpoint. Disabled: a no-op."""

    def __init__(self, cfg, root: Path, logs: Path, enabled: bool, log=print, environ=os.environ):
        self.cfg, self.root, self.logs, self.log = cfg.eval, root, logs, log
        self.run = cfg.run.name
        self.scheduler = ("slurm" if environ.get("SLURM_JOB_ID") else
                          "k8s" if environ.get("KUBERNETES_SERVICE_HOST") else "local")
        self.count = 0
        self.procs: list[subprocess.Popen] = []   # local jobs, reaped as they end (poll)
        self.enabled = enabled and self.cfg is not None
        if self.enabled and self.scheduler == "local" and not self.cfg.local:
            self.log("eval: downstream evaluation jobs are off on the local scheduler (they compete for the "
                     "training's cores): set eval.local=true to run them")
            self.enabled = False
        elif self.enabled and self.scheduler not in ("local", "slurm"):
            self.log(f"eval: submitting evaluation jobs on {self.scheduler} is not supported yet: run "
                     "`llmcluster eval --model RUN --step N` for the checkpoints you want")
            self.enabled = False

    def checkpointed(self, step: int, final: bool = False) -> None:
        if not self.enabled:
            return
        self.procs = [p for p in self.procs if p.poll() is None]
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
            rec.update(self._submit(argv, out, step))
        except (OSError, subprocess.SubprocessError, RuntimeError, UserError) as e:
            self.log(f"warning: eval: could not submit the evaluation of step {step}: {e}")
            return
        tmp = folder / f".step_{step}.json.tmp"
        tmp.write_text(json.dumps(rec) + "\n")
        os.replace(tmp, folder / f"step_{step}.json")
        self.log(f"eval: step {step} submitted ({rec.get('job_id')}); results in {self.logs / 'eval.jsonl'}")

    def _submit(self, argv: list[str], out: Path, step: int) -> dict:
        if self.scheduler == "local":
            with open(out, "ab") as f:   # its own session: a Ctrl-C to the training does not reach it
                p = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     start_new_session=True)
            self.procs.append(p)
            return {"job_id": f"local-{p.pid}", "pid": p.pid}
        script = out.with_suffix(".sh")
        script.write_text(render_sbatch(self.run, step, argv))
        p = subprocess.run(sbatch_argv(self.run, step, out, script), capture_output=True, text=True, timeout=60)
        if p.returncode != 0:
            raise RuntimeError(p.stderr.strip() or f"sbatch exited {p.returncode}")
        return {"job_id": p.stdout.strip().split(";")[0]}
