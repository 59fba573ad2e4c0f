"""The `serve` section: how a model is served by vLLM (read by `serve plan`; the engine's flags carry its names).

Every key is optional: None lets `serve plan` choose it (the smallest tensor-parallel degree that fits, no
quantization before fp8 before int4, a context and concurrency from the KV cache that is left). A value that is
set is a constraint the plan must honour, or it refuses in one line.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, validate_assignment=True)


class ServeSlo(_Section):
    ttft_p99_ms: float | None = Field(None, gt=0)   # time to first token, p99 (monitoring alerts on it)


class ServeConfig(_Section):
    # vLLM's --gpu-memory-utilization: the share of each GPU's memory the engine may take (weights, activations,
    # KV cache); the rest is left to other processes on the GPU
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1)
    tp: int | None = Field(None, ge=1)               # --tensor-parallel-size; None: the smallest that fits
    # --dtype of weights and activations. auto: the checkpoint's 16-bit type; fp32 checkpoints (our exports) are
    # served in bfloat16, as vLLM does
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = "auto"
    # --quantization. None: the checkpoint's own (config.json quantization_config), else none, then fp8 on GPUs
    # with fp8, then int4 (awq needs a quantized checkpoint); `none` forbids quantizing
    quantization: Literal["none", "fp8", "awq", "gptq"] | None = None
    kv_cache_dtype: Literal["auto", "fp8"] = "auto"  # --kv-cache-dtype; fp8 halves the KV bytes per token
    max_model_len: int | None = Field(None, ge=16)   # --max-model-len; None: chosen from the KV cache that fits
    max_num_seqs: int | None = Field(None, ge=1)     # --max-num-seqs; None: full-context sequences that fit
    max_num_batched_tokens: int = Field(2048, ge=16)  # prefill chunk: sizes the activation reserve
    slo: ServeSlo = ServeSlo()
