"""A Llama-style decoder: RMSNorm, RoPE (as Hugging Face's Llama applies it), SwiGLU, GQA, optional tied
embeddings. Readable in one sitting; it knows nothing of parallelism (see llmcluster/train/parallelize.py).

Parameter names follow Hugging Face's Llama one to one (minus the `model.` prefix), so export is a rename
of a handful of prefixes and nothing more.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from llmcluster.config.schema import ModelConfig
from llmcluster.model.init import draw as seeded_draw
from llmcluster.model.loss import cross_entropy_sum, head_loss  # noqa: F401 (re-exported)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # In x's dtype: the fused op upcasts inside (variance, normalisation and weight in fp32, one rounding of
        # the result), as HF's LlamaRMSNorm computes it but without an fp32 copy of x or a second rounding
        # before the weight. On fp32 it gives the bits of weight * rms_norm(x) written apart (parity tests).
        return F.rms_norm(x, (x.shape[-1],), self.weight.to(x.dtype), self.eps)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


def rope_cos_sin(head_dim: int, max_len: int, theta: float, device=None,
                 scaling=None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables of shape (max_len, head_dim), frequencies repeated over the two halves (HF layout)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    if scaling is not None:
        inv_freq = llama3_scaled(inv_freq, scaling)
    t = torch.arange(max_len, device=device, dtype=torch.float32)
    freqs = torch.outer(t, inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def llama3_scaled(inv_freq: torch.Tensor, s) -> torch.Tensor:
    """Llama 3.1's long-context RoPE: wavelengths longer than the original context / low_freq_factor are
    stretched by `factor`, shorter than context / high_freq_factor kept, the band between interpolated
    (as HF's `_compute_llama3_parameters`, so imported weights see the positions they were trained on)."""
    old = s.original_max_position_embeddings
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old / s.low_freq_factor, inv_freq / s.factor, inv_freq)
    smooth = (old / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = (wavelen >= old / s.high_freq_factor) & (wavelen <= old / s.low_freq_factor)
    return torch.where(medium, smoothed, scaled)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    # HF rotates split halves, not interleaved pairs: the same weights give wrong logits the other way.
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: (B, H, T, D); cos/sin: (T, D)
    return (x * cos + rotate_half(x) * sin).to(x.dtype)


def repeat_kv(x: torch.Tensor, n_heads: int) -> torch.Tensor:
    """(B, kv_heads, T, D) -> (B, n_heads, T, D), query head h reading kv head h // (n_heads / kv_heads):
    the grouping of SDPA's enable_gqa and of HF's repeat_kv."""
    return x if x.shape[1] == n_heads else x.repeat_interleave(n_heads // x.shape[1], dim=1)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.head_dim = cfg.head_dim
        self.q_proj = nn.Linear(cfg.d_model, cfg.n_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.d_model, cfg.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.d_model, cfg.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.n_heads * self.head_dim, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor | None = None, cache: "LayerKV | None" = None) -> torch.Tensor:
        B, T, _ = x.shape
        # Head counts come from the tensors, not the config: under tensor parallelism each rank holds
        # n_heads / tp of them and this code must not care.
        q = self.q_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is not None:   # generation: attend to every key so far, not just this call's
            k, v = cache.update(k, v)
        if mask is None:
            # GQA: each kv head serves n_heads / n_kv_heads query heads; SDPA broadcasts them itself (the
            # flash kernel) instead of materialising repeated k/v copies. One new token after a cache attends
            # to every key (not causal); a whole sequence is causal.
            y = F.scaled_dot_product_attention(q, k, v, is_causal=k.shape[2] == T,
                                               enable_gqa=k.shape[1] != q.shape[1])
        else:
            # A document mask: on CUDA, flash refuses any mask and the efficient and cuDNN kernels refuse the
            # GQA broadcast, so mask + enable_gqa falls to the math kernel (B·H·T² fp32 scores: OOM or a
            # several-fold slowdown at T=4096). Repeating k/v to every query head lets the memory-efficient
            # kernel take the mask; the copies cost far less than the scores would.
            k, v = repeat_kv(k, q.shape[1]), repeat_kv(v, q.shape[1])
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.d_model, cfg.ffn_hidden, bias=False)
        self.up_proj = nn.Linear(cfg.d_model, cfg.ffn_hidden, bias=False)
        self.down_proj = nn.Linear(cfg.ffn_hidden, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor | None = None, cache: "LayerKV | None" = None) -> torch.Tensor:
        # mask by keyword: tensor parallelism's input preparation of self_attn maps positional inputs only
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask=mask, cache=cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class Llama(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        # On the meta device (shapes only: init_weights fills everything after to_empty), nn.Embedding's normal_
        # and the RoPE math would import torch._dynamo (~1 s: their meta kernels are dynamo-disabled references).
        meta = torch.get_default_device().type == "meta"
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.d_model,
                                         _weight=torch.empty(cfg.vocab_size, cfg.d_model) if meta else None)
        # A ModuleDict keyed "0".."L-1" keeps names stable when blocks are wrapped or pipelined away.
        self.layers = nn.ModuleDict({str(i): Block(cfg) for i in range(cfg.n_layers)})
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        # RoPE tables are derived, never saved: non-persistent buffers stay out of checkpoints and exports.
        cos, sin = ([torch.empty(cfg.max_seq_len, cfg.head_dim, dtype=torch.float32) for _ in "cs"] if meta else
                    rope_cos_sin(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta, scaling=cfg.rope_scaling))
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.compile_loss = False   # the head's loss compiled (train/parallelize.py: apply_compile sets it)

    @torch.no_grad()
    def init_weights(self, seed: int | None = None, fill=None) -> None:
        """Initialise every parameter and buffer (also after building on the meta device and `to_empty`).

        Normal(0, init_std) everywhere, with the residual output projections scaled by 1/sqrt(2L)
        (GPT-2): each block adds two of them to the residual stream, so its variance stays O(1) with depth.
        Seeded: each weight's values are a pure function of (seed, its name, element index), computed on the
        CPU whatever device the weights are on (`model/init.py`), and handed to `fill(param, draw)` as a
        `draw(rows=None, cols=None)` of any slice (default: copy the whole weight in). A caller whose
        parameters are shards passes a `fill` that draws only its own slice, so the weights depend neither on
        how the model is split nor on the device or host.
        """
        fill = fill or (lambda t, draw: t.copy_(draw()))
        std = self.cfg.init_std
        out_std = std / math.sqrt(2 * self.cfg.n_layers)

        def normal_(name: str, t: torch.Tensor, s: float) -> None:
            if seed is None:  # in place on whatever the tensor is (a shard, on GPU): fast for big models
                nn.init.normal_(t, 0.0, s)
                return
            fill(t, lambda rows=None, cols=None: seeded_draw(seed, name, tuple(t.shape), s, rows=rows,
                                                             cols=cols))

        normal_("embed_tokens.weight", self.embed_tokens.weight, std)
        for i, block in self.layers.items():  # names as in the plain model's state dict, whatever wraps it
            for part, lin, s in (("self_attn.q_proj", block.self_attn.q_proj, std),
                                 ("self_attn.k_proj", block.self_attn.k_proj, std),
                                 ("self_attn.v_proj", block.self_attn.v_proj, std),
                                 ("self_attn.o_proj", block.self_attn.o_proj, out_std),
                                 ("mlp.gate_proj", block.mlp.gate_proj, std),
                                 ("mlp.up_proj", block.mlp.up_proj, std),
                                 ("mlp.down_proj", block.mlp.down_proj, out_std)):
                normal_(f"layers.{i}.{part}.weight", lin.weight, s)
            block.input_layernorm.reset_parameters()
            block.post_attention_layernorm.reset_parameters()
        self.norm.reset_parameters()
        if not self.cfg.tie_embeddings:
            normal_("lm_head.weight", self.lm_head.weight, std)
        cos, sin = rope_cos_sin(self.cfg.head_dim, self.cfg.max_seq_len, self.cfg.rope_theta,
                                scaling=self.cfg.rope_scaling)
        self.rope_cos.copy_(cos)
        self.rope_sin.copy_(sin)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None, loss_chunks: int = 1,
                cache: "KVCache | None" = None) -> torch.Tensor:
        """tokens (B, T) -> logits (B, T, vocab); with `targets` (B, T) instead the fp32 cross-entropy summed
        over the targets that are not -100 (the trainer divides), in `loss_chunks` slices of the B·T positions
        (model/loss.py).
        The loss is computed inside forward so that the head's weights are used where FSDP gathered them.
        With a `cache` (generation), `tokens` follow the ones it holds (positions, masks and attention
        continue from there) and are added to it."""
        if cache is not None:
            return self._forward_cached(tokens, cache)
        T = tokens.shape[1]
        cos, sin = self._rope(0, T)
        mask = None if self.cfg.doc_mask_id is None else document_mask(tokens, self.cfg.doc_mask_id)
        h = self.embed_tokens(tokens)
        for block in self.layers.values():
            h = block(h, cos, sin) if mask is None else block(h, cos, sin, mask=mask)
        h = self.norm(h)
        if targets is None:
            return self.lm_head(h)
        return head_loss(self.lm_head, h, targets, loss_chunks, compiled=self.compile_loss)

    def _rope(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin of positions [start, end) in the compute dtype (autocast's, else the weights'), as HF's
        LlamaRotaryEmbedding hands them out: the angles are fp32 in the tables, only the T×D slice is rounded,
        once per forward, and RoPE then runs in q's and k's own dtype instead of promoting them to fp32."""
        kind = self.rope_cos.device.type
        dtype = (torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind)
                 else self.embed_tokens.weight.dtype)
        return self.rope_cos[start:end].to(dtype), self.rope_sin[start:end].to(dtype)

    def _forward_cached(self, tokens: torch.Tensor, cache: "KVCache") -> torch.Tensor:
        start, T = cache.pos, tokens.shape[1]
        end = cache.append_tokens(tokens)
        cos, sin = self._rope(start, end)
        # The rows of these tokens in the mask the whole sequence would get: one new token sees every key
        # (no mask); a first chunk is plain causal; a later chunk needs its offset causal rows.
        mask = None
        if self.cfg.doc_mask_id is not None:
            mask = document_mask(cache.tokens[:, :end], self.cfg.doc_mask_id)[:, :, start:]
        elif start and T > 1:
            mask = torch.ones(T, end, dtype=torch.bool, device=tokens.device).tril(start)
        h = self.embed_tokens(tokens)
        for i, block in enumerate(self.layers.values()):
            h = block(h, cos, sin, mask=mask, cache=cache.layer(i))
        cache.pos = end
        return self.lm_head(self.norm(h))


class KVCache:
    """Keys and values (after RoPE) of the tokens generated so far, for every layer, preallocated to `max_len`:
    each decoding step then computes one token's projections instead of the whole sequence's."""

    def __init__(self, model: Llama, batch: int, max_len: int):
        cfg, w = model.cfg, model.embed_tokens.weight
        shape = (cfg.n_layers, batch, cfg.kv_heads, max_len, cfg.head_dim)
        self.k = torch.zeros(shape, dtype=w.dtype, device=w.device)
        self.v = torch.zeros_like(self.k)
        self.tokens = torch.zeros(batch, max_len, dtype=torch.long, device=w.device)  # for document masks
        self.pos = 0                                       # tokens held

    def append_tokens(self, tokens: torch.Tensor) -> int:
        end = self.pos + tokens.shape[1]
        if end > self.tokens.shape[1]:
            raise ValueError(f"KV cache full: {end} tokens > its {self.tokens.shape[1]}")
        self.tokens[:, self.pos:end] = tokens
        return end

    def layer(self, i: int) -> "LayerKV":
        return LayerKV(self, i)


class LayerKV:
    """One layer's view of a KVCache: stores this call's keys and values, returns all of them so far."""

    def __init__(self, cache: KVCache, i: int):
        self.cache, self.i = cache, i

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        c, start = self.cache, self.cache.pos
        end = start + k.shape[2]
        c.k[self.i, :, :, start:end] = k
        c.v[self.i, :, :, start:end] = v
        return c.k[self.i, :, :, :end], c.v[self.i, :, :, :end]


def document_mask(tokens: torch.Tensor, end_id: int) -> torch.Tensor:
    """(B, 1, T, T) causal mask that also keeps each packed document to itself; a document's end token
    belongs to it. RoPE is relative, so a document then sees exactly what it would see alone."""
    end = tokens == end_id
    doc = torch.cumsum(end, dim=1) - end.long()
    t = torch.arange(tokens.shape[1], device=tokens.device)
    return ((doc[:, :, None] == doc[:, None, :]) & (t[:, None] >= t[None, :]))[:, None]


def build_model(cfg: ModelConfig, device: str | torch.device = "cpu", seed: int | None = None) -> Llama:
    """Build on `device`; 'meta' builds the shapes only (for counting, or to shard before materialising)."""
    with torch.device(device):
        model = Llama(cfg)
    if str(device) != "meta":
        model.init_weights(seed)
    return model
