"""Size vLLM serving for a model on a cluster's GPUs: weights per TP rank, KV bytes per token, the KV tokens that fit,
the context x concurrency they give, and the decode/prefill bounds. Pure arithmetic, no torch.

Per GPU, the engine may take gpu_memory_utilization x the GPU's memory (the one GPU table, config/gpus.py). From
it come, in order: the weights (1/tp of every matrix; norms replicated), a reserve (the CUDA context and workspaces
of the cluster's hardware.gpu_reserved_gib, CUDA graphs, the activations of one prefill chunk and the sampler's
logits), and what is left is KV cache, in blocks of 16 tokens as vLLM allocates it. A sequence of n tokens holds
n x 2 x layers x kv_heads x head_dim x bytes of KV, split over the TP ranks by KV head (a TP degree above the KV
heads replicates them, as vLLM does). Decode reads every weight once per step (memory-bound); prefill is
compute-bound. Figures and the worked examples: docs/serving.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from llmcluster.config.gpus import GPUSpec
from llmcluster.config.serve import ServeConfig
from llmcluster.errors import UserError
from llmcluster.model.flops import matmul_params, train_flops_per_token
from llmcluster.plan.memory import GIB, count_params
from llmcluster.plan.served_model import ServedModel

BLOCK_TOKENS = 16          # vLLM's KV block on CUDA: the cache is a whole number of blocks
CUDA_GRAPH_GIB = 0.5       # decode CUDA graphs vLLM captures (planning assumption; --enforce-eager frees it)
DEFAULT_MAX_NUM_SEQS = 256  # vLLM's default --max-num-seqs on GPUs
FULL_SEQS = 4              # a chosen max_model_len leaves room for this many requests at full length
MIN_CONTEXT = 2048         # the shortest context planned unless serve.max_model_len asks for less
LOGIT_BYTES = 4            # the sampler works on fp32 logits
# Bytes per weight of the quantized linear layers. int4 (AWQ/GPTQ, group size 128): 4 bits, plus an fp16 scale
# and a 4-bit zero point per group. The embedding, the output head and the norms stay in the 16-bit dtype.
INT4_BYTES = 0.5 + (2 + 0.5) / 128
QUANT_BYTES = {"fp8": 1.0, "awq": INT4_BYTES, "gptq": INT4_BYTES}
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


@dataclass(frozen=True)
class Box:
    """What serving needs of a cluster: the cluster spec's (`serve plan`) or the training planner's view of it
    (`plan`'s serving cost)."""
    name: str | None
    gpu: GPUSpec | None
    nodes: int
    gpus_per_node: int
    reserved_gib: float            # hardware.gpu_reserved_gib: CUDA context and workspaces
    intra_latency_us: float        # topology.intra_latency_us: one collective step inside a node

    @property
    def total_gpus(self) -> int:
        return self.nodes * self.gpus_per_node

    @classmethod
    def from_cluster(cls, c) -> "Box":
        return cls(c.name, c.hardware.spec, c.node_count, c.gpus_per_node, c.hardware.gpu_reserved_gib,
                   c.topology.intra_latency_us)

    @classmethod
    def from_plan(cls, c) -> "Box":
        return cls(c.name, c.spec, c.nodes, c.gpus_per_node, c.gpu_reserved_gib, c.intra_latency_us)


@dataclass
class Candidate:
    tp: int
    quant: str                     # none / fp8 / awq / gptq
    weights: float                 # bytes per GPU
    reserve: dict[str, float]      # bytes per GPU: context, cuda_graphs, activations
    kv_budget: float               # bytes per GPU left for the KV cache (may be < 0)
    kv_per_token_gpu: float
    kv_tokens: int
    fits: bool = False
    max_model_len: int = 0
    max_num_seqs: int = 0
    notes: list[str] = field(default_factory=list)


def serve_dtype(cfg: ServeConfig, m: ServedModel) -> str:
    """auto: the checkpoint's 16-bit type; a float32 checkpoint (our exports) is served in bfloat16, as vLLM does."""
    if cfg.dtype != "auto":
        return cfg.dtype
    return "float16" if m.checkpoint_dtype in ("float16", "half") else "bfloat16"


def kv_heads_per_gpu(kv_heads: int, n_heads: int, tp: int) -> int:
    """KV heads one TP rank holds, or a one-line error for a degree the engine refuses (vLLM: tp divides the
    query heads, and divides the KV heads or is a multiple of them, which are then replicated)."""
    if n_heads % tp:
        raise UserError(f"serve.tp {tp} does not divide the model's {n_heads} attention heads")
    if (kv_heads % tp) if tp <= kv_heads else (tp % kv_heads):
        raise UserError(f"serve.tp {tp} does not divide the model's {kv_heads} KV heads "
                        f"(nor is a multiple of them)")
    return max(1, kv_heads // tp)


def kv_bytes_per_token(m: ServedModel, kv_bytes: int) -> int:
    """2 (K and V) x layers x KV heads x head dim x bytes: the whole model's KV for one token."""
    s = m.spec
    return 2 * s.n_layers * s.kv_heads * s.head_dim * kv_bytes


def weights_per_gpu(m: ServedModel, tp: int, quant: str, dtype_bytes: int) -> float:
    pc = count_params(m.spec)
    norms = pc.n_layers * 2 * m.spec.d_model + pc.final_norm
    linear = (pc.per_layer * pc.n_layers + pc.final_norm) - norms   # q, k, v, o, gate, up, down
    per_linear = QUANT_BYTES.get(quant, dtype_bytes)
    return (linear * per_linear + (pc.embedding + pc.output) * dtype_bytes) / tp + norms * dtype_bytes


def reserve_per_gpu(m: ServedModel, cfg: ServeConfig, tp: int, dtype_bytes: int,
                    context_gib: float) -> dict[str, float]:
    """What the engine holds besides weights and KV: the CUDA context and workspaces (the cluster's
    hardware.gpu_reserved_gib), CUDA graphs, and the profile run's peak: one prefill chunk's widest live tensors in
    a layer (residual + normed input, q/k/v, gate + up) and the sampler's fp32 logits for every sequence."""
    s = m.spec
    width = 2 * s.d_model + (s.n_heads + 2 * s.kv_heads) * s.head_dim / tp + 2 * s.ffn_hidden / tp
    seqs = cfg.max_num_seqs or DEFAULT_MAX_NUM_SEQS
    acts = cfg.max_num_batched_tokens * width * dtype_bytes + seqs * s.vocab_size * LOGIT_BYTES
    return {"context": context_gib * GIB, "cuda_graphs": CUDA_GRAPH_GIB * GIB, "activations": acts}


def needed_len(m: ServedModel, cfg: ServeConfig) -> int:
    """The context a layout must hold one request of: serve.max_model_len, else 2,048 tokens (or the model's
    shorter context)."""
    return cfg.max_model_len or min(m.context, MIN_CONTEXT)


def _pow2_floor(n: int) -> int:
    return 1 << (max(1, n).bit_length() - 1)


def size(m: ServedModel, gpu: GPUSpec, cfg: ServeConfig, tp: int, quant: str, context_gib: float) -> Candidate:
    """One layout: its memory per GPU and the context x concurrency its KV cache gives."""
    s = m.spec
    dtype_bytes = DTYPE_BYTES[serve_dtype(cfg, m)]
    kv_bytes = 1 if cfg.kv_cache_dtype == "fp8" else dtype_bytes
    per_gpu_heads = kv_heads_per_gpu(s.kv_heads, s.n_heads, tp)
    kv_gpu = 2 * s.n_layers * per_gpu_heads * s.head_dim * kv_bytes
    w = weights_per_gpu(m, tp, quant, dtype_bytes)
    reserve = reserve_per_gpu(m, cfg, tp, dtype_bytes, context_gib)
    budget = cfg.gpu_memory_utilization * gpu.memory_bytes - w - sum(reserve.values())
    blocks = int(budget // (BLOCK_TOKENS * kv_gpu)) if budget > 0 else 0
    c = Candidate(tp, quant, w, reserve, budget, kv_gpu, blocks * BLOCK_TOKENS)
    need = needed_len(m, cfg)
    c.fits = c.kv_tokens >= need
    if cfg.max_model_len:
        c.max_model_len = cfg.max_model_len
    else:   # the model's context, or less so that FULL_SEQS requests at full length fit at once
        c.max_model_len = min(m.context, max(need, _pow2_floor(c.kv_tokens // FULL_SEQS)))
    full = c.kv_tokens // c.max_model_len if c.max_model_len else 0
    c.max_num_seqs = cfg.max_num_seqs or max(1, min(DEFAULT_MAX_NUM_SEQS, full))
    if cfg.max_num_seqs and cfg.max_num_seqs > full:
        c.notes.append(f"max_num_seqs {cfg.max_num_seqs} > the {full} full-length sequences the KV cache holds: "
                       "long requests will be preempted (recomputed) when the cache fills")
    return c


def tp_degrees(m: ServedModel, cfg: ServeConfig, gpus_per_node: int) -> list[int]:
    """The TP degrees to try: serve.tp, else powers of two up to one node (vLLM's TP stays inside a node)."""
    if cfg.tp is not None:
        if cfg.tp > gpus_per_node:
            raise UserError(f"serve.tp {cfg.tp} > the {gpus_per_node} GPUs per node of the cluster "
                            f"(tensor parallelism stays inside one node)")
        kv_heads_per_gpu(m.spec.kv_heads, m.spec.n_heads, cfg.tp)
        return [cfg.tp]
    out, t = [], 1
    while t <= gpus_per_node:
        try:
            kv_heads_per_gpu(m.spec.kv_heads, m.spec.n_heads, t)
            out.append(t)
        except UserError:
            pass
        t *= 2
    return out


def quantizations(m: ServedModel, cfg: ServeConfig, gpu: GPUSpec) -> list[str]:
    """In order of preference: the checkpoint's own; else none, fp8 (GPUs with fp8 tensor cores), int4 (AWQ)."""
    if m.checkpoint_quant:
        if cfg.quantization not in (None, m.checkpoint_quant):
            raise UserError(f"serve.quantization {cfg.quantization}: the checkpoint is {m.checkpoint_quant}-quantized")
        return [m.checkpoint_quant]
    if cfg.quantization == "fp8" and gpu.fp8_tflops is None:
        raise UserError(f"serve.quantization fp8: {gpu.name} has no fp8 tensor cores (awq or gptq do)")
    if cfg.quantization is not None:
        return [cfg.quantization]
    return ["none"] + (["fp8"] if gpu.fp8_tflops is not None else []) + ["awq"]


def _gb(x: float) -> str:
    return f"{x / 1e9:.1f} GB"


def _refusal(m: ServedModel, gpu: GPUSpec, cfg: ServeConfig, gpus: int, best: Candidate) -> str:
    need = needed_len(m, cfg)
    left = (f"leaving {_gb(best.kv_budget)} of KV cache ({best.kv_tokens:,} tokens), short of the {need:,} tokens of "
            f"one max_model_len request" if best.kv_budget > 0 else
            f"{_gb(-best.kv_budget)} over the budget before any KV cache (one max_model_len request needs "
            f"{need:,} tokens)")
    return (f"{m.name} does not fit {gpus} x {gpu.name} at gpu_memory_utilization {cfg.gpu_memory_utilization:g} "
            f"({_gb(cfg.gpu_memory_utilization * gpu.memory_bytes)} per GPU): the best layout, "
            f"{best.quant if best.quant != 'none' else 'unquantized'} at tp {best.tp}, needs "
            f"{_gb(best.weights)} of weights + {_gb(sum(best.reserve.values()))} reserve per GPU, {left}; more GPUs, "
            f"int4 weights, serve.kv_cache_dtype=fp8, serve.gpu_memory_utilization or a shorter serve.max_model_len")


def serve_plan(m: ServedModel, cluster: Box, cfg: ServeConfig) -> dict:
    """The recommended layout and its figures (a JSON-able dict; `fits` false with `refusal` when none fits)."""
    gpu = cluster.gpu
    if gpu is None:
        raise UserError(f"cluster {cluster.name}: hardware.gpu is none: serve plan sizes GPU serving "
                        f"(give --cluster, e.g. rtx4090-box)")
    if cfg.max_model_len and cfg.max_model_len > m.context:
        raise UserError(f"serve.max_model_len {cfg.max_model_len} exceeds {m.name}'s context of {m.context} tokens "
                        f"(max_position_embeddings)")
    per_node, gpus = cluster.gpus_per_node, cluster.total_gpus
    tried = [size(m, gpu, cfg, tp, q, cluster.reserved_gib)
             for q in quantizations(m, cfg, gpu) for tp in tp_degrees(m, cfg, per_node)]
    if not tried:
        raise UserError(f"no TP degree up to {per_node} divides {m.name}'s {m.spec.n_heads} heads / "
                        f"{m.spec.kv_heads} KV heads")
    # Prefer a layout with room for FULL_SEQS requests of the needed length over one that barely fits (a 70B at
    # tp 2 on 80 GB GPUs holds 7k tokens; at tp 4, 436k)
    need = needed_len(m, cfg)
    chosen = next((c for c in tried if c.kv_tokens >= FULL_SEQS * need), None) or \
        next((c for c in tried if c.fits), None)
    c = chosen or max(tried, key=lambda t: t.kv_budget)
    out = describe(m, cluster, gpu, cfg, c)
    out["candidates"] = [{"tp": t.tp, "quantization": t.quant, "weights_per_gpu_bytes": t.weights,
                          "kv_tokens": t.kv_tokens, "fits": t.fits} for t in tried]
    if chosen is None:
        out["refusal"] = _refusal(m, gpu, cfg, gpus, c)
    return out


def describe(m: ServedModel, cluster: Box, gpu: GPUSpec, cfg: ServeConfig, c: Candidate) -> dict:
    s, pc = m.spec, count_params(m.spec)
    dtype = serve_dtype(cfg, m)
    n = matmul_params(pc.total, pc.embedding, s.tie_embeddings)
    peak = gpu.peak_tflops("fp8" if c.quant == "fp8" else "fp32" if dtype == "float32" else "bf16") * 1e12
    bw = gpu.memory_bw_gbps * 1e9
    # two all-reduces per layer and step under TP: latency-bound at decode sizes
    comm = 2 * s.n_layers * cluster.intra_latency_us * 1e-6 if c.tp > 1 else 0.0
    decode_one = 1 / (c.weights / bw + comm)
    seqs, avg_ctx = c.max_num_seqs, c.max_model_len / 2     # a full batch, each sequence half-way
    step = max((c.weights + seqs * avg_ctx * c.kv_per_token_gpu) / bw, seqs * 2 * n / c.tp / peak) + comm
    prefill_flops = train_flops_per_token(n, s.n_layers, s.attn_dim, c.max_model_len) / 3   # forward only
    prefill = c.tp * peak / prefill_flops
    ttft_ms = c.max_model_len / prefill * 1e3
    replicas = cluster.total_gpus // c.tp
    kv_bytes = 1 if cfg.kv_cache_dtype == "fp8" else DTYPE_BYTES[dtype]
    notes = list(c.notes)
    if c.quant in ("awq", "gptq") and not m.checkpoint_quant:
        notes.append(f"--quantization {c.quant} needs a checkpoint quantized to 4 bits ({c.quant.upper()}; e.g. with "
                     "llm-compressor): vLLM does not quantize to int4 as it loads")
    if c.quant == "fp8" and not m.checkpoint_quant:
        notes.append("vLLM quantizes the weights to fp8 as it loads them (--quantization fp8)")
    if c.tp > 1 and gpu.nvlink_gbps is None:
        notes.append(f"tp {c.tp} over PCIe ({gpu.name} has no NVLink): the bounds count the all-reduces' latency, "
                     "not their bandwidth; prefill loses more than decode")
    args = ["--tensor-parallel-size", str(c.tp), "--dtype", dtype, "--max-model-len", str(c.max_model_len),
            "--max-num-seqs", str(c.max_num_seqs), "--gpu-memory-utilization", f"{cfg.gpu_memory_utilization:g}"]
    if c.quant != "none":
        args += ["--quantization", c.quant]
    if cfg.kv_cache_dtype != "auto":
        args += ["--kv-cache-dtype", cfg.kv_cache_dtype]
    slo = cfg.slo.ttft_p99_ms
    return {
        "model": {"name": m.name, "source": m.source, "params": pc.total, "n_layers": s.n_layers,
                  "n_heads": s.n_heads, "n_kv_heads": s.kv_heads, "head_dim": s.head_dim,
                  "attention": "GQA" if s.kv_heads < s.n_heads else "MHA", "context": m.context,
                  "checkpoint_dtype": m.checkpoint_dtype, "checkpoint_quantization": m.checkpoint_quant},
        "cluster": {"name": cluster.name, "gpu": gpu.name, "nodes": cluster.nodes,
                    "gpus_per_node": cluster.gpus_per_node, "memory_bw_GBps": gpu.memory_bw_gbps},
        "serve": {"tp": c.tp, "replicas": replicas, "dtype": dtype, "quantization": c.quant,
                  "kv_cache_dtype": cfg.kv_cache_dtype, "gpu_memory_utilization": cfg.gpu_memory_utilization,
                  "max_model_len": c.max_model_len, "max_num_seqs": c.max_num_seqs, "fits": c.fits,
                  "vllm_args": args},
        "memory": {"per_gpu_bytes": {"budget": cfg.gpu_memory_utilization * gpu.memory_bytes,
                                     "weights": c.weights, "reserve": sum(c.reserve.values()),
                                     "kv_cache": max(c.kv_budget, 0.0)},
                   "reserve_bytes": c.reserve, "gpu_capacity_bytes": gpu.memory_bytes},
        "kv": {"bytes_per_token": kv_bytes_per_token(m, kv_bytes),
               "bytes_per_token_per_gpu": c.kv_per_token_gpu, "tokens_fit": c.kv_tokens,
               "block_tokens": BLOCK_TOKENS,
               "full_length_seqs": c.kv_tokens // c.max_model_len if c.max_model_len else 0},
        "throughput": {"decode_tokens_per_s_bound": decode_one,
                       "decode_batch_tokens_per_s_bound": seqs / step,
                       "cluster_decode_tokens_per_s_bound": replicas * seqs / step,
                       "prefill_tokens_per_s_bound": prefill, "ttft_bound_ms": ttft_ms},
        "slo": {"ttft_p99_ms": slo, "ttft_bound_ms": ttft_ms,
                "met_at_bound": None if slo is None else ttft_ms <= slo},
        "notes": notes,
    }
