"""Which attention call the model makes, with and without a document mask (GQA: 4 query heads, 2 kv heads).

On CUDA, SDPA with a mask *and* `enable_gqa=True` can only take the math kernel (flash refuses masks, the
efficient and cuDNN kernels the GQA broadcast): the model must hand SDPA k/v already repeated to every query
head when a mask is present. Kernel choice itself cannot be observed on CPU (benchmarks/gpu_check.sh probes
it on a GPU); what the model passes to SDPA can, by wrapping it, and the numbers are compared with a math
reference written out here in float64.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from llmcluster.config.schema import ModelConfig
from llmcluster.model.llama import Attention, apply_rope, document_mask, rope_cos_sin

CFG = ModelConfig(n_layers=1, d_model=64, n_heads=4, n_kv_heads=2, ffn_hidden=128, vocab_size=50, max_seq_len=32)
T = 12


@pytest.fixture
def sdpa_calls(monkeypatch):
    """Every F.scaled_dot_product_attention call: (q, k, v shapes, keyword arguments)."""
    calls = []
    real = F.scaled_dot_product_attention

    def spy(q, k, v, **kw):
        calls.append((q.shape, k.shape, v.shape, kw))
        return real(q, k, v, **kw)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    return calls


def inputs(seed: int = 0):
    torch.manual_seed(seed)
    attn = Attention(CFG).double()
    x = torch.randn(2, T, CFG.d_model, dtype=torch.float64)
    cos, sin = (t.double() for t in rope_cos_sin(CFG.head_dim, T, CFG.rope_theta))
    tokens = torch.randint(1, 50, (2, T))
    tokens[0, 4] = tokens[1, 7] = 0  # document ends: row 0 holds two documents, row 1 two others
    return attn, x, cos, sin, document_mask(tokens, 0)


def math_reference(attn: Attention, x, cos, sin, mask) -> torch.Tensor:
    """Attention written out: query head h reads kv head h // (n_heads / kv_heads), masked softmax."""
    B, H, KV, D = x.shape[0], CFG.n_heads, CFG.kv_heads, CFG.head_dim
    q = apply_rope(attn.q_proj(x).view(B, T, H, D).transpose(1, 2), cos, sin)
    k = apply_rope(attn.k_proj(x).view(B, T, KV, D).transpose(1, 2), cos, sin)
    v = attn.v_proj(x).view(B, T, KV, D).transpose(1, 2)
    group = torch.arange(H) // (H // KV)
    scores = q @ k[:, group].transpose(-1, -2) / math.sqrt(D)
    y = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1) @ v[:, group]
    return attn.o_proj(y.transpose(1, 2).reshape(B, T, -1))


def test_mask_hands_sdpa_kv_expanded_to_every_query_head(sdpa_calls):
    attn, x, cos, sin, mask = inputs()
    with torch.no_grad():
        got = attn(x, cos, sin, mask=mask)
        ref = math_reference(attn, x, cos, sin, mask)
    [(q, k, v, kw)] = sdpa_calls
    assert q[1] == k[1] == v[1] == CFG.n_heads  # repeated before SDPA: a kernel that takes a mask can run
    assert not kw.get("enable_gqa") and not kw.get("is_causal") and kw["attn_mask"] is mask
    torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-10)


def test_without_mask_sdpa_broadcasts_gqa_itself(sdpa_calls):
    attn, x, cos, sin, _ = inputs(1)
    causal = torch.ones(T, T, dtype=torch.bool).tril()[None, None]
    with torch.no_grad():
        got = attn(x, cos, sin)
        ref = math_reference(attn, x, cos, sin, causal)
    [(q, k, v, kw)] = sdpa_calls
    assert q[1] == CFG.n_heads and k[1] == v[1] == CFG.kv_heads  # no copies: the flash kernel's GQA
    assert kw.get("attn_mask") is None and kw["is_causal"] and kw["enable_gqa"]
    torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-10)
