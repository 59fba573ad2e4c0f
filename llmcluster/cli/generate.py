"""`llmcluster generate`: sample text from an exported model."""

from __future__ import annotations

import argparse
import math

from llmcluster.cli.common import add_root_arg


def non_negative_float(text: str) -> float:
    """A temperature: 0 is greedy; a negative one would silently mean greedy too, so it is refused."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0 (0: greedy), got {text}")
    return value


def register(sub) -> None:
    p = sub.add_parser("generate", help="sample text from an exported model (run name or directory)")
    p.add_argument("--model", required=True, metavar="RUN_OR_PATH")
    p.add_argument("--prompt", default="", help="text to continue")
    p.add_argument("--max-new-tokens", type=int, default=200)
    p.add_argument("--temperature", type=non_negative_float, default=0.8, help="0: greedy")
    p.add_argument("--top-k", type=int, default=50)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-cache", dest="cache", action="store_false",
                   help="recompute the whole sequence every token instead of keeping a KV cache (same tokens, slower)")
    add_root_arg(p)
    p.set_defaults(func=run)


def run(args) -> int:
    from llmcluster.errors import UserError
    from llmcluster.export.marker import exported_model_dir

    exported_model_dir(args.model, args.root)   # refused before torch (issue 69)
    if args.max_new_tokens < 1:
        raise UserError("--max-new-tokens must be at least 1")
    from llmcluster.export.generate import generate_cli

    return generate_cli(args.model, prompt=args.prompt, max_new_tokens=args.max_new_tokens,
                        temperature=args.temperature, top_k=args.top_k, seed=args.seed, root=args.root,
                        cache=args.cache)
