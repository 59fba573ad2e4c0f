"""The launch spec: one job config + flags -> what every scheduler renders from.

A `LaunchSpec` is plain data (no I/O). The schedulers render pure functions of it, so what `--dry-run`
prints is exactly what a launch submits, and the tests can check every form offline. The rank
environment and the torchrun command line (rendezvous included) are built here once for all of them.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path

from llmcluster.config.cluster import Cloud
from llmcluster.config.job import FLIGHT_RECORDER_DIR, FLIGHT_RECORDER_FILES, JobSpec
from llmcluster.config.schema import FtConfig
from llmcluster.errors import UserError
from llmcluster.render import line_text, show_value, yaml_text

# torchrun forwards SIGTERM/SIGINT/SIGHUP/SIGQUIT to its workers by default; SIGUSR2 ("checkpoint now",
# SIGUSR1 belongs to NCCL) must be added, or the default action of SIGUSR2 kills the torchrun agent itself.
TORCHRUN_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR2"
LAUNCHES = "launches"   # logs/<run>/launches/<n>/: one immutable directory per launch
LIGHTHOUSE = "torchft_lighthouse"      # torchft's console script (the `ft` extra): the groups' quorum
LIGHTHOUSE_PORT = 29510                # the Lighthouse's port where the launcher starts one (Slurm: the first tried)


@dataclass(frozen=True)
class LaunchSpec:
    run: str                       # run name: job name, log dir, k8s object name prefix
    scheduler: str
    root: Path                     # storage root on the submitting host (and on Slurm nodes: shared FS)
    job: JobSpec
    command: list[str]             # what every rank runs: ["-m", "llmcluster", "train", ...] or a program
    python: str = sys.executable   # interpreter on the nodes (outside containers)
    generic: bool = False          # True: `command` is a program (torchrun --no-python), not a module
    config_yaml: str = ""          # the resolved job config the trainer reads (job.env values redacted)
    overrides: list[str] = field(default_factory=list)
    launch_id: int = 1             # this launch's number under logs/<run>/launches/
    storage: str = ""              # the storage root as the ranks see it
    metrics_port: int | None = None  # the port of log.metrics_bind (rank r serves it + its local rank)
    host_paths: tuple[str, ...] = ()  # the cluster's scheduler.kubernetes.host_paths (never the job's own)
    cluster: str | None = None     # the cluster spec's name (recorded in job.json for the run's trackers)
    ft: FtConfig | None = None     # the job's ft section when ft.enabled (per-step fault tolerance), else None
    ft_groups: int = 0             # replica groups (parallel.dp_replicate) when ft.enabled: each its own world
    last_step: int = 0             # the run's final step (train.stop_at or train.steps): its end, for ft's launchers
    cloud: Cloud | None = None     # the cluster spec's cloud section (--scheduler skypilot), accelerators filled in

    @property
    def group_nodes(self) -> int:
        """Nodes per replica group (ft), or all of them: each group is a torchrun world of this many nodes."""
        return self.job.nodes // self.ft_groups if self.ft_groups else self.job.nodes

    @property
    def logs(self) -> Path:
        return self.root / "logs" / self.run

    @property
    def launch_dir(self) -> Path:
        return self.logs / LAUNCHES / str(self.launch_id)

    @property
    def config_path(self) -> Path:
        """The config this launch's ranks read: written once, read-only, never replaced by a later
        launch (a queued or requeued job re-reads it)."""
        return self.launch_dir / "config.yaml"

    @property
    def config_sha256(self) -> str:
        """The sha256 of the config this launch writes (UTF-8): recorded in job.json, and checked by a queued
        Slurm job before it trains (launch/slurm.py), so a config.yaml swapped after the launch is refused."""
        import hashlib

        return hashlib.sha256(self.config_yaml.encode("utf-8")).hexdigest()

    def rank_env(self) -> dict[str, str]:
        """The environment every rank gets from the launcher (secrets are not in it: they never are
        rendered; each scheduler passes job.secret_env its own way)."""
        j = self.job
        env = {**j.environment(), "LLMCLUSTER_STORAGE": self.storage,
               # torchrun shares one bootstrap TCPStore across rendezvous rounds by default, without a
               # per-round key prefix: after a restart the new ranks can read the dead ranks' gloo/NCCL
               # addresses from the last round and hang in init_process_group (seen here after a SIGKILL).
               # Opting out gives every round a fresh store.
               "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
        if j.gpus_per_node == 0:
            env.setdefault("OMP_NUM_THREADS", "1")   # CPU ranks: no oversubscription by default
        else:  # the flight recorder's dumps (torch appends the rank) beside the run's other logs
            dump = f"{self.storage or self.root}/logs/{self.run}/{FLIGHT_RECORDER_DIR}/rank_"
            env |= j.preset_unless_set(FLIGHT_RECORDER_FILES, dump)
        return env

    def torchrun(self, python: str, endpoint: str, rdzv_id: str, log_dir: str | None,
                 node_rank: str | None = None, loopback: bool = False) -> list[str]:
        """`python -m torch.distributed.run ...` for one node.

        c10d rendezvous at `endpoint` (also for one node: the static rendezvous cannot restart), and
        --max-restarts: when a rank dies its agent stops the local ranks, every agent re-rendezvouses
        and the whole group restarts (the trainer resumes from the last complete checkpoint). With ft each
        replica group is such a world of its own (group_nodes nodes)."""
        j = self.job
        # loopback (a local run): the agent's store listens on 127.0.0.1 (distributed/loopback.py), and the
        # ranks are told that address, not the host name's
        argv = [python, "-m", "llmcluster.distributed.loopback" if loopback else "torch.distributed.run"]
        if loopback:
            argv += ["--local-addr", "127.0.0.1"]
        if endpoint == "standalone":
            argv += ["--standalone"]
        else:
            argv += ["--nnodes", str(self.group_nodes), "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint,
                     "--rdzv-id", rdzv_id]
            if node_rank:      # not needed by c10d, but keeps rank 0 on pod 0 for readable logs
                argv += ["--node-rank", node_rank]
        argv += ["--nproc-per-node", str(j.procs), "--max-restarts", str(j.max_restarts),
                 "--signals-to-handle", TORCHRUN_SIGNALS,
                 # after forwarding a signal torchrun waits this long for the checkpoint before SIGKILL
                 "--shutdown-timeout", str(j.signal_before_s)]
        if log_dir:
            argv += ["--log-dir", log_dir, "--tee", "3"]   # per-rank stdout/stderr files + the console
        if self.generic:
            argv += ["--no-python", *self.command]
        else:
            argv += self.command
        return argv


def lighthouse_argv(program: str, ft: FtConfig, bind: str) -> list[str]:
    """The Lighthouse a launcher starts for an ft run (Slurm: a step on the batch host; Kubernetes: a
    Deployment): its quorum needs ft.min_replicas groups and waits ft.join_timeout_s for more."""
    return [program, "--min_replicas", str(ft.min_replicas), "--join_timeout_ms", str(int(ft.join_timeout_s * 1000)),
            "--bind", bind]


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
             "max_requeues": getattr(args, "max_requeues", None),
             "max_restarts": getattr(args, "max_restarts", None)}
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


def ft_groups(cfg, job: JobSpec, scheduler: str = "slurm") -> int:
    """The replica groups of an ft run: parallel.dp_replicate, which must be set and split the nodes evenly
    (each group is a torchrun world of whole nodes, restarted alone)."""
    groups = cfg.parallel.dp_replicate
    if cfg.ft.spare_nodes and scheduler != "slurm":
        raise UserError(f"ft.spare_nodes ({cfg.ft.spare_nodes}) is for Slurm only (Kubernetes reschedules a lost "
                        f"node's pods itself), not scheduler {scheduler!r}")
    if groups == -1:
        raise UserError("ft.enabled needs parallel.dp_replicate set to the number of replica groups (not -1)")
    if job.nodes % groups:
        raise UserError(f"ft.enabled: job.nodes ({job.nodes}) does not split evenly into parallel.dp_replicate "
                        f"({groups}) replica groups")
    return groups


def next_launch_id(logs: Path) -> int:
    """One more than the highest launch number under logs/<run>/launches/ (1 for a new run)."""
    d = logs / LAUNCHES
    try:
        ids = [int(p.name) for p in d.iterdir() if p.name.isdigit()] if d.is_dir() else []
    except OSError as e:          # a name too long for the filesystem, a directory we may not read
        raise UserError(f"cannot read {show_value(str(d))}: {e.strerror or e}") from None
    return max(ids, default=0) + 1


def build_spec(cfg, args, root: Path, host_paths: list[str] | tuple[str, ...] = (),
               cluster: str | None = None, cloud: Cloud | None = None) -> LaunchSpec:
    """The LaunchSpec for `llmcluster launch` from the validated JobConfig and the parsed flags; host_paths
    from the cluster spec."""
    from llmcluster.config.load import saved_config_dict
    from llmcluster.launch.scheduler import get

    sched = get(args.scheduler)
    job = apply_flags(cfg.job, args)
    if job.gpus_per_node and job.procs > job.gpus_per_node:
        raise UserError(f"job.procs_per_node ({job.procs}) exceeds job.gpus_per_node ({job.gpus_per_node})")
    if job.signal_before_s >= job.time_s:
        raise UserError(f"job.signal_before_s ({job.signal_before_s}) must be shorter than job.time ({job.time})")
    line_text(str(root), "storage root")
    generic = bool(args.program)
    cfg = cfg.model_copy(update={"job": job})
    logs = root / "logs" / cfg.run.name
    launch_id = next_launch_id(logs)
    if sched.in_container:
        from llmcluster.launch.k8s import CONFIG_DIR
        storage, config_path = job.k8s.storage_path, f"{CONFIG_DIR}/config.yaml"   # from the ConfigMap
    else:
        storage, config_path = str(root), str(logs / LAUNCHES / str(launch_id) / "config.yaml")
    command = [line_text(c, "command word") for c in args.program] if generic else \
        trainer_command(config_path, storage)
    python = "python" if (job.image or sched.in_container) else sys.executable
    spec = LaunchSpec(run=cfg.run.name, scheduler=args.scheduler, root=root, job=job, command=command,
                      python=line_text(python, "python"), generic=generic,
                      config_yaml=yaml_text([saved_config_dict(cfg)]),
                      overrides=list(args.overrides), launch_id=launch_id, storage=storage,
                      metrics_port=cfg.log.metrics[1] if cfg.log.metrics else None, host_paths=tuple(host_paths),
                      cluster=cluster, ft=cfg.ft if cfg.ft.enabled else None, cloud=cloud,
                      ft_groups=ft_groups(cfg, job, args.scheduler)
                      if cfg.ft.enabled and args.scheduler not in ("local", "skypilot") else 0,
                      last_step=cfg.train.last_step)
    sched.check(spec)
    return spec
