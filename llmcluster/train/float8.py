"""float8 training (`train.float8`) through torchao, applied from outside the model file (issue 36).

torchao's `convert_to_float8_training` swaps the blocks' nn.Linear for `Float8Linear`: the module keeps its
high-precision `weight` (so checkpoints, resume, HF names and export are unchanged) and casts weight, input and
output gradient to float8 inside each matmul, with dynamic scales (per tensor, or per row for `rowwise`).
As torchtitan does (components/quantization/float8.py), the conversion happens on the meta-device model before
TP / activation checkpointing / compile / FSDP, and leaves out the LM head (its output feeds the loss directly,
where float8's error costs most) and any Linear whose dims are not multiples of 16 (`torch._scaled_mm`'s rule).

FSDP: torchao's `enable_fsdp_float8_all_gather` stays False, so FSDP gathers the high-precision shards as
without float8 (correct, but not the float8 all-gather's bandwidth saving). TP, PP and LoRA with float8 are
refused in the schema (untested here). Real float8 matmuls need float8 tensor cores (sm89+: L40, RTX 4090,
H100, H200); `emulate: true` runs the same casts in high precision so CPU tests cover the path: no speed-up.
"""

from __future__ import annotations

import dataclasses
from importlib import metadata

import torch
from torch import nn

from llmcluster.config.schema import Float8Config
from llmcluster.errors import UserError

# The torch (major.minor) releases each torchao release was tested with here; another pair is refused rather
# than trusted (torchao's float8 kernels and its subclass tensors follow torch internals closely, and torchao
# 0.18 wants torch >= 2.11). Add a pair only after tests/test_float8.py (and on a GPU, gpu_check) pass on it.
TESTED = {"0.18.0": ("2.13",)}
EXCLUDED = ("lm_head",)   # as torchtitan's default filter leaves out `output`, its name for the head


def torchao_version() -> str | None:
    """The installed torchao's version, read from its metadata: importing it takes seconds and logs."""
    try:
        return metadata.version("torchao")
    except metadata.PackageNotFoundError:
        return None


def check_float8(cfg: Float8Config, device: torch.device) -> None:
    """Refuse, in one line, a float8 run this installation or this device cannot do as tested."""
    ao = torchao_version()
    if ao is None:
        raise UserError("train.float8 needs torchao: pip install 'llmcluster[float8]'")
    th = ".".join(torch.__version__.split("+")[0].split(".")[:2])
    if th not in TESTED.get(ao, ()):
        tested = "; ".join(f"torchao {a} with torch {', '.join(t)}" for a, t in TESTED.items())
        raise UserError(f"train.float8: torchao {ao} with torch {th} is not a tested pair (tested: {tested}); "
                        "pip install 'llmcluster[float8]' beside a tested torch")
    if cfg.emulate:
        return
    if device.type != "cuda":
        raise UserError(f"train.float8 needs a CUDA GPU with float8 tensor cores (sm89+), not {device.type} "
                        "(train.float8.emulate=true runs the casts in high precision: for tests only)")
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        raise UserError(f"train.float8 needs float8 tensor cores (sm89+: L40, RTX 4090, H100, H200); "
                        f"{torch.cuda.get_device_name(device)} is sm{major}{minor}: drop train.float8")


def convertible(module: nn.Module, fqn: str) -> bool:
    """torchtitan's filter: every Linear but the head, and only dims `torch._scaled_mm` accepts."""
    if fqn.rsplit(".", 1)[-1] in EXCLUDED:
        return False
    return not isinstance(module, nn.Linear) or (module.in_features % 16 == 0 and module.out_features % 16 == 0)


def apply_float8(model: nn.Module, cfg: Float8Config, device: torch.device) -> int:
    """Check, then swap the eligible Linear layers of `model` (any device, meta included) for torchao's
    Float8Linear in place. Returns how many were converted."""
    check_float8(cfg, device)
    from llmcluster.quiet import quiet_torchao_import

    with quiet_torchao_import(cuda=device.type == "cuda"):
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
        from torchao.float8.float8_linear import Float8Linear
    config = dataclasses.replace(Float8LinearConfig.from_recipe_name(cfg.recipe), emulate=cfg.emulate,
                                 enable_fsdp_float8_all_gather=False)
    convert_to_float8_training(model, config=config, module_filter_fn=convertible)
    return sum(isinstance(m, Float8Linear) for m in model.modules())
