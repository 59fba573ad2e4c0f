"""`llmcluster lineage MODEL|RUN [--verify] [--json]`: an export's lineage, from its files back to its checkpoint, run,
datasets and base (export/lineage.py; docs/lineage.md). No torch on this path: an auditor runs it anywhere."""

from __future__ import annotations

from llmcluster.cli.common import add_root_arg


def register(sub) -> None:
    p = sub.add_parser("lineage", help="an exported model's lineage: export -> checkpoint -> run -> datasets -> base")
    p.add_argument("model", metavar="MODEL|RUN", help="an export's directory, or a run name (its models/<run>/)")
    p.add_argument("--verify", action="store_true",
                   help="recompute every digest reachable here; the first link that no longer holds is named in one "
                        "line, exit 1")
    p.add_argument("--json", action="store_true", help="the record (and the verdicts) as JSON, for auditors")
    add_root_arg(p)
    p.set_defaults(func=run)


def run(args) -> int:
    import sys
    from pathlib import Path

    from llmcluster.config.cluster_load import storage_root
    from llmcluster.export import lineage
    from llmcluster.export.marker import exported_model_dir
    from llmcluster.storage.records import dumps

    export_dir = exported_model_dir(args.model, args.root).resolve()
    rec = lineage.read(export_dir)
    # the storage root the record's relative paths are under: --root, else the one the export sits in (models/<x>),
    # else the one it was exported from (an `export --out` elsewhere)
    recorded = rec.get("storage_root") if isinstance(rec.get("storage_root"), str) else None
    root = Path(args.root) if args.root else (
        export_dir.parent.parent if export_dir.parent.name == "models" else Path(recorded) if recorded
        else storage_root(None))
    out = {"model": str(export_dir), "lineage_sha256": lineage.digest(export_dir), "lineage": rec}
    if not args.json:
        print(f"{export_dir}: lineage {out['lineage_sha256'][:16]}")
        for line in lineage.describe(rec):
            print(f"  {line}")
    if not args.verify:
        if args.json:
            print(dumps(out, indent=1))
        return 0
    try:
        links = lineage.verify(export_dir, rec, root)
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
