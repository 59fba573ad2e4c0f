"""The frozen base of a LoRA run in the precision the user picks (`train.lora.base_precision`): fp32 (as built),
bf16 (stored in bf16: no fp32 copy of weights that never change; computed in the run's precision) or nf4 (QLoRA,
Dettmers et al. 2023: torchao's 4-bit NormalFloat, block 64, scaler block 256).

NF4's scales are per whole weight (its scalers are themselves quantized against the mean of all of them), so a
weight is quantized whole, as it is read from `train.init_from`, one at a time, before FSDP2 shards it
(NF4Tensor implements FSDP2's all-gather extension: the local shard is an NF4Tensor of the rows this rank holds).
Weights whose size does not divide NF4's blocks (or whose FSDP shard would not) stay bf16, as do the embedding,
the norms and the LM head (QLoRA quantizes the blocks' projections). The adapters are fp32 (model/lora.py), with
their gradients and optimizer states.

torchao 0.18 moved NF4 to `torchao.quantization.quantize_.workflows.nf4.nf4_tensor` (the old
`torchao.dtypes.nf4tensor` path is gone); see docs/training.md.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from llmcluster.checkpoint.nf4_base import (  # noqa: F401  (is_nf4, nf4_fits: imported from here too)
    NF4_BLOCK, NF4_SCALER_BLOCK, is_nf4, nf4_fits, nf4_module, nf4_weight_names)
from llmcluster.config.schema import JobConfig

# Bytes per parameter: NF4 is 4 bits, one int8 scaler per 64 values, one fp32 factor per 256 scalers.
BYTES_PER_PARAM = {"fp32": 4.0, "bf16": 2.0, "nf4": 0.5 + 1 / NF4_BLOCK + 4 / (NF4_BLOCK * NF4_SCALER_BLOCK)}


@torch.no_grad()
def prepare_base(raw: nn.Module, cfg: JobConfig, device: torch.device, shards: int) -> str | None:
    """Cast the frozen base (still on the meta device) to the chosen precision; for nf4, read each weight that
    fits NF4's blocks whole from `train.init_from`, quantize it and put it in place (before FSDP shards it).
    Returns the run's line naming the choice and its bytes per parameter (None: no LoRA)."""
    lora = cfg.train.lora
    if lora is None:
        return None
    kind = lora.base_precision
    frozen = [(n, p) for n, p in raw.named_parameters() if not p.requires_grad]
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
        from llmcluster.train.hf_import import read_whole_weights

        names = nf4_weight_names(raw, shards)
        for name, w in read_whole_weights(raw, Path(cfg.train.init_from), names):
            mod_name, attr = name.rsplit(".", 1)
            mod = raw.get_submodule(mod_name)
            q = nf4.to_nf4(w.to(device=device, dtype=torch.bfloat16), NF4_BLOCK, NF4_SCALER_BLOCK)
            setattr(mod, attr, nn.Parameter(q, requires_grad=False))
            quantized += q.numel()
    n_frozen = sum(p.numel() for _, p in frozen)
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
