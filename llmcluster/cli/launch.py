"""`llmcluster launch`: one job config -> local torchrun, a Slurm batch job, or Kubernetes objects."""

from __future__ import annotations

import argparse

from llmcluster.cli.common import add_config_args, add_root_arg
from llmcluster.launch import SCHEDULERS


def register(sub) -> None:
    p = sub.add_parser(
        "launch", help="run a job locally (torchrun), on Slurm (sbatch), on Kubernetes or on a rented cloud "
                            "(SkyPilot) from one config",
        description="Render the job for a scheduler and submit it; --dry-run prints exactly what would be "
                    "submitted. Anything after `--` replaces the trainer as the per-rank program.")
    add_config_args(p, required=False)
    add_root_arg(p)
    p.add_argument("--cluster", metavar="FILE|NAME",
                   help="the cluster spec whose values are the job's defaults (default: $LLMCLUSTER_CLUSTER, else "
                        "./cluster.yaml); the job config and the flags below override it")
    p.add_argument("--scheduler", choices=SCHEDULERS,
                   help="default: the cluster spec's scheduler.default (required without a cluster spec)")
    p.add_argument("--nodes", type=int, metavar="N")
    p.add_argument("--gpus-per-node", type=int, metavar="G", help="0 = CPU")
    p.add_argument("--procs-per-node", type=int, metavar="P", help="default: GPUs per node, or 1 on CPU")
    p.add_argument("--time", metavar="HH:MM:SS", help="time limit")
    p.add_argument("--partition", metavar="P", help="Slurm partition")
    p.add_argument("--image", metavar="IMG", help="container image (pyxis on Slurm; required on k8s)")
    p.add_argument("--max-requeues", type=int, metavar="N", help="scheduler requeues of a failed job")
    p.add_argument("--max-restarts", type=int, metavar="N", help="torchrun restarts of the group after a rank dies")
    p.add_argument("--k8s-kind", choices=("indexed-job", "volcano", "jobset", "pytorchjob"))
    p.add_argument("--namespace", metavar="NS", help="Kubernetes namespace")
    p.add_argument("--dry-run", action="store_true", help="print the sbatch script / YAML / command only")
    p.add_argument("--gpu", metavar="NAME", help="the nodes' GPU for the fit check (default: the cluster spec's "
                                                  "hardware.gpu; none on a CPU-only cluster skips the check)")
    p.add_argument("--force", action="store_true", help="launch even when the planner says it will not fit, or the run's previous job is still active")
    p.add_argument("--apply", action="store_true", help="k8s: create the objects (in-cluster or kubeconfig)")
    p.add_argument("program", nargs=argparse.REMAINDER, metavar="-- CMD",
                   help="a program every rank runs instead of the trainer (e.g. -- hostname)")
    p.set_defaults(func=run)


def run(args) -> int:
    from llmcluster.config.cluster import CPU_ONLY
    from llmcluster.config.cluster_load import load_cluster
    from llmcluster.config.load import load_job_config
    from llmcluster.errors import UserError
    from llmcluster.launch.cluster_defaults import job_with_cluster_defaults
    from llmcluster.launch.launcher import launch
    from llmcluster.launch.spec import build_spec
    from llmcluster.paths import resolve_storage_root

    if args.program and args.program[0] == "--":
        args.program = args.program[1:]
    resolved = load_cluster(args.cluster)
    cluster = resolved.spec          # its values are the job's defaults (the job config and the flags win)
    if args.scheduler is None and resolved.is_default:
        raise UserError("--scheduler local|slurm|k8s|skypilot is required without a cluster spec (its scheduler.default)")
    args.scheduler = args.scheduler or cluster.scheduler.default
    if args.apply and args.scheduler != "k8s":
        raise UserError("--apply is for --scheduler k8s (slurm and local submit without it)")
    cfg = load_job_config(args.config, args.overrides)
    cfg = cfg.model_copy(update={"job": job_with_cluster_defaults(cfg.job, cluster, args.scheduler)})
    root = resolve_storage_root(args.root, cfg.run.storage or cluster.storage.root)
    cloud = cluster.cloud
    if cloud is not None and not cloud.accelerators and cluster.gpus_per_node:   # the one GPU the spec names
        cloud = cloud.model_copy(update={"accelerators": {cluster.hardware.gpu: cluster.gpus_per_node}})
    spec = build_spec(cfg, args, root, cluster.scheduler.kubernetes.host_paths,
                      None if resolved.is_default else cluster.name, cloud)
    if "nodes" in cluster.model_fields_set and spec.job.nodes > cluster.node_count:
        # The name quoted and its file named: a cluster.yaml from `cluster init` may be called "cluster".
        raise UserError(f"job.nodes ({spec.job.nodes}) is more than the {cluster.node_count} node(s) of cluster "
                        f"{cluster.name!r} ({resolved.source})")
    gpu = args.gpu or (cluster.hardware.gpu if cluster.hardware.gpu != CPU_ONLY else None)
    if gpu and spec.job.gpus_per_node and not args.force and not args.program:  # planner's memory estimate
        from llmcluster.plan.fit import require_fit
        require_fit(cfg.model_copy(update={"job": spec.job}), gpu)  # --nodes etc. as resolved
    return launch(spec, dry_run=args.dry_run, apply=args.apply, force=args.force)
