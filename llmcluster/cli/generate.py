"""`llmcluster generate`: sample text from an exported model."""

from __future__ import annotations

from llmcluster.cli.common import add_root_arg


def register(sub) -> None:
    p = sub.add_parser("generate", help="sample text from an exported model (run name or directory)")
    p.add_argument("--model", required=True, metavar="RUN_OR_PATH")
    p.add_argument("--prompt", default="", help="text to continue")
    p.add_argument("--max-new-tokens", type=int, default=200)
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--top-k", type=int, default=50)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-cache", dest="cache", action="store_false",
                   help="recompute the whole sequence every token instead of keeping a KV cache (same tokens, slower)")
    add_root_arg(p)
    p.set_defaults(func=run)


def run(args) -> int:
    from llmcluster.export.generate import generate_cli

    return generate_cli(args.model, prompt=args.prompt, max_new_tokens=args.max_new_tokens,
                        temperature=args.temperature, top_k=args.top_k, seed=args.seed, root=args.root,
                        cache=args.cache)
