"""`llmcluster validate [CHECK ...]`: the bring-up checks (stack, collectives, compute, memory, pcie,
storage, thermal) with PASS/WARN/FAIL/SKIP, a JSON report, plots, and cross-node outliers."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from llmcluster.cli.common import add_root_arg
from llmcluster.errors import UserError

CHECKS = ("stack", "collectives", "compute", "memory", "pcie", "storage", "thermal")
OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all")


def register(sub) -> None:
    p = sub.add_parser("validate", help="check a node or a whole job: stack, NCCL collectives, compute, "
                       "memory, PCIe, storage, thermal (exit 1 on any FAIL)")
    p.add_argument("checks", nargs="*", metavar="CHECK", default=["all"],
                   help=f"any of {', '.join(CHECKS)}, or all (default)")
    p.add_argument("--json", action="store_true",
                   help="print the report (every measurement and the environment) as one JSON object on stdout")
    p.add_argument("--report", metavar="FILE", help="also write that JSON report to FILE")
    p.add_argument("--plot", metavar="DIR", help="write PNG plots (busbw vs size, per-node bars)")
    p.add_argument("--quick", action="store_true", help="seconds, not minutes: fit for a Slurm prolog")
    p.add_argument("--cluster", metavar="FILE|NAME",
                   help="the cluster spec: expected GPUs, storage figures, thresholds (default: $LLMCLUSTER_CLUSTER, "
                        "else ./cluster.yaml; see docs/cluster.md)")
    add_root_arg(p)
    g = p.add_argument_group("collectives (nccl-tests semantics)")
    g.add_argument("--nproc", type=int, metavar="N",
                   help="local ranks to start when not under torchrun/srun (default: GPUs, else 2)")
    g.add_argument("-b", "--minbytes", metavar="SIZE", help="smallest message, e.g. 8, 1K, 1M")
    g.add_argument("-e", "--maxbytes", metavar="SIZE", help="largest message, e.g. 64M, 8G")
    g.add_argument("-f", "--stepfactor", type=float, metavar="F", help="size multiplier between steps")
    g.add_argument("-n", "--iters", type=int, metavar="N", help="timed iterations per size")
    g.add_argument("-w", "--warmup-iters", type=int, metavar="N", help="untimed warm-up iterations per size")
    g.add_argument("--ops", default=",".join(OPS), help="comma-separated collectives (default: all five)")
    g.add_argument("--tune", action="store_true", help="sweep NCCL_ALGO x NCCL_PROTO for all_reduce (NCCL only)")
    n = p.add_argument_group("nodes")
    n.add_argument("--drain", action="store_true",
                   help="scontrol-drain nodes that FAIL or sit below the median by more than the tolerance "
                        "(never for a failure every node shows; prints the commands)")
    n.add_argument("--max-drain", type=int, metavar="N",
                   help="drain nothing when more than N nodes are flagged (default: 10%% of the nodes, at least 1)")
    n.add_argument("--seconds", type=float, metavar="S", help="thermal: load per GPU (default 60, quick 5)")
    n.add_argument("--storage-size", metavar="SIZE",
                   help="storage: bytes each node writes per area (default 2G, quick 64M; at most 5%% of the "
                        "free space shared by the nodes writing at once)")
    p.set_defaults(func=run)


def run(args) -> int:
    from llmcluster.paths import resolve_storage_root
    from llmcluster.validate.nccl_semantics import parse_size
    from llmcluster.validate.run import Options, run as run_checks

    checks = list(CHECKS) if "all" in args.checks else list(dict.fromkeys(args.checks))
    unknown = [c for c in checks if c not in CHECKS]
    if unknown:
        raise UserError(f"unknown check '{unknown[0]}': expected any of {', '.join(CHECKS)} or all")
    ops = [o.strip() for o in args.ops.split(",") if o.strip()]
    bad = [o for o in ops if o not in OPS]
    if bad or not ops:
        raise UserError(f"unknown collective '{bad[0] if bad else args.ops}': expected any of {', '.join(OPS)}")
    for name in ("nproc", "iters", "warmup_iters"):
        v = getattr(args, name)
        if v is not None and v < (0 if name == "warmup_iters" else 1):
            raise UserError(f"--{name.replace('_', '-')} must be {'>= 0' if name == 'warmup_iters' else '>= 1'}, got {v}")
    if args.seconds is not None and args.seconds <= 0:
        raise UserError(f"--seconds must be > 0, got {args.seconds:g}")
    begin, end = (parse_size(x) if x else None for x in (args.minbytes, args.maxbytes))
    if args.stepfactor is not None or begin or end:   # a bad range is an error now, not after spawning ranks
        from llmcluster.validate.nccl_semantics import size_sweep
        size_sweep(begin or 1, end or max(begin or 1, 1), args.stepfactor or 2)
    from llmcluster.config.cluster_load import load_cluster

    cluster = load_cluster(args.cluster)      # a bad spec is one line now, not in every rank later
    opts = Options(checks=checks, root=resolve_storage_root(args.root, cluster.spec.storage.root), quick=args.quick,
                   report=Path(args.report) if args.report else None, json=args.json,
                   plot=Path(args.plot) if args.plot else None,
                   nproc=args.nproc, begin=begin, end=end, factor=args.stepfactor, iters=args.iters,
                   warmup=args.warmup_iters, ops=ops, tune=args.tune, drain=args.drain, max_drain=args.max_drain,
                   spec_path=None if cluster.is_default else cluster.source, seconds=args.seconds,
                   storage_size=parse_size(args.storage_size) if args.storage_size else None)
    if "storage" in checks and int(os.environ.get("RANK", "0")) == 0:   # said once, before the first check runs
        from llmcluster.validate.storage import write_plan
        from llmcluster.validate.run import nodes_writing

        print(write_plan(opts.root, args.quick, opts.storage_size, nodes_writing()),
              file=sys.stderr if args.json else sys.stdout, flush=True)
    return run_checks(opts)
