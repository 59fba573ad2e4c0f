"""`llmcluster lineage MODEL|RUN|ENDPOINT [--verify] [--json]`: an export's lineage, from the endpoint serving it (a
serving job's record holds the lineage digest it started with) and its files back to its checkpoint, run, datasets
and base (export/lineage.py; docs/lineage.md). No torch on this path: an auditor runs it anywhere."""

from __future__ import annotations

from llmcluster.cli.common import add_root_arg


def register(sub) -> None:
    p = sub.add_parser("lineage", help="an exported model's lineage: export -> checkpoint -> run -> datasets -> base")
    p.add_argument("model", metavar="MODEL|RUN|ENDPOINT",
                   help="an export's directory, a run name (its models/<run>/), or a serving job's name (`jobs list`)")
    p.add_argument("--verify", action="store_true",
                   help="recompute every digest reachable here; the first link that no longer holds is named in one "
                        "line, exit 1")
    p.add_argument("--json", action="store_true", help="the record (and the verdicts) as JSON, for auditors")
    add_root_arg(p)
    p.set_defaults(func=run)


def run(args) -> int:
    import sys

    from llmcluster.config.cluster_load import storage_root
    from llmcluster.errors import UserError
    from llmcluster.export import lineage
    from llmcluster.export.marker import exported_model_dir
    from llmcluster.storage.records import dumps

    endpoint = None   # a serving job's name (`jobs list`): the chain starts at the endpoint
    try:
        export_dir = exported_model_dir(args.model, args.root).resolve()
    except UserError:
        found = None if "/" in args.model else lineage.endpoint_export(storage_root(args.root), args.model)
        if found is None:
            raise
        export_dir, endpoint = found[0].resolve(), found[1]
    rec = lineage.read(export_dir)
    root = lineage.storage_root_for(export_dir, rec, args.root)
    out = {"model": str(export_dir), "lineage_sha256": lineage.digest(export_dir), "lineage": rec,
           **({"endpoint": args.model, "served_lineage_sha256": endpoint.get("lineage_sha256")} if endpoint else {})}
    if not args.json:
        if endpoint:
            print(f"endpoint {args.model}: serves {export_dir}, lineage recorded at its start: "
                  f"{(endpoint.get('lineage_sha256') or 'none')[:16]}")
        print(f"{export_dir}: lineage {out['lineage_sha256'][:16]}")
        for line in lineage.describe(rec):
            print(f"  {line}")
    if not args.verify:
        if args.json:
            print(dumps(out, indent=1))
        return 0
    try:
        links = ([lineage.check_endpoint(args.model, endpoint, export_dir)] if endpoint else []) + \
            lineage.verify(export_dir, rec, root)
    except lineage.Broken as e:
        if args.json:
            print(dumps({**out, "verified": False, "broken": {"link": e.link, "why": str(e)}}, indent=1))
        print(f"llmcluster lineage: broken at {e}", file=sys.stderr)
        return 1
    if args.json:
        print(dumps({**out, "verified": True, "links": [{"link": k, "status": v} for k, v in links]}, indent=1))
    else:
        for link, status in links:
            print(f"  {link}: {status}")
        unreached = sum(not s.startswith("verified") for _, s in links)
        print(f"every link that could be reached holds ({len(links) - unreached} verified"
              + (f", {unreached} not reachable here)" if unreached else ")"))
    return 0
