"""The frozen base of a QLoRA run (`train.lora.base_precision: nf4`): which weights are NF4, NF4's blocks, and the
base read whole from `train.init_from`'s safetensors.

An NF4 run's checkpoints hold the adapters and their optimizer state, not the base (checkpointer.skip_frozen):
the trainer quantizes `train.init_from` as it builds the model (train/qlora.py), a resume quantizes it again, and
an export rebuilds it as the trainer held it (export/hf.py, `restore_base`). The rules live here, below both the
training loop and the export, so that both apply the same ones.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from llmcluster.checkpoint.fingerprint import BASE_INDEX as INDEX
from llmcluster.errors import UserError
from llmcluster.model.names import plain_name

NF4_BLOCK, NF4_SCALER_BLOCK = 64, 256
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
NF4_WEIGHTS = "nf4_weights"   # its key in train_state.json: the plain names of the weights the trainer quantized


def nf4_module():
    """torchao's NF4 module, or one line saying how to get it."""
    from llmcluster.quiet import quiet_torchao_import

    try:
        with quiet_torchao_import():   # the NF4 base is CPU-side work; CUDA kernels' load failures are noise here
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


def nf4_names(model: nn.Module) -> list[str]:
    """The plain names of the weights that are NF4 now: what the trainer chose (it depends on the FSDP shard
    count as well as the shapes), recorded with each checkpoint for the export."""
    return [plain_name(n) for n, p in model.named_parameters() if is_nf4(p)]


# -- the base, read from a Hugging Face directory's safetensors --------------------------------------------------
def weight_map(path: Path) -> dict[str, Path]:
    """Each weight's safetensors file: the index's entries, else model.safetensors. An entry is a file of the base
    directory itself (`inside_base`): the base's fingerprint hashes those files only (base_weights_sha256)."""
    index = path / INDEX
    if index.is_file():
        try:
            entries = json.loads(index.read_text())["weight_map"]
            return {k: inside_base(path, index, f) for k, f in entries.items()}
        except (ValueError, KeyError, AttributeError) as e:
            raise UserError(f"{index}: unreadable ({e})") from None
    single = path / "model.safetensors"
    if not single.is_file():
        raise UserError(f"train.init_from={path}: no model.safetensors nor model.safetensors.index.json")
    from safetensors import safe_open

    with safe_open(str(single), framework="pt") as f:
        return {k: single for k in f.keys()}


def inside_base(path: Path, index: Path, entry) -> Path:
    """The index's `entry` as a file of `path`: a plain file name (an absolute or `../` entry would read any
    safetensors file the user can read, outside the base and its fingerprint), not a link out of it either."""
    if not isinstance(entry, str) or Path(entry).name != entry or entry in ("", ".", ".."):
        raise UserError(f"{index}: weight_map entry {str(entry)[:120]!r} is not a file of {path}: refusing a base "
                        "whose index points outside it")
    target = path / entry
    if target.resolve().parent != path.resolve():
        raise UserError(f"{index}: weight_map entry {entry!r} links outside {path} (to {target.resolve()}): "
                        "refusing a base whose index points outside it; copy the file in")
    return target


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


# -- the export's side: the base of an NF4 checkpoint, as the trainer held it --------------------------------------
@torch.no_grad()
def restore_base(model: nn.Module, init_from: Path, state: dict, ckpt: Path) -> list[str]:
    """Fill the frozen weights of `model` (plain, on the CPU, adapters applied) with the base an NF4 run trained
    against: `init_from`'s weights, refused unless they hash to the sha256 its fingerprint recorded; the weights
    the trainer quantized (train_state.json's `nf4_weights`) as NF4 and back (the values its forward computed
    with), the rest rounded to bf16 (train/qlora.py stores them so). Returns the NF4 weights' names."""
    from llmcluster.checkpoint.fingerprint import base_index_sha256, base_weights_sha256

    recorded = (state.get("fingerprint") or {}).get("base_weights")
    if not (init_from / "config.json").is_file():
        raise UserError(f"cannot export {ckpt}: its base, train.init_from={init_from}, is not a model directory "
                        "here (an NF4 run's checkpoint leaves the base out: the export quantizes it again)")
    now = base_weights_sha256(init_from)
    index = (state.get("fingerprint") or {}).get("base_index")    # absent: a checkpoint from before it was recorded
    if index is not None and index != base_index_sha256(init_from):
        raise UserError(f"cannot export {ckpt}: train.init_from={init_from}'s {INDEX} changed since the run trained "
                        "on it (sha256 differs): put it back, or train anew")
    if now != recorded:
        raise UserError(f"cannot export {ckpt}: train.init_from={init_from} changed since the run trained on it "
                        f"(weights sha256 {recorded} then, {now} now): its adapters were trained against NF4 of "
                        "the old weights; put them back, or train anew")
    frozen = [n for n, p in model.named_parameters() if not p.requires_grad]
    names = _nf4_choice(model, state, ckpt, set(frozen))
    nf4 = nf4_module() if names else None
    params = dict(model.named_parameters())
    for name, w in read_whole_weights(model, init_from, frozen):
        w = w.to(torch.bfloat16)
        if name in names:
            w = nf4.to_nf4(w, NF4_BLOCK, NF4_SCALER_BLOCK).get_original_weight()
        params[name].copy_(w)
    return sorted(names)


def _nf4_choice(model: nn.Module, state: dict, ckpt: Path, frozen: set[str]) -> set[str]:
    """The weights the trainer quantized, as its checkpoint records them (checked against the model: the
    train state is only as trusted as whoever can write checkpoints/). A checkpoint written before the record
    existed: the rule at one shard, which is what a one-rank run applied; a multi-rank one is refused."""
    names = state.get(NF4_WEIGHTS)
    if names is None:
        if state.get("world_size") != 1:
            raise UserError(f"cannot export {ckpt}: it does not record which weights its {state.get('world_size')} "
                            "ranks quantized to NF4 (written before checkpoints did): resume the run for one step "
                            "to write a checkpoint that does")
        return set(nf4_weight_names(model))
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    bad = [n for n in names if not isinstance(n, str) or n not in frozen or not nf4_fits(shapes[n])] \
        if isinstance(names, list) else [names]
    if bad:
        raise UserError(f"refusing checkpoint {ckpt}: its {NF4_WEIGHTS} names {str(bad[0])[:80]!r}, not a frozen "
                        "weight of its model that NF4 quantizes")
    return set(names)
