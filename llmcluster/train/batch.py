"""The global batch across a resume: the run's one optimisation figure, kept when the world size changes.

A checkpoint records the global batch it was trained at (micro_batch × grad_accum × data-parallel degree).
Resumed at another data-parallel degree, the same global batch comes back through gradient accumulation
when it divides (grad_accum' = global / (micro_batch × dp')); the sampler's position is a sample index
(data/dataset.py), so the resumed steps read exactly the samples the saved layout would have. When it does
not divide, or train.global_batch asks for another figure, the start is refused unless
train.allow_batch_change=true says the change is meant.
"""

from __future__ import annotations

import re

from llmcluster.config.schema import TrainConfig
from llmcluster.errors import UserError

ALLOW = "train.allow_batch_change=true"


def saved_global_batch(state: dict) -> int | None:
    """The global batch a checkpoint's train_state was trained at. Checkpoints written before it was recorded:
    from their config and the layout line (`dp_replicate=R dp_shard=S`); None when neither tells."""
    if state.get("global_batch"):
        return int(state["global_batch"])
    t = (state.get("config") or {}).get("train") or {}
    if t.get("global_batch"):
        return int(t["global_batch"])
    m = re.search(r"dp_replicate=(\d+) dp_shard=(\d+)", str(state.get("parallel", "")))
    if m and t.get("micro_batch") and t.get("grad_accum"):
        return int(t["micro_batch"]) * int(t["grad_accum"]) * int(m[1]) * int(m[2])
    return None


def resume_batch(state: dict, t: TrainConfig, dp: int, world: int) -> tuple[int, int, str | None]:
    """(grad_accum, global batch, the line that says what happened or None) for resuming from `state` with
    this config at data-parallel degree `dp` in a world of `world` ranks; a UserError when the global batch
    would change without train.allow_batch_change."""
    now = t.global_batch or t.micro_batch * t.grad_accum * dp
    saved = saved_global_batch(state)
    was = state.get("world_size")
    where = f"at world {world}" + (f" from world {was}" if was not in (None, world) else "")
    if saved is None or saved == now:
        return t.grad_accum, now, (None if was in (None, world) else
                                   f"resuming {where}: the global batch {now} is unchanged (micro_batch "
                                   f"{t.micro_batch} × grad_accum {t.grad_accum} × data-parallel {dp})")
    if t.allow_batch_change:
        return t.grad_accum, now, f"resuming {where}: global batch {saved} -> {now} ({ALLOW})"
    per_step = t.micro_batch * dp
    if t.global_batch is None and saved % per_step == 0:
        accum = saved // per_step
        return accum, saved, f"resuming {where}: grad_accum {t.grad_accum} -> {accum} keeps the global batch {saved}"
    why = (f"train.global_batch={t.global_batch} asks for another" if t.global_batch else
           f"{saved} is not a multiple of micro_batch {t.micro_batch} × data-parallel {dp}")
    raise UserError(f"resuming {where} would change the global batch {saved} -> {now}: {why}; choose "
                    f"train.micro_batch so that micro_batch × data-parallel divides {saved}, or set {ALLOW} to "
                    f"train on at {now}")
