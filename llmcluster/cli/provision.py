"""`llmcluster provision --cluster FILE --out DIR`: the cluster spec as an Ansible project."""

from __future__ import annotations

from pathlib import Path


def register(sub) -> None:
    p = sub.add_parser("provision", help="render the stack (OS, GPU, fabric, storage, scheduler, containers, ML, "
                       "monitoring) as an Ansible project from the cluster spec")
    p.add_argument("--cluster", metavar="FILE",
                   help="cluster spec (default: $LLMCLUSTER_CLUSTER, else ./cluster.yaml, else one local node)")
    p.add_argument("--out", required=True, metavar="DIR",
                   help="where to write inventory.yml, site.yml, roles/, group_vars/ (new, empty or ours)")
    p.add_argument("--scheduler", choices=("slurm", "k8s", "local"),
                   help="which scheduler level to render (default: the spec's scheduler.default)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a cluster value by dotted path, e.g. --set nodes.count=16 (repeatable)")
    p.add_argument("--wheel", metavar="PATH",
                   help="the llmcluster wheel the ml level installs (default: provision.wheel, else built from this "
                        "checkout with pip wheel --no-deps)")
    p.set_defaults(func=run)


def run(args) -> int:
    from llmcluster.provision.render import run as provision

    return provision(args.cluster, Path(args.out), args.overrides, args.scheduler, args.wheel)
