"""`llmcluster validate` (placeholder until its capability lands)."""

from llmcluster.errors import UserError


def register(sub) -> None:
    p = sub.add_parser("validate", help="(not yet implemented)")
    p.set_defaults(func=run)


def run(args) -> int:
    raise UserError("'validate' is not implemented yet")
