"""`llmcluster launch` (placeholder until its capability lands)."""

from llmcluster.errors import UserError


def register(sub) -> None:
    p = sub.add_parser("launch", help="(not yet implemented)")
    p.set_defaults(func=run)


def run(args) -> int:
    raise UserError("'launch' is not implemented yet")
