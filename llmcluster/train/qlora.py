"""The frozen base of a LoRA run in the precision the user picks (`train.lora.base_precision`): fp32 (as built),
bf16 (stored in bf16: no fp32 copy of weights that never change; computed in the run's precision) or nf4 (QLoRA,
Dettmers et al. 2023: torchao's 4-bit NormalFloat, block 64, scaler block 256).

NF4's scales are per whole weight (its scalers are themselves quantized against the mean of all of them), so
quantizing a shard is not quantizing the weight. The NF4 weights are placed on the meta device first, as NF4
(`prepare_base`), so FSDP2 shards them as NF4 (NF4Tensor implements FSDP2's all-gather extension: the local
shard is an NF4Tensor of the rows this rank holds) with nothing read yet; then `quantize_base` reads each weight
whole from `train.init_from`, quantizes it whole and keeps this rank's rows, one weight at a time. So no rank
holds more than one whole weight at a time (as stored and in bf16 while quantizing, then in NF4 until its rows
are copied out), on top of its shards; without FSDP (one rank) the whole NF4 base is the rank's anyway.
Weights whose size does not divide NF4's blocks (or whose FSDP shard would not) stay bf16, as do the embedding,
the norms and the LM head (QLoRA quantizes the blocks' projections); they are loaded shard by shard after
sharding, like every bf16/fp32 base (train/hf_import.py). The adapters are fp32 (model/lora.py), with their
gradients and optimizer states.

torchao 0.18 moved NF4 to `torchao.quantization.quantize_.workflows.nf4.nf4_tensor` (the old
`torchao.dtypes.nf4tensor` path is gone); see docs/training.md.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from llmcluster.checkpoint.nf4_base import (NF4_BLOCK, NF4_SCALER_BLOCK, is_nf4, nf4_module, nf4_weight_names,
                                             read_whole_weights)
from llmcluster.config.schema import JobConfig

# Bytes per parameter: NF4 is 4 bits, one int8 scaler per 64 values, one fp32 factor per 256 scalers.
BYTES_PER_PARAM = {"fp32": 4.0, "bf16": 2.0, "nf4": 0.5 + 1 / NF4_BLOCK + 4 / (NF4_BLOCK * NF4_SCALER_BLOCK)}


@torch.no_grad()
def prepare_base(raw: nn.Module, cfg: JobConfig, device: torch.device, shards: int) -> str | None:
    """Cast the frozen base (still on the meta device) to the chosen precision; nf4: each weight that fits NF4's
    blocks (and its `shards` FSDP shards) becomes an NF4 weight on the meta device, to be sharded as NF4 and
    then filled by `quantize_base`. Returns the run's line naming the choice and its bytes per parameter (None:
    no LoRA)."""
    lora = cfg.train.lora
    if lora is None:
        return None
    kind = lora.base_precision
    if kind != "fp32":
        for mod in raw.modules():   # computed in the run's precision whatever they are stored in
            if type(mod) is nn.Linear:
                mod.__class__ = FrozenLinear
            elif type(mod) is nn.Embedding:
                mod.__class__ = FrozenEmbedding
                mod.compute_dtype = torch.float32 if cfg.train.precision == "fp32" else None
            for name, p in list(mod._parameters.items()):
                if p is not None and not p.requires_grad and p.dtype == torch.float32:
                    mod._parameters[name] = nn.Parameter(p.to(torch.bfloat16), requires_grad=False)
        if cfg.model.tie_embeddings:
            raw.lm_head.weight = raw.embed_tokens.weight
    quantized = 0
    if kind == "nf4":
        nf4 = nf4_module()
        for name in nf4_weight_names(raw, shards):
            mod_name, attr = name.rsplit(".", 1)
            shaped = nf4.to_nf4(raw.get_parameter(name), NF4_BLOCK, NF4_SCALER_BLOCK)   # meta: shapes only
            setattr(raw.get_submodule(mod_name), attr, nn.Parameter(shaped, requires_grad=False))
            quantized += shaped.numel()
    n_frozen = sum(p.numel() for p in raw.parameters() if not p.requires_grad)
    if kind == "nf4":
        rest = n_frozen - quantized
        nbytes = quantized * BYTES_PER_PARAM["nf4"] + rest * 2
        detail = (f"{quantized / 1e6:.2f}M params in NF4 (block {NF4_BLOCK}, scaler block {NF4_SCALER_BLOCK}: "
                  f"{BYTES_PER_PARAM['nf4']:.3f} bytes/param), {rest / 1e6:.2f}M in bf16 (2 bytes/param)")
    else:
        nbytes = n_frozen * BYTES_PER_PARAM[kind]
        detail = f"{n_frozen / 1e6:.2f}M params at {BYTES_PER_PARAM[kind]:g} bytes/param"
    n_train = sum(p.numel() for p in raw.parameters() if p.requires_grad)
    return (f"LoRA base {kind}: {detail}, {nbytes / max(n_frozen, 1):.3f} bytes/param over the base "
            f"({nbytes / 2**20:.1f} MiB); adapters fp32: {n_train / 1e6:.3f}M params with fp32 grads and "
            f"{cfg.train.optimizer} states")


@torch.no_grad()
def quantize_base(raw: nn.Module, cfg: JobConfig, device: torch.device) -> None:
    """Fill the NF4 weights `prepare_base` left on the meta device (after FSDP2 has sharded them, if it does):
    each is read whole from `train.init_from`, quantized whole, and this rank's rows of it (a DTensor's local
    shard; all of it, unsharded) are put in its place before the next weight is read."""

    names = [n for n, p in raw.named_parameters() if is_nf4(p) and p.is_meta]
    if not names:
        return
    nf4 = nf4_module()
    for name, w in read_whole_weights(raw, Path(cfg.train.init_from), names):
        p = raw.get_parameter(name)
        new = _own_rows(nf4.to_nf4(w.to(device=device, dtype=torch.bfloat16), NF4_BLOCK, NF4_SCALER_BLOCK), p)
        del w   # the weight as stored; the whole NF4 one is gone with _own_rows's frame (a shard keeps its rows)
        torch.utils.swap_tensors(p, nn.Parameter(new, requires_grad=False))   # FSDP2 holds `p` itself


def _own_rows(whole: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """`whole` (an NF4 weight) as `p` holds it: a DTensor of this rank's rows (FSDP2's Shard(0); nf4_fits: an
    even split into whole NF4 blocks), copied into storage of their own; else `whole` itself."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if not isinstance(p, DTensor):
        return whole
    (rows, _), (offset, _) = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
    mine = whole.split(rows)[offset // rows]   # views into the whole weight's NF4 data
    local = mine.new_zeros(mine.shape)
    local.copy_(mine)
    return DTensor.from_local(local, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())


def tensor_bytes(t: torch.Tensor) -> int:
    """The bytes a tensor holds: a DTensor's local shard; a tensor subclass's (NF4, torchao's low-bit optimizer
    states) inner tensors, each counted as stored."""
    if hasattr(t, "to_local"):
        t = t.to_local()
    if type(t) in (torch.Tensor, nn.Parameter) or not hasattr(t, "__tensor_flatten__"):
        return t.numel() * t.element_size()
    names, _ = t.__tensor_flatten__()
    return sum(tensor_bytes(getattr(t, n)) for n in names)


class FrozenLinear(nn.Linear):
    """A frozen projection (or LM head) stored in bf16, computed in the run's precision."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from llmcluster.model.lora import compute_weight

        return F.linear(x, compute_weight(self.weight, x))


class FrozenEmbedding(nn.Embedding):
    """A frozen embedding stored in bf16: its rows in fp32 when the run computes in fp32 (train.precision, or a
    CPU without native bf16); else as stored (autocast or FSDP's bf16 policy computes in bf16 anyway)."""
    compute_dtype: torch.dtype | None = None

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        out = super().forward(tokens)
        return out if self.compute_dtype is None else out.to(self.compute_dtype)


def unsharded_nf4(cfg: JobConfig, dims) -> bool:
    """An NF4 base on an FSDP mesh of one rank is left unwrapped: torch 2.13's FSDP2 at world size 1 skips the
    all-gather and copies only the first of an extension's all-gather inputs (`all_gather_inputs[0]` in
    FSDPParamGroup.wait_for_unshard), and NF4's fsdp_post_all_gather needs its three (scalers, factor, data)."""
    lora = cfg.train.lora
    return bool(lora and lora.base_precision == "nf4" and dims.dp_shard * dims.dp_replicate == 1)


def materialize(raw: nn.Module, device: torch.device) -> None:
    """`raw.to_empty(device)` for every parameter and buffer still on the meta device; the NF4 weights, already
    quantized from the checkpoint, keep their values (to_empty would give them empty NF4 storage)."""
    for mod in raw.modules():
        for store in (mod._parameters, mod._buffers):
            for name, t in list(store.items()):
                if t is None or not t.is_meta:
                    continue
                new = torch.empty_like(t, device=device)
                if isinstance(t, nn.Parameter):
                    new = nn.Parameter(new, requires_grad=t.requires_grad)
                    torch.utils.swap_tensors(t, new)   # FSDP2 holds the Parameter object itself
                else:
                    store[name] = new


def skip_nf4(fill):
    """A `fill(param, draw)` for Llama.init_weights that leaves the NF4 weights as they were quantized."""
    return lambda p, draw: None if is_nf4(p) else fill(p, draw)


def shard_line(raw: nn.Module) -> str | None:
    """After FSDP2: what this rank holds of the first NF4 weight (a local NF4Tensor of its rows)."""
    for name, p in raw.named_parameters():
        if is_nf4(p):
            local = p.to_local() if hasattr(p, "to_local") else p
            return (f"NF4 shard: {name} is an {type(local).__name__} of {tuple(local.shape)} of "
                    f"{tuple(p.shape)}")
    return None
