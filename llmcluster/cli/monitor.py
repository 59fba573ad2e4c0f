"""`llmcluster monitor serve|config|watch`."""

from __future__ import annotations

from llmcluster.cli.common import add_root_arg


def register(sub) -> None:
    p = sub.add_parser("monitor", help="GPU/node/training metrics for Prometheus, scrape configs, a live view")
    msub = p.add_subparsers(dest="monitor_cmd", metavar="ACTION")
    msub.required = True

    s = msub.add_parser("serve", help="run this node's exporter: GPUs (dcgm-exporter names), CPU, memory, storage")
    s.add_argument("--bind", default="127.0.0.1", help="address to listen on (default: loopback only)")
    s.add_argument("--port", type=int, default=9400, help="port (default 9400, dcgm-exporter's; 0: any free)")
    add_root_arg(s)
    s.add_argument("--expected-gpus", type=int, metavar="N",
                   help="GPUs this node should have; fewer present fires GPUCountBelowExpected")
    s.set_defaults(func=run)

    c = msub.add_parser("config", help="write a Prometheus scrape config (or Kubernetes PodMonitors)")
    src = c.add_mutually_exclusive_group(required=True)
    src.add_argument("--nodes", metavar="A,B,...", help="comma-separated host names or addresses")
    src.add_argument("--slurm-nodelist", metavar="EXPR", help="a Slurm hostlist, e.g. \"gpu[01-16]\" or "
                     "\"$(sinfo -h -o %%N)\"")
    src.add_argument("--cluster", metavar="FILE", help="cluster spec YAML with a nodes: list")
    src.add_argument("--kubernetes", action="store_true",
                     help="DaemonSet + PodMonitors + PrometheusRule (prometheus-operator) instead")
    c.add_argument("--port", type=int, default=9400, help="exporter port on each node (default 9400)")
    c.add_argument("--train-port", type=int, default=9401,
                   help="the trainer's log.metrics_port (default 9401); -1: do not scrape trainers")
    c.add_argument("--train-ports-per-node", type=int, default=1, metavar="N",
                   help="scrape train-port .. train-port+N-1 on each node (one per local rank)")
    c.add_argument("--scrape-interval", default="15s", help="Prometheus duration (default 15s)")
    c.add_argument("--namespace", default="monitoring", help="Kubernetes namespace (--kubernetes)")
    c.add_argument("--image", default="ghcr.io/llmcluster/llmcluster:latest",
                   help="container image with llmcluster installed (--kubernetes)")
    c.add_argument("--train-port-name", default="train-metrics",
                   help="named container port of training pods (--kubernetes)")
    c.add_argument("--expected-gpus", type=int, metavar="N", help="GPUs per node (--kubernetes)")
    c.add_argument("--storage-path", default="/storage", help="host path of the storage root (--kubernetes)")
    c.add_argument("--out", "-o", metavar="FILE", help="write here instead of stdout")
    c.set_defaults(func=run)

    w = msub.add_parser("watch", help="a live terminal table of GPUs, nodes, storage and training runs")
    w.add_argument("--targets", default="127.0.0.1:9400,127.0.0.1:9401", metavar="HOST:PORT,...",
                   help="exporters and trainer ports to read (default: this node's exporter and trainer)")
    w.add_argument("--interval", type=float, default=2.0, help="seconds between refreshes")
    w.add_argument("--once", action="store_true", help="print one snapshot and exit (scripts, tests)")
    w.set_defaults(func=run)


def run(args) -> int:
    if args.monitor_cmd == "serve":
        from llmcluster.monitor.exporter import serve
        from llmcluster.paths import resolve_storage_root

        root = resolve_storage_root(args.root) if args.root else _default_root()
        if args.root and not root.is_dir():
            from llmcluster.errors import UserError
            raise UserError(f"storage root {root} does not exist (run `llmcluster storage init --root {root}`)")
        return serve(args.bind, args.port, root, args.expected_gpus)
    if args.monitor_cmd == "config":
        from llmcluster.monitor.scrape_config import write_config
        return write_config(args)
    from llmcluster.monitor.watch import watch
    return watch([t.strip() for t in args.targets.split(",") if t.strip()], args.interval, args.once)


def _default_root():
    """$LLMCLUSTER_STORAGE or ./storage, if it exists; a node without storage still serves GPU/host metrics."""
    from llmcluster.paths import resolve_storage_root

    root = resolve_storage_root(None)
    return root if root.is_dir() else None
