"""The frozen base of a QLoRA run (`train.lora.base_precision: nf4`): which weights are NF4, NF4's blocks, and the
base read whole from `train.init_from`'s safetensors.

An NF4 run's checkpoints hold the adapters and their optimizer state, not the base (checkpointer.skip_frozen):
the trainer quantizes `train.init_from` as it builds the model (train/qlora.py) and a resume quantizes it again.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from llmcluster.errors import UserError
from llmcluster.model.names import plain_name

NF4_BLOCK, NF4_SCALER_BLOCK = 64, 256
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def nf4_module():
    """torchao's NF4 module, or one line saying how to get it."""
    try:
        from torchao.quantization.quantize_.workflows.nf4 import nf4_tensor
    except ImportError as e:
        raise UserError(f"train.lora.base_precision=nf4 needs torchao >= 0.18 ({e}): pip install "
                        "'llmcluster[float8]' (torchao), or use base_precision=bf16") from None
    return nf4_tensor


def is_nf4(t: torch.Tensor) -> bool:
    local = t.to_local() if hasattr(t, "to_local") else t
    return type(local).__name__ == "NF4Tensor"


def nf4_fits(shape: tuple[int, ...], shards: int = 1) -> bool:
    """Whether a weight of `shape` quantizes to NF4 whole and each of its `shards` row blocks (FSDP2 splits
    dim 0) is whole NF4 blocks too."""
    unit = NF4_BLOCK * NF4_SCALER_BLOCK
    numel = 1
    for s in shape:
        numel *= s
    return len(shape) == 2 and numel % unit == 0 and shape[0] % shards == 0 and (numel // shards) % unit == 0


def nf4_weight_names(model: nn.Module, shards: int = 1) -> list[str]:
    """The block projections' weights that become NF4 (plain names with their wrappers' prefixes)."""
    return [n for n, p in model.named_parameters()
            if n.endswith(".weight") and n.split(".")[-2] in LINEARS and not p.requires_grad and nf4_fits(tuple(p.shape), shards)]


# -- the base, read from a Hugging Face directory's safetensors --------------------------------------------------
def weight_map(path: Path) -> dict[str, Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            return {k: path / f for k, f in json.loads(index.read_text())["weight_map"].items()}
        except (ValueError, KeyError) as e:
            raise UserError(f"{index}: unreadable ({e})") from None
    single = path / "model.safetensors"
    if not single.is_file():
        raise UserError(f"train.init_from={path}: no model.safetensors nor model.safetensors.index.json")
    from safetensors import safe_open

    with safe_open(str(single), framework="pt") as f:
        return {k: single for k in f.keys()}


def hf_name(name: str) -> str:
    """Our parameter name -> HF's; wrappers (activation checkpointing, compile) add prefixes HF lacks."""
    name = plain_name(name)
    return name if name.startswith("lm_head.") else "model." + name


def check_shape(path: Path, key: str, sl, p: torch.Tensor) -> None:
    if tuple(sl.get_shape()) != tuple(p.shape):
        raise UserError(f"train.init_from={path}: {key} has shape {tuple(sl.get_shape())}, the model "
                        f"expects {tuple(p.shape)}")


def read_whole_weights(model: nn.Module, path: Path, names: list[str]):
    """(name, whole tensor) for each of `names` (parameters of `model`), read one at a time from the
    safetensors (a QLoRA base quantizes each weight whole: train/qlora.py)."""
    from safetensors import safe_open

    wmap = weight_map(path)
    params = dict(model.named_parameters())
    for name in names:
        key = hf_name(name)
        if key not in wmap:
            raise UserError(f"train.init_from={path}: no weight {key!r} in the safetensors")
        with safe_open(str(wmap[key]), framework="pt") as f:
            sl = f.get_slice(key)
            check_shape(path, key, sl, params[name])
            yield name, sl[:]

