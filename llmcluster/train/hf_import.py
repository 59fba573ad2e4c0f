"""Start a run from a Hugging Face model directory (`train.init_from`); size the vocabulary from the data and
keep packed chat documents apart (`model.doc_mask_id`).

The model section comes from the directory's config.json (Llama family: GQA, rope_theta, Llama 3 RoPE
scaling, tied or untied embeddings); a model key the job config sets to something else is refused, so a run
never silently trains a different shape than the weights. The weights are copied onto the already built,
already sharded model: each parameter reads, through safetensors' memory-mapped slices, only the part this
rank holds (its FSDP/TP shard), so no rank ever reads or holds the whole model.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from llmcluster.checkpoint.nf4_base import check_shape, hf_name, is_nf4, weight_map
from llmcluster.config.load import validate
from llmcluster.config.schema import JobConfig, ModelConfig
from llmcluster.errors import UserError

# Keys of the model section config.json determines; max_seq_len may be lowered (it only sizes RoPE tables).
FROM_HF = ("n_layers", "d_model", "n_heads", "n_kv_heads", "ffn_hidden", "vocab_size", "rope_theta",
           "rope_scaling", "norm_eps", "tie_embeddings")


def read_hf_config(path: Path) -> dict:
    f = path / "config.json"
    if not f.is_file():
        raise UserError(f"train.init_from={path}: no config.json there (a local Hugging Face model directory)")
    try:
        return json.loads(f.read_text())
    except ValueError as e:
        raise UserError(f"{f}: not JSON ({e})") from None


def model_from_init(model: ModelConfig, path: Path) -> ModelConfig:
    """The model section for `init_from`: config.json's values; a contradicting explicit key is an error."""
    from llmcluster.config.hf import model_fields_from_hf

    try:
        hf = model_fields_from_hf(read_hf_config(path))
    except KeyError as e:
        raise UserError(f"{path / 'config.json'}: missing {e} (not a Llama config)") from None
    hf_model = validate(hf, ModelConfig, str(path / "config.json"))
    mine = model.model_dump()
    for key in sorted(model.model_fields_set):
        theirs = getattr(hf_model, key)
        theirs = theirs.model_dump() if hasattr(theirs, "model_dump") else theirs
        if key in FROM_HF and mine[key] != theirs:
            raise UserError(f"model.{key}={mine[key]} contradicts train.init_from's config.json ({theirs}): "
                            f"drop it from the model section")
        if key == "max_seq_len" and mine[key] > theirs:
            raise UserError(f"model.max_seq_len={mine[key]} exceeds train.init_from's max_position_embeddings "
                            f"({theirs})")
    keep = {k: mine[k] for k in model.model_fields_set if k not in FROM_HF}
    return validate({**hf, **keep}, ModelConfig, str(path / "config.json"))


def resolve_model_config(cfg: JobConfig, root: Path) -> None:
    """Fill the model section in place: from `train.init_from`, else the vocabulary from the data's tokenizer
    when the config leaves `model.vocab_size` unset."""
    from llmcluster.data.dataset import read_meta, tokenizer_dir
    from llmcluster.data.shards import META

    try:  # a missing dataset is the trainer's to report (after the config's own checks), not ours
        data_dir = tokenizer_dir(root, cfg.data)
        meta = read_meta(data_dir) if (data_dir / META).is_file() else None
    except UserError:
        data_dir, meta = None, None
    if cfg.train.init_from:
        path = Path(cfg.train.init_from)
        cfg.model = model_from_init(cfg.model, path)
        if meta is not None:
            _check_same_tokenizer(path, data_dir)
    elif meta is not None and "vocab_size" not in cfg.model.model_fields_set:
        cfg.model = cfg.model.model_copy(update={"vocab_size": int(meta["vocab_size"])})
    if meta and meta.get("masks") and "doc_mask_id" not in cfg.model.model_fields_set:  # chat: kept apart
        cfg.model = cfg.model.model_copy(update={"doc_mask_id": int(meta["eot_id"])})


def _check_same_tokenizer(model_dir: Path, data_dir: Path) -> None:
    from tokenizers import Tokenizer

    theirs = model_dir / "tokenizer.json"
    if not theirs.is_file():
        return  # a weights-only directory: nothing to compare against
    if Tokenizer.from_file(str(theirs)).get_vocab() != Tokenizer.from_file(str(data_dir / "tokenizer.json")).get_vocab():
        raise UserError(f"dataset {data_dir} was not tokenized with {model_dir}'s tokenizer: prepare it with "
                        f"`data prepare --tokenizer {model_dir}`")


@torch.no_grad()
def load_hf_weights(model: nn.Module, path: Path) -> int:
    """Copy the safetensors weights into `model` (plain, FSDP2 or TP: each rank reads only its slice).
    Returns the number of parameters loaded."""
    from safetensors import safe_open
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    wmap = weight_map(path)
    handles: dict[Path, object] = {}
    n = 0
    try:
        for name, p in model.named_parameters():  # a tied lm_head is the embedding: named once
            if ".lora_" in name or is_nf4(p):
                continue  # adapters: as init_lora drew them; NF4: quantized whole as read (train/qlora.py)
            key = hf_name(name)
            if key not in wmap:
                raise UserError(f"train.init_from={path}: no weight {key!r} in the safetensors")
            f = wmap[key]
            if f not in handles:
                handles[f] = safe_open(str(f), framework="pt")
            sl = handles[f].get_slice(key)
            check_shape(path, key, sl, p)
            if isinstance(p, DTensor):
                shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
                local = p.to_local()
                if local.numel():
                    local.copy_(sl[tuple(slice(o, o + s) for o, s in zip(offset, shape))])
            else:
                p.copy_(sl[:])
            n += p.numel()
    finally:
        handles.clear()
    return n
