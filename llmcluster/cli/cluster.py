"""`llmcluster cluster init|show`: write a commented cluster.yaml from this host; print the resolved spec."""

from __future__ import annotations

from llmcluster.cli.common import add_actions


def register(sub) -> None:
    csub = add_actions(sub, "cluster", "write a cluster.yaml from what this host sees; show the resolved cluster spec")
    i = csub.add_parser("init", help="write a commented cluster.yaml (from scontrol show nodes / nvidia-smi if present)")
    i.add_argument("--out", "-o", default="cluster.yaml", metavar="FILE", help="where to write (default ./cluster.yaml)")
    i.add_argument("--name", default="cluster", help="the cluster's name (default: cluster)")
    i.add_argument("--force", action="store_true", help="replace an existing file")
    i.set_defaults(func=run)
    s = csub.add_parser("show", help="the resolved cluster spec, each value with where it came from")
    s.add_argument("--cluster", metavar="FILE|NAME",
                   help="a cluster file or shipped name (default: $LLMCLUSTER_CLUSTER, else ./cluster.yaml, else the "
                        "built-in one-node default)")
    s.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a value by dotted path, e.g. --set hardware.gpus_per_node=8 (repeatable)")
    s.add_argument("--json", action="store_true", help="one JSON object: {key: {value, source}}")
    s.set_defaults(func=run)


def run(args) -> int:
    from pathlib import Path

    if args.cluster_cmd == "init":
        from llmcluster.config.cluster_init import init_cluster

        init_cluster(Path(args.out), name=args.name, force=args.force)
        print(f"wrote {args.out}: check the commented values, then `llmcluster cluster show --cluster {args.out}`")
        return 0
    from llmcluster.config.cluster_load import load_cluster, origins

    resolved = load_cluster(args.cluster, args.overrides)
    rows = origins(resolved)
    if args.json:
        import json

        print(json.dumps({"source": resolved.source, "found_by": resolved.how,
                          "values": {k: {"value": v, "source": src} for k, v, src in rows}}))
        return 0
    import json

    print(f"cluster {resolved.spec.name}: {resolved.source} (found by {resolved.how}); "
          f"{resolved.spec.node_count} node(s) x {resolved.spec.gpus_per_node} {resolved.spec.hardware.gpu}")
    width = max(len(k) for k, _, _ in rows)
    for key, value, src in rows:
        shown = json.dumps(value) if isinstance(value, (dict, list)) or value is None else str(value)
        print(f"  {key:<{width}}  {shown:<32}  {src}")
    return 0
