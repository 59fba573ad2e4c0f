"""`llmcluster monitor serve|config|watch`."""

from __future__ import annotations

from llmcluster.cli.common import add_actions, add_root_arg


def register(sub) -> None:
    msub = add_actions(sub, "monitor", "GPU/node/training metrics for Prometheus, scrape configs, a live view")

    s = msub.add_parser("serve", help="run this node's exporter: GPUs (dcgm-exporter names), CPU, memory, storage")
    s.add_argument("--bind", default="127.0.0.1", help="address to listen on (default: loopback only)")
    s.add_argument("--port", type=int,
                   help="port (default: the cluster spec's monitoring.exporter_port, 9400 = dcgm-exporter's; 0: any free)")
    add_root_arg(s)
    s.add_argument("--expected-gpus", type=int, metavar="N",
                   help="GPUs this node should have (default: the cluster spec's GPUs for this host); fewer present "
                        "fires GPUCountBelowExpected")
    s.add_argument("--cluster", metavar="FILE|NAME",
                   help="the cluster spec (default: $LLMCLUSTER_CLUSTER, else ./cluster.yaml)")
    s.set_defaults(func=run)

    c = msub.add_parser("config", help="write a Prometheus scrape config (or Kubernetes PodMonitors) for the cluster")
    src = c.add_mutually_exclusive_group()
    src.add_argument("--cluster", metavar="FILE|NAME", help="the cluster spec whose nodes.hosts are scraped (default: "
                     "$LLMCLUSTER_CLUSTER, else ./cluster.yaml)")
    src.add_argument("--nodes", metavar="A,B,...", help="comma-separated host names or addresses instead")
    src.add_argument("--slurm-nodelist", metavar="EXPR", help="a Slurm hostlist instead, e.g. \"gpu[01-16]\" or "
                     "\"$(sinfo -h -o %%N)\"")
    c.add_argument("--kubernetes", action="store_true",
                   help="DaemonSet + PodMonitors + PrometheusRule (prometheus-operator) instead")
    c.add_argument("--port", type=int, help="exporter port on each node (default: monitoring.exporter_port, 9400)")
    c.add_argument("--train-port", type=int,
                   help="the port of the trainers' log.metrics_bind (default: monitoring.train_port, 9401); -1: do not "
                        "scrape trainers")
    c.add_argument("--train-ports-per-node", type=int, metavar="N",
                   help="scrape train-port .. train-port+N-1 on each node, one per local rank (default: "
                        "monitoring.train_ports_per_node, else the cluster's GPUs per node, else 1)")
    c.add_argument("--scrape-interval", help="Prometheus duration (default: monitoring.scrape_interval, 15s)")
    c.add_argument("--namespace", help="Kubernetes namespace (--kubernetes; default: monitoring.namespace)")
    c.add_argument("--image", help="container image with llmcluster installed (--kubernetes; default: "
                   "scheduler.kubernetes.image, else ghcr.io/llmcluster/llmcluster:latest)")
    c.add_argument("--train-port-name", default="train-metrics",
                   help="named container port of training pods (--kubernetes)")
    c.add_argument("--expected-gpus", type=int, metavar="N",
                   help="GPUs per node (--kubernetes; default: the cluster's hardware.gpus_per_node)")
    c.add_argument("--storage-path", help="host path of the storage root (--kubernetes; default: storage.root)")
    c.add_argument("--serve-endpoints", metavar="URL[=NAME],...",
                   help="vLLM endpoints to scrape besides the serving jobs recorded under the storage root "
                        "(e.g. http://gpu01:8000/v1=chat)")
    add_root_arg(c)
    c.add_argument("--out", "-o", metavar="FILE", help="write here instead of stdout (and the serving SLO alerts "
                   "beside it as FILE's name + .serve-slo.yml)")
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

        import socket

        from llmcluster.config.cluster_load import load_cluster

        resolved = load_cluster(args.cluster)
        c = resolved.spec
        root = resolve_storage_root(args.root) if args.root else _default_root(c.storage.root)
        if args.root and not root.is_dir():
            from llmcluster.errors import UserError
            raise UserError(f"storage root {root} does not exist (run `llmcluster storage init --root {root}`)")
        expected = args.expected_gpus
        if expected is None and not resolved.is_default:
            expected = c.node_gpus(socket.gethostname().split(".")[0])    # nodes.overrides may say fewer
        port = c.monitoring.exporter_port if args.port is None else args.port
        return serve(args.bind, port, root, expected)
    if args.monitor_cmd == "config":
        return _config(args)
    from llmcluster.monitor.watch import watch
    return watch([t.strip() for t in args.targets.split(",") if t.strip()], args.interval, args.once)


def _default_root(cluster_root: str):
    """$LLMCLUSTER_STORAGE, else the cluster's storage.root (./storage by default), if it exists; a node without
    storage still serves GPU/host metrics."""
    from llmcluster.paths import resolve_storage_root

    root = resolve_storage_root(None, cluster_root)
    return root if root.is_dir() else None


def _config(args) -> int:
    """`monitor config`: the cluster's values as defaults, the flags over them."""
    from llmcluster.config.cluster_load import load_cluster
    from llmcluster.errors import UserError
    from llmcluster.monitor import scrape_config as sc
    from llmcluster.monitor import serve_targets as st

    resolved = load_cluster(args.cluster)
    c, m = resolved.spec, resolved.spec.monitoring
    serving = _serving_targets(args, c.storage.root)
    pick = lambda flag, default: default if flag is None else flag  # noqa: E731
    port = pick(args.port, m.exporter_port)
    train_port = pick(args.train_port, m.train_port)
    train_port = None if train_port == -1 else train_port
    per_node = pick(args.train_ports_per_node, m.train_ports_per_node or c.gpus_per_node or 1)
    interval = pick(args.scrape_interval, m.scrape_interval)
    sc.check_scrape_flags(port, train_port, per_node, interval)
    if args.kubernetes:
        if args.nodes is not None or args.slurm_nodelist is not None:
            raise UserError("--kubernetes discovers the pods itself: drop --nodes / --slurm-nodelist")
        k = c.scheduler.kubernetes
        expected = pick(args.expected_gpus, None if resolved.is_default else c.gpus_per_node)
        slo = st.slo_rules(serving)
        text = sc.dump(sc.kubernetes_manifests(
            pick(args.namespace, m.namespace), pick(args.image, k.image or "ghcr.io/llmcluster/llmcluster:latest"),
            port, args.train_port_name, expected, pick(args.storage_path, c.storage.root if c.storage.root.startswith("/")
                                                      else "/storage"),
            node_selector=k.node_selector or None, tolerations=k.tolerations or None, extra_groups=[slo] if slo else []))
    else:
        if args.nodes is not None:
            nodes = [n.strip() for n in args.nodes.split(",") if n.strip()]
            if not nodes:
                raise UserError("--nodes is empty")
        elif args.slurm_nodelist is not None:
            nodes = sc.expand_hostlist(args.slurm_nodelist)
        elif resolved.is_default:
            raise UserError("no cluster spec to take the nodes from: give --cluster FILE|NAME (or set "
                            "$LLMCLUSTER_CLUSTER, or write ./cluster.yaml), --nodes or --slurm-nodelist")
        else:
            nodes = sc.cluster_hosts(c, resolved.source)
            if args.train_ports_per_node is None and m.train_ports_per_node is None and c.nodes.overrides:
                per_node = {h: max(1, c.node_gpus(h)) for h in nodes}    # nodes.overrides: GPUs differ per node
        slo_file = _write_slo_rules(st.slo_rules(serving), args.out)
        text = sc.dump(sc.prometheus_config(nodes, port, train_port, per_node, interval, serving=serving,
                                            extra_rule_files=[slo_file] if slo_file else []))
    sc.write_text(text, args.out)
    if args.out:   # stdout carries the file's text only when there is no file
        what = "Kubernetes manifests" if args.kubernetes else f"Prometheus scrape config for {len(nodes)} node(s)"
        print(f"wrote {args.out}: {what}" + (f" and {len(serving)} serving endpoint(s)" if serving else ""))
    return 0


def _serving_targets(args, cluster_root: str) -> list:
    """The serving jobs recorded under the storage root (when there is one), then --serve-endpoints."""
    from llmcluster.monitor import serve_targets as st
    from llmcluster.paths import resolve_storage_root

    root = resolve_storage_root(args.root, cluster_root)
    found = st.from_records(root) if root.is_dir() else []
    return found + (st.from_flag(args.serve_endpoints) if args.serve_endpoints is not None else [])


def _write_slo_rules(group: dict | None, out: str | None):
    """The per-job TTFT alerts as a rule file beside --out (Prometheus cannot inline rules in its config)."""
    import sys
    from pathlib import Path

    from llmcluster.monitor import scrape_config as sc

    if group is None:
        return None
    if not out:
        print("monitor config: the serving TTFT SLO alerts need a file of their own: give --out FILE",
              file=sys.stderr)
        return None
    path = Path(out).with_name(Path(out).name + ".serve-slo.yml")
    sc.write_text(sc.dump({"groups": [group]}), str(path))
    return path
