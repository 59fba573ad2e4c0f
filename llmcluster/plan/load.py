"""Read a plan file: YAML -> preset resolution -> `--set` overrides -> validated PlanSpec."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from llmcluster.config.load import apply_overrides, read_yaml, validate
from llmcluster.errors import UserError
from llmcluster.paths import preset_path
from llmcluster.plan.spec import ModelSpec, PlanSpec

# Job-config model keys that only matter to the trainer (numerics, init), not to the plan.
_TRAINER_ONLY = {"rope_theta", "norm_eps", "init_std", "max_seq_len"}


def preset_model(name: str) -> dict[str, Any]:
    """The `model:` section of configs/<name>.yaml as plan dims (Llama-style: SwiGLU, no dropout)."""
    path = preset_path(name)
    if path is None:
        raise UserError(f"model: '{name}' is not a preset in configs/ (give the dims instead: "
                        f"n_layers, d_model, n_heads, ffn_hidden, vocab_size)")
    cfg = read_yaml(path, "preset")
    section = cfg.get("model") or {}
    dims = {k: v for k, v in section.items() if k in ModelSpec.model_fields and k not in _TRAINER_ONLY}
    seq = (cfg.get("data") or {}).get("seq_len") or section.get("max_seq_len")
    if seq:
        dims["seq_len"] = seq
    dims["name"] = name
    dims.setdefault("ffn_type", "swiglu")
    return dims


def resolve_model(data: dict[str, Any]) -> None:
    """`model: llm_7b` or `model: {preset: llm_7b, seq_len: 4096}` -> explicit dims, in place."""
    model = data.get("model")
    if isinstance(model, str):
        data["model"] = preset_model(model)
    elif isinstance(model, dict) and "preset" in model:
        extra = {k: v for k, v in model.items() if k != "preset"}
        data["model"] = {**preset_model(str(model["preset"])), **extra}


def load_plan(path: str | Path, overrides: list[str] | None = None) -> PlanSpec:
    data = read_yaml(path, "plan")
    overrides = list(overrides or [])
    # `--set model=llm_70b` (or model={...dims}) swaps the whole model: apply it before resolving presets.
    whole = [o for o in overrides if o.split("=", 1)[0].strip() == "model"]
    apply_overrides(data, whole, PlanSpec)
    resolve_model(data)
    apply_overrides(data, [o for o in overrides if o not in whole], PlanSpec)
    return validate(data, PlanSpec, str(path))
