"""The model to serve, from what a user names: an HF Llama directory (an export, or anyone's: config.json is enough,
weights optional), a run whose export lives under <storage>/models/<run>, or a preset (llm_7b, ...).

Only config.json is read (as data, never executed): the shapes, the checkpoint's dtype and its quantization.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from llmcluster.config.hf import model_fields_from_hf
from llmcluster.config.load import validate
from llmcluster.errors import UserError
from llmcluster.paths import preset_path
from llmcluster.plan.spec import ModelSpec

# config.json quantization_config.quant_method -> the engine's --quantization
CHECKPOINT_QUANT = {"awq": "awq", "gptq": "gptq", "fp8": "fp8"}


@dataclass(frozen=True)
class ServedModel:
    name: str
    source: str                    # the directory, or "preset llm_7b"
    spec: ModelSpec                # shapes (plan's model: param counting is shared with `plan`)
    context: int                   # max_position_embeddings: the longest max_model_len the engine accepts
    checkpoint_dtype: str          # float32 / bfloat16 / float16 as config.json says ("bfloat16" for presets)
    checkpoint_quant: str | None   # awq / gptq / fp8 when the checkpoint is quantized


def _read_config(directory: Path) -> dict:
    f = directory / "config.json"
    if not f.is_file():
        raise UserError(f"{directory}: no config.json (not a Hugging Face model directory)")
    try:
        data = json.loads(f.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError, OSError) as e:
        raise UserError(f"{f}: not a JSON config ({e})") from None
    if not isinstance(data, dict):
        raise UserError(f"{f}: a config.json must be a JSON object")
    return data


def _checkpoint_quant(hf: dict, where: Path) -> str | None:
    q = hf.get("quantization_config")
    if not q:
        return None
    method = str(q.get("quant_method", "")).lower() if isinstance(q, dict) else ""
    if method not in CHECKPOINT_QUANT:
        raise UserError(f"{where}: quantization_config.quant_method {method or '?'!r} is not planned "
                        f"(awq, gptq, fp8 are)")
    if method in ("awq", "gptq") and q.get("bits", 4) != 4:
        raise UserError(f"{where}: {method} with {q.get('bits')} bits is not planned (4-bit is)")
    return CHECKPOINT_QUANT[method]


def from_directory(directory: Path) -> ServedModel:
    hf = _read_config(directory)
    where = directory / "config.json"
    try:
        fields = model_fields_from_hf(hf)
    except KeyError as e:
        raise UserError(f"{where}: missing {e} (not a Llama config)") from None
    except (TypeError, ZeroDivisionError) as e:
        raise UserError(f"{where}: not a Llama config ({e})") from None
    spec = validate({**fields, "name": directory.name}, ModelSpec, str(where))
    dtype = str(hf.get("torch_dtype") or hf.get("dtype") or "float32")
    return ServedModel(directory.name, str(directory), spec, spec.max_seq_len, dtype,
                       _checkpoint_quant(hf, where))


def from_preset(name: str) -> ServedModel:
    from llmcluster.plan.load import preset_model

    spec = validate(preset_model(name), ModelSpec, f"preset {name}")
    return ServedModel(name, f"preset {name}", spec, spec.max_seq_len, "bfloat16", None)


def resolve_model(ref: str, root: str | None = None, config_root: str | None = None) -> ServedModel:
    """A directory (with config.json), else a run's export under <storage>/models/, else a preset (a run's export
    wins over a preset of the same name: it is the user's)."""
    path = Path(ref).expanduser()
    if path.is_dir():
        return from_directory(path)
    if "/" not in ref and ref not in (".", ".."):
        from llmcluster.config.cluster_load import storage_root
        from llmcluster.storage.layout import Storage, check_run_name

        export = Storage(storage_root(root, config_root)).model_dir(check_run_name(ref))
        if export.is_dir():
            return from_directory(export)
        if preset_path(ref) is not None:
            return from_preset(ref)
    raise UserError(f"--model {ref}: not a model directory, an exported run under <storage>/models/, "
                    f"nor a preset in configs/")
