"""`llmcluster launch`: one job config -> local torchrun, a Slurm batch job, or Kubernetes objects."""

from __future__ import annotations

import argparse

from llmcluster.cli.common import add_config_args, add_root_arg


def register(sub) -> None:
    p = sub.add_parser(
        "launch", help="run a job locally (torchrun), on Slurm (sbatch) or on Kubernetes from one config",
        description="Render the job for a scheduler and submit it; --dry-run prints exactly what would be "
                    "submitted. Anything after `--` replaces the trainer as the per-rank program.")
    add_config_args(p, required=False)
    add_root_arg(p)
    p.add_argument("--scheduler", required=True, choices=("local", "slurm", "k8s"))
    p.add_argument("--nodes", type=int, metavar="N")
    p.add_argument("--gpus-per-node", type=int, metavar="G", help="0 = CPU")
    p.add_argument("--procs-per-node", type=int, metavar="P", help="default: GPUs per node, or 1 on CPU")
    p.add_argument("--time", metavar="HH:MM:SS", help="time limit")
    p.add_argument("--partition", metavar="P", help="Slurm partition")
    p.add_argument("--image", metavar="IMG", help="container image (pyxis on Slurm; required on k8s)")
    p.add_argument("--max-requeues", type=int, metavar="N")
    p.add_argument("--k8s-kind", choices=("indexed-job", "volcano", "jobset", "pytorchjob"))
    p.add_argument("--namespace", metavar="NS", help="Kubernetes namespace")
    p.add_argument("--dry-run", action="store_true", help="print the sbatch script / YAML / command only")
    p.add_argument("--apply", action="store_true", help="k8s: create the objects (in-cluster or kubeconfig)")
    p.add_argument("program", nargs=argparse.REMAINDER, metavar="-- CMD",
                   help="a program every rank runs instead of the trainer (e.g. -- hostname)")
    p.set_defaults(func=run)


def run(args) -> int:
    from llmcluster.config.load import load_job_config
    from llmcluster.errors import UserError
    from llmcluster.launch.launcher import launch
    from llmcluster.launch.spec import build_spec
    from llmcluster.paths import resolve_storage_root

    if args.program and args.program[0] == "--":
        args.program = args.program[1:]
    if args.apply and args.scheduler != "k8s":
        raise UserError("--apply is for --scheduler k8s (slurm and local submit without it)")
    cfg = load_job_config(args.config, args.overrides)
    root = resolve_storage_root(args.root, cfg.run.storage)
    spec = build_spec(cfg, args, root)
    return launch(spec, dry_run=args.dry_run, apply=args.apply)
