"""LoRA (Hu et al. 2021) on the model's nn.Linear projections, applied from outside the model file.

Each targeted nn.Linear becomes a LoRALinear in place (same module, same `weight` name, two parameters more:
`lora_A` (rank x in) and `lora_B` (out x rank)), so checkpoints, HF names and FSDP wrapping stay as they are.
Every other parameter is frozen: gradients and AdamW states exist for the adapters alone. Export merges
W + (alpha / rank) B A into the weights, and also writes the adapters in PEFT's format.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from llmcluster.config.schema import LoraConfig
from llmcluster.model import init as seeded
from llmcluster.model.names import plain_name


class LoRALinear(nn.Linear):
    lora_scaling: float

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, compute_weight(self.weight, x)) + \
            F.linear(F.linear(x, self.lora_A), self.lora_B) * self.lora_scaling


def compute_weight(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """A frozen base weight stored in bf16 (train.lora.base_precision) in the run's precision: as is under
    autocast (which casts it) or when it matches x; else cast to x's dtype. An NF4 weight (torchao) casts
    itself in its own linear."""
    if w.dtype == x.dtype or torch.is_autocast_enabled(x.device.type) or hasattr(w, "get_original_weight"):
        return w
    return w.to(x.dtype)


def lora_modules(model: nn.Module) -> dict[str, LoRALinear]:
    return {n: m for n, m in model.named_modules() if isinstance(m, LoRALinear)}


def apply_lora(model: nn.Module, cfg: LoraConfig) -> int:
    """Turn the targeted projections into LoRALinear (on any device, meta included) and freeze the rest.
    Returns the number of trainable parameters."""
    for name, mod in list(model.named_modules()):
        if type(mod) is nn.Linear and name.rsplit(".", 1)[-1] in cfg.targets:
            # fp32 whatever the base is stored in (train.lora.base_precision): the adapters, their gradients
            # and optimizer states are the only trained state
            dev, dt = mod.weight.device, torch.float32
            mod.__class__ = LoRALinear
            mod.lora_A = nn.Parameter(torch.empty(cfg.rank, mod.in_features, device=dev, dtype=dt))
            mod.lora_B = nn.Parameter(torch.empty(mod.out_features, cfg.rank, device=dev, dtype=dt))
            mod.lora_scaling = cfg.alpha / cfg.rank
    n = 0
    for name, p in model.named_parameters():
        p.requires_grad_(".lora_" in name)
        n += p.numel() if p.requires_grad else 0
    return n


@torch.no_grad()
def init_lora(model: nn.Module, seed: int | None, fill=None) -> None:
    """A ~ Kaiming-uniform (as PEFT), B = 0. Seeded like Llama.init_weights: A's values are a pure function of
    (seed, its name, element index) and reach `fill(param, draw)` (which keeps a shard's own slice), so the
    adapters depend neither on the mesh nor on the device."""
    fill = fill or (lambda t, draw: t.copy_(draw()))
    for name, m in sorted(lora_modules(model).items()):
        bound = 1.0 / (m.in_features ** 0.5)  # kaiming_uniform_(a=sqrt(5)) on (rank, in)
        if seed is None:
            nn.init.uniform_(m.lora_A, -bound, bound)
        else:
            key, shape = f"{plain_name(name)}.lora_A", tuple(m.lora_A.shape)
            fill(m.lora_A, lambda rows=None, cols=None, key=key, shape=shape, bound=bound:
                 seeded.draw(seed, key, shape, bound, seeded.uniform_pm1, rows=rows, cols=cols))
        m.lora_B.zero_()


def merged_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The plain model's state dict with every adapter folded into its weight (W + s·B·A)."""
    state = {k: v for k, v in model.state_dict().items() if ".lora_" not in k}
    for name, m in lora_modules(model).items():
        w = m.weight.get_original_weight() if hasattr(m.weight, "get_original_weight") else m.weight  # NF4
        state[f"{name}.weight"] = (w.float() + m.lora_scaling * (m.lora_B @ m.lora_A)).to(w.dtype).detach()
    return state


def save_peft_adapter(model: nn.Module, cfg: LoraConfig, out: Path, base_model: str) -> None:
    """adapter_config.json + adapter_model.safetensors as PEFT writes them for a LlamaForCausalLM."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for name, m in lora_modules(model).items():
        prefix = f"base_model.model.model.{name}"
        tensors[f"{prefix}.lora_A.weight"] = m.lora_A.detach().contiguous().clone()
        tensors[f"{prefix}.lora_B.weight"] = m.lora_B.detach().contiguous().clone()
    save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
        "r": cfg.rank, "lora_alpha": cfg.alpha, "lora_dropout": 0.0, "target_modules": sorted(cfg.targets),
        "bias": "none", "fan_in_fan_out": False, "inference_mode": True, "modules_to_save": None,
        "init_lora_weights": True, "use_rslora": False, "use_dora": False}, indent=2))
