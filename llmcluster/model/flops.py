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


def matmul_params(total: float, embedding: float, tied: bool) -> float:
    """The parameters that take part in matmuls: all but the input embedding (a lookup). A tied head is a
    matmul, so a tied model keeps its one embedding matrix."""
    return total if tied else total - embedding


def train_flops_per_token(matmul_params_: float, n_layers: int, attn_dim: int, seq_len: int) -> float:
    """The package's one FLOPs convention (docs/planning.md), used by bench, the trainer's MFU and the planner:

        6·N + 12·L·H·Q·T        (PaLM appendix B: forward + backward, no recomputation)

    N = matmul_params (torchtitan leaves the input embedding out; the output projection stays in), H·Q = heads x
    head dimension, attention counted over the full T×T (PaLM's convention, though causal attention does half)."""
    return 6.0 * matmul_params_ + 12.0 * n_layers * attn_dim * seq_len


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token of a job config's model (train_flops_per_token)."""
    return train_flops_per_token(param_count(cfg, include_embedding=cfg.tie_embeddings), cfg.n_layers,
                                 cfg.n_heads * cfg.head_dim, seq_len)
