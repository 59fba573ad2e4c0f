"""`llmcluster plan` (placeholder until its capability lands)."""

from llmcluster.errors import UserError


def register(sub) -> None:
    p = sub.add_parser("plan", help="(not yet implemented)")
    p.set_defaults(func=run)


def run(args) -> int:
    raise UserError("'plan' is not implemented yet")
