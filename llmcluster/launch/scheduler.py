"""The `Scheduler` interface every backend implements, and the registry `launch`/`jobs` dispatch through.

A backend renders a LaunchSpec (pure: what --dry-run prints is what is submitted), submits it, and answers
state / logs / cancel from the run's job.json record. Records are files a user can edit, so `cancel`
re-checks what it is about to stop (a pid's command line, a Slurm job's name, objects by label) rather
than trusting the ids in them.

A backend that `runs_commands` also runs a single command as a job of its own beside a run (the trainer's
downstream evaluations, train/downstream.py): `submit_command` and `command_active`, so the trainer never
calls a scheduler's tools itself and the local path is the same code as Slurm's.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from llmcluster.launch.spec import LaunchSpec

# States in which a job may still produce output: Slurm's non-terminal job states (squeue(1) "JOB STATE
# CODES": SIGNALING, STAGE_OUT and the REQUEUE_* forms are short-lived but real) plus the local and
# Kubernetes ones. Anything else is an end state.
ACTIVE_STATES = frozenset({
    "PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED", "RESIZING", "REQUEUED", "REQUEUE_FED",
    "REQUEUE_HOLD", "RESV_DEL_HOLD", "SIGNALING", "SPECIAL_EXIT", "STAGE_OUT", "STOPPED",
})


@dataclass(frozen=True)
class Command:
    """One command run as a job of its own: one process, no ranks. Its argv is never put through a shell (a
    backend that writes a script for it quotes each word through render.py)."""
    name: str          # the job's name on the scheduler
    title: str         # what it is, for a human reading the script (free text: a comment)
    argv: list[str]
    output: Path       # its stdout and stderr; a backend that writes a script puts it beside, as .sh


class Scheduler:
    name = ""
    artifact = ""          # the file under logs/<run>/launches/<n>/ holding what was submitted
    in_container = False   # the ranks see the storage at job.k8s.storage_path and run the image's python
    runs_commands = False  # submit_command / command_active are implemented

    def check(self, spec: LaunchSpec) -> None:
        """Refuse (UserError) what this scheduler cannot run, before anything is rendered or written."""

    def render(self, spec: LaunchSpec) -> str:
        raise NotImplementedError

    def submit(self, spec: LaunchSpec, artifact: Path, record: dict, write_record, **flags) -> int:
        """Submit the rendered artifact; `write_record(dict)` saves job.json; returns the exit code."""
        raise NotImplementedError

    def state(self, logs: Path, rec: dict) -> dict:
        raise NotImplementedError

    def log_files(self, logs: Path, rec: dict) -> list[Path]:
        return []

    def logs(self, logs: Path, rec: dict, follow: bool) -> int | None:
        """Print the job's output itself, or None: `jobs logs` then tails log_files()."""
        return None

    def cancel(self, logs: Path, rec: dict) -> str | None:
        """Stop the job; None once it is stopped (or asked to stop), else the line saying it is still stopping."""
        raise NotImplementedError

    def submit_command(self, cmd: Command) -> dict:
        """Start `cmd` as a job of its own; the fields a record needs to find it again (job_id, ...). Refusals
        and a failed submission raise (UserError, OSError, subprocess.SubprocessError)."""
        raise NotImplementedError

    def command_active(self, rec: dict, marks: tuple[str, ...]) -> bool:
        """Whether the command job `rec` (submit_command's fields, from a file a user can edit) may still be
        running: a pid is believed only while its command line carries every word of `marks` (pids are
        reused). When the scheduler cannot say, True: what the job may still read is kept."""
        return False


# lazily imported: `jobs list` on a login node needs neither the kubernetes client nor the Slurm CLIs
BACKENDS = {"local": ("llmcluster.launch.local", "Local"), "slurm": ("llmcluster.launch.slurm", "Slurm"),
            "k8s": ("llmcluster.launch.k8s", "Kubernetes"), "skypilot": ("llmcluster.launch.skypilot", "SkyPilot")}


def under(environ: Mapping[str, str]) -> str:
    """The scheduler this process runs under, from its environment: a Slurm job, a Kubernetes pod, else local."""
    return "slurm" if environ.get("SLURM_JOB_ID") else "k8s" if environ.get("KUBERNETES_SERVICE_HOST") else "local"


def get(name: str) -> Scheduler:
    import importlib

    if name not in BACKENDS:
        from llmcluster.errors import UserError
        raise UserError(f"unknown scheduler {name!r} (local, slurm, k8s or skypilot)")
    module, cls = BACKENDS[name]
    return getattr(importlib.import_module(module), cls)()
