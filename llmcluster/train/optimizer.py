"""AdamW with decoupled weight decay on matrices only, and the warmup + cosine learning-rate schedule."""

from __future__ import annotations

import math

import torch
from torch import nn

from llmcluster.config.schema import TrainConfig


def build_optimizer(model: nn.Module, cfg: TrainConfig, device: torch.device) -> torch.optim.Optimizer:
    # Decay weight matrices and embeddings; never norms' gains (decaying them only fights the norm).
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.dim() >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": cfg.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    # fused on CUDA and CPU (one kernel over all params; on CPU foreach is a per-tensor loop of ~7 ops: 6.8 vs
    # 1.8 ms a step for llm_tiny's 3.1M params on 2 cores), except fp16 on CPU: the CPU kernel refuses the
    # sharded grad scaler's found_inf ("output with shape [] doesn't match the broadcast shape [1]", torch 2.13).
    if cfg.optimizer != "adamw":
        return low_bit_adamw(groups, cfg)
    fused = device.type == "cuda" or (device.type == "cpu" and cfg.precision != "fp16")
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
                             fused=fused or None, foreach=None if fused else True)


def low_bit_adamw(groups: list[dict], cfg: TrainConfig) -> torch.optim.Optimizer:
    """torchao.optim's AdamW8bit / AdamW4bit: the two moments block-quantized (1 or 0.5 bytes a value plus
    scales); their update compiles with inductor on first use. Saved through DCP like AdamW's."""
    from llmcluster.errors import UserError
    from llmcluster.quiet import quiet_torchao_import

    try:
        with quiet_torchao_import(cuda=torch.cuda.is_available()):
            from torchao.optim import AdamW4bit, AdamW8bit
    except ImportError as e:
        raise UserError(f"train.optimizer={cfg.optimizer} needs torchao ({e}): pip install 'llmcluster[float8]'") \
            from None
    base = AdamW8bit if cfg.optimizer == "adamw8bit" else AdamW4bit

    class FloatLr(base):
        """torchao keeps each group's lr as a tensor (an input of its compiled update, not a constant to
        recompile on); here it stays a float between steps, as the scheduler, the metrics and train_state.json
        (JSON) read it, and becomes a tensor for the step alone."""

        def add_param_group(self, param_group: dict) -> None:
            torch.optim.Optimizer.add_param_group(self, param_group)

        def step(self, closure=None):
            lrs = [g["lr"] for g in self.param_groups]
            for g in self.param_groups:
                g["lr"] = torch.tensor(float(g["lr"]), dtype=torch.float32)
            try:
                return super().step(closure)
            finally:
                for g, lr in zip(self.param_groups, lrs):
                    g["lr"] = lr

    FloatLr.__name__ = base.__name__
    return FloatLr(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps)


def lr_factor(step: int, cfg: TrainConfig) -> float:
    """Multiplier of train.lr at `step` (0-based count of completed optimizer steps)."""
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return 1.0
    span = max(1, cfg.steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    floor = cfg.min_lr_ratio
    if cfg.schedule == "linear":
        return floor + (1 - floor) * (1 - progress)
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))


def build_scheduler(opt: torch.optim.Optimizer, cfg: TrainConfig) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda step: lr_factor(step, cfg))
