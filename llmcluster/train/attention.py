"""Which SDPA kernel attention runs on: the backend priority order, and the one line that says what it chose.

The model (model/llama.py) calls `F.scaled_dot_product_attention` and leaves the kernel to SDPA's dispatcher;
the order is set here, around every forward and backward (`step_context` in train/parallelize.py), so a block
recomputed under activation checkpointing picks the same kernel in backward as it did in forward.

Why the order is safe (torch's own dispatcher, aten/src/ATen/native/transformers/cuda/sdp_utils.cpp,
`select_sdp_backend`): it walks the priority order and returns the first backend whose `can_use_*` filters
all pass for these tensors (head dim, layout, dtype, mask, GQA, GPU generation), so a backend that cannot
run an input is skipped, never forced; each forward op has its own backward op, so the pair stays matched.
torch itself puts cuDNN first (`check_prefer_cudnn_attention`) on sm90/sm10x with cuDNN > 9.15.0 only, the
release with the fix for sequence lengths not divisible by 128 (pytorch#169849); below that it keeps
Flash → Efficient → Math → cuDNN. We apply the same rule on every torch we support (2.6 lacks it), by
`torch.nn.attention.sdpa_kernel(order, set_priority=True)` where that exists; TORCH_CUDNN_SDPA_DEPRIORITIZED
(torch's switch) keeps cuDNN last here too. On CPU the order does not apply: torch's CPU dispatcher
(sdp_utils_cpp.cpp) tries its fused flash kernel, then math.
"""

from __future__ import annotations

import contextlib
import inspect
import os

import torch

CUDNN_PREFERRED_FROM = 91501   # cuDNN 9.15.1 (torch's test: version > 91500)
SHORT = {"CUDNN_ATTENTION": "cuDNN", "FLASH_ATTENTION": "Flash", "EFFICIENT_ATTENTION": "Efficient", "MATH": "Math"}


def backend_order(capability: tuple[int, int] | None, cudnn_version: int | None,
                  deprioritized: bool = False) -> list[str] | None:
    """SDPBackend names, first tried first, for a CUDA device of `capability` with cuDNN `cudnn_version`;
    None on a CPU (capability None). Pure: the caller reads the device."""
    if capability is None:
        return None
    fast = ["FLASH_ATTENTION", "EFFICIENT_ATTENTION", "MATH"]
    if (not deprioritized and capability[0] in (9, 10) and (cudnn_version or 0) >= CUDNN_PREFERRED_FROM):
        return ["CUDNN_ATTENTION", *fast]
    return [*fast, "CUDNN_ATTENTION"]


def device_order(device: torch.device) -> list[str] | None:
    if device.type != "cuda":
        return None
    return backend_order(torch.cuda.get_device_capability(device), torch.backends.cudnn.version(),
                         os.environ.get("TORCH_CUDNN_SDPA_DEPRIORITIZED", "") not in ("", "0"))


def priority_supported() -> bool:
    """torch.nn.attention.sdpa_kernel takes set_priority (not every torch we support does)."""
    from torch.nn.attention import sdpa_kernel

    return "set_priority" in inspect.signature(sdpa_kernel).parameters


def sdpa_priority(order: list[str] | None):
    """A context in which SDPA tries the backends in `order` (all stay enabled: one that cannot run an input
    falls through to the next); nothing when there is no order or this torch cannot set one."""
    if not order or not priority_supported():
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([getattr(SDPBackend, name) for name in order], set_priority=True)


def chosen_kernel(model_cfg, seq_len: int, device: torch.device, dtype: torch.dtype,
                  order: list[str] | None) -> str:
    """The backend SDPA's dispatcher picks for the model's attention at this shape (one sequence), under
    `order`: the same call the model makes (causal with GQA, or the document mask with K/V repeated)."""
    from torch.nn.attention import SDPBackend

    head_dim = model_cfg.d_model // model_cfg.n_heads
    q = torch.zeros(1, model_cfg.n_heads, seq_len, head_dim, device=device, dtype=dtype, requires_grad=True)
    masked = model_cfg.doc_mask_id is not None
    kv_heads = model_cfg.n_heads if masked else model_cfg.kv_heads
    k = torch.zeros(1, kv_heads, seq_len, head_dim, device=device, dtype=dtype, requires_grad=True)
    kwargs = ({"attn_mask": torch.ones(seq_len, seq_len, dtype=torch.bool, device=device)} if masked
              else {"is_causal": True, "enable_gqa": kv_heads != model_cfg.n_heads})
    with sdpa_priority(order):
        choice = torch._fused_sdp_choice(q, k, k, **kwargs)
    return {int(b): name for name, b in SDPBackend.__members__.items()}.get(choice, str(choice))


def attention_line(cfg, device: torch.device) -> str:
    """One line for the start of a run: the kernel and why."""
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(cfg.train.precision, torch.float32)
    order = device_order(device)
    kernel = chosen_kernel(cfg.model, cfg.data.seq_len, device, dtype, order)
    if order is None:
        return (f"attention: SDPA {kernel} on CPU ({torch.backends.cpu.get_cpu_capability()}; torch's CPU "
                "dispatcher tries its fused flash kernel, then math)")
    how = " → ".join(SHORT[n] for n in order)
    if not priority_supported():
        how = f"torch {torch.__version__}'s own order (no sdpa_kernel set_priority)"
    return (f"attention: SDPA {kernel} (order {how}; sm{''.join(map(str, torch.cuda.get_device_capability(device)))}, "
            f"cuDNN {torch.backends.cudnn.version()}, {cfg.train.precision})")
