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
    from llmcluster.export.hf import export_cli

    return export_cli(args.run, root=args.root, step=args.step, out=args.out)
