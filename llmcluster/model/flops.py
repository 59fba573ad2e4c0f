"""Parameter count and training FLOPs per token, computed from the config alone (no weights needed)."""

from __future__ import annotations

from llmcluster.config.schema import ModelConfig


def param_count(cfg: ModelConfig, include_embedding: bool = True) -> int:
    d, f, L, V = cfg.d_model, cfg.ffn_hidden, cfg.n_layers, cfg.vocab_size
    kv = cfg.kv_heads * cfg.head_dim
    attn = d * d * 2 + d * kv * 2          # q, o  +  k, v
    mlp = 3 * d * f                         # gate, up, down
    norms = 2 * d
    per_layer = attn + mlp + norms
    emb = V * d
    head = 0 if cfg.tie_embeddings else V * d
    total = L * per_layer + d + head + (emb if include_embedding else 0)
    return total


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token, PaLM appendix B: 6N + 12·L·H·Q·T (forward + backward, no recompute).

    N excludes the input embedding (a lookup, not a matmul) as torchtitan counts it; the output
    projection stays in. H·Q = d_model. Attention is counted over the full T×T (PaLM's convention,
    even though causal attention does half the work).
    """
    n = param_count(cfg, include_embedding=cfg.tie_embeddings)
    return 6.0 * n + 12.0 * cfg.n_layers * cfg.d_model * seq_len
