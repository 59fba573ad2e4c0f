"""The launch spec: one job config + flags -> what every scheduler renders from.

A `LaunchSpec` is plain data (no I/O). The renderers in `local`, `slurm` and `k8s` are pure functions of it,
so what `--dry-run` prints is exactly what a launch submits, and the tests can check every form offline.
"""

from __future__ import annotations

import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path

from llmcluster.config.job import JobSpec
from llmcluster.errors import UserError

SCHEDULERS = ("local", "slurm", "k8s")
# torchrun forwards SIGTERM/SIGINT/SIGHUP/SIGQUIT to its workers by default; SIGUSR2 ("checkpoint now",
# SIGUSR1 belongs to NCCL) must be added, or the default action of SIGUSR2 kills the torchrun agent itself.
TORCHRUN_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR2"


class ShellVar(str):
    """A word the batch shell expands at run time ("$head:$port"); rendered in double quotes, unquoted
    otherwise. Only the renderers create these, from fixed text: user values are never ShellVars."""


def sh(word: str) -> str:
    if isinstance(word, ShellVar):
        return f'"{word}"'
    return shlex.quote(str(word))


def sh_join(words: list[str]) -> str:
    return " ".join(sh(w) for w in words)


def check_text(value: str, what: str) -> str:
    """Strings that reach a script are quoted; a newline or NUL in one is refused anyway (it would
    split an #SBATCH line or a log record, and no real path or argument needs it)."""
    if "\n" in value or "\r" in value or "\0" in value:
        raise UserError(f"{what} {value!r} contains a newline or NUL: refused")
    return value


@dataclass(frozen=True)
class LaunchSpec:
    run: str                       # run name: job name, log dir, k8s object name prefix
    scheduler: str
    root: Path                     # storage root on the submitting host (and on Slurm nodes: shared FS)
    job: JobSpec
    command: list[str]             # what every rank runs: ["-m", "llmcluster", "train", ...] or a program
    python: str = sys.executable   # interpreter on the nodes (outside containers)
    generic: bool = False          # True: `command` is a program (torchrun --no-python), not a module
    config_yaml: str = ""          # the resolved job config the trainer reads
    overrides: list[str] = field(default_factory=list)

    @property
    def logs(self) -> Path:
        return self.root / "logs" / self.run

    @property
    def config_path(self) -> Path:
        return self.logs / "config.yaml"

    def torchrun(self, python: str, rdzv: list[str], log_dir: str | None) -> list[str]:
        """`python -m torch.distributed.run ...` for one node; `rdzv` is the rendezvous flags."""
        j = self.job
        argv = [python, "-m", "torch.distributed.run", *rdzv, "--nproc-per-node", str(j.procs),
                "--max-restarts", "0", "--signals-to-handle", TORCHRUN_SIGNALS,
                # after forwarding a signal torchrun waits this long for the checkpoint before SIGKILL
                "--shutdown-timeout", str(j.signal_before_s)]
        if log_dir:
            argv += ["--log-dir", log_dir, "--tee", "3"]   # per-rank stdout/stderr files + the console
        if self.generic:
            argv += ["--no-python", *self.command]
        else:
            argv += self.command
        return argv


def trainer_command(config_path: str, root: str) -> list[str]:
    """The trainer, as every rank runs it under torchrun (torchrun supplies `python -u`)."""
    return ["-m", "llmcluster", "train", "--config", config_path, "--root", root, "--resume", "auto"]


def apply_flags(job: JobSpec, args) -> JobSpec:
    """Command-line flags override the config's job section (validated by the same model)."""
    from pydantic import BaseModel, ValidationError

    from llmcluster.config.load import explain

    class Wrapped(BaseModel):   # so errors name the key as in the config file: job.nodes
        job: JobSpec

    flags = {"nodes": args.nodes, "gpus_per_node": args.gpus_per_node, "procs_per_node": args.procs_per_node,
             "time": args.time, "partition": args.partition, "image": args.image,
             "max_requeues": getattr(args, "max_requeues", None)}
    data = job.model_dump()
    data.update({k: v for k, v in flags.items() if v is not None})
    if getattr(args, "k8s_kind", None):
        data["k8s"]["kind"] = args.k8s_kind
    if getattr(args, "namespace", None):
        data["k8s"]["namespace"] = args.namespace
    try:
        return Wrapped.model_validate({"job": data}).job
    except ValidationError as err:
        raise UserError(explain(err, Wrapped)) from None


def build_spec(cfg, args, root: Path) -> LaunchSpec:
    """The LaunchSpec for `llmcluster launch` from the validated JobConfig and the parsed flags."""
    import yaml

    from llmcluster.config.load import config_to_dict

    job = apply_flags(cfg.job, args)
    if job.gpus_per_node and job.procs > job.gpus_per_node:
        raise UserError(f"job.procs_per_node ({job.procs}) exceeds job.gpus_per_node ({job.gpus_per_node})")
    if args.scheduler == "local" and job.nodes > 1:
        raise UserError(f"--scheduler local runs on this machine only; job.nodes is {job.nodes} "
                        "(use --scheduler slurm or k8s)")
    if job.signal_before_s >= job.time_s:
        raise UserError(f"job.signal_before_s ({job.signal_before_s}) must be shorter than job.time ({job.time})")
    if args.scheduler == "k8s" and not job.image:
        raise UserError("--scheduler k8s needs a container image: --image or job.image")
    check_text(str(root), "storage root")
    for m in job.mounts:
        check_text(m.source, "mount")
    generic = bool(args.program)
    cfg = cfg.model_copy(update={"job": job})
    if args.scheduler == "k8s":
        storage = job.k8s.storage_path
        config_path = "/etc/llmcluster/config.yaml"     # from the ConfigMap
    else:
        storage = str(root)
        config_path = str(root / "logs" / cfg.run.name / "config.yaml")
    command = [check_text(c, "command word") for c in args.program] if generic else \
        trainer_command(config_path, storage)
    python = "python" if (job.image or args.scheduler == "k8s") else sys.executable
    return LaunchSpec(run=cfg.run.name, scheduler=args.scheduler, root=root, job=job, command=command,
                      python=check_text(python, "python"), generic=generic,
                      config_yaml=yaml.safe_dump(config_to_dict(cfg), sort_keys=False),
                      overrides=list(args.overrides))

