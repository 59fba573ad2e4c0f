"""Names in the plain model, as checkpoints, adapters and exports key them."""


def plain_name(name: str) -> str:
    """A parameter's or module's name in the plain model: without the prefixes that the wrappers add
    (activation checkpointing, compile)."""
    return name.replace("._checkpoint_wrapped_module", "").replace("._orig_mod", "")
