"""`llmcluster export`: a checkpoint -> models/<run>/ in Hugging Face Llama format."""

from __future__ import annotations

from llmcluster.cli.common import add_root_arg


def register(sub) -> None:
    p = sub.add_parser("export", help="export a checkpoint to Hugging Face Llama format under models/<run>/")
    p.add_argument("--run", required=True, help="run name")
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: the newest complete one whose checksums verify)")
    p.add_argument("--out", default=None, help="output directory (default: models/<run>/)")
    add_root_arg(p)
    p.set_defaults(func=run)


def run(args) -> int:
    from pathlib import Path

    from llmcluster.config.cluster_load import storage_root
    from llmcluster.export.marker import check_export_request, check_export_target
    from llmcluster.storage.layout import Storage, check_run_name

    # what arguments and storage decide, before torch (issue 69)
    root = storage_root(args.root)
    st = Storage(root)
    check_export_target(root, Path(args.out) if args.out else st.model_dir(check_run_name(args.run)))
    check_export_request(st, args.run, args.step)
    from llmcluster.export.hf import export_cli

    return export_cli(args.run, root=args.root, step=args.step, out=args.out)
