"""`generate` with a KV cache: greedy tokens identical to the cache-less path and to transformers' `generate` (a small
random Llama made by transformers, GQA and Llama-3 RoPE scaling), up to max_seq_len where both stop (with a note)."""

from __future__ import annotations

import pytest
import torch

from conftest import assert_one_line_error, cli_inprocess
from hf_helpers import make_hf_llama, make_hf_tokenizer
from llmcluster.config.schema import ModelConfig
from llmcluster.export.generate import load_exported, sample
from llmcluster.model.llama import KVCache, build_model

transformers = pytest.importorskip("transformers")


def greedy(model, prompt, n, max_len, cache, eot=None):
    return sample(model, prompt, n, 0.0, 0, max_len, eot, torch.Generator(), cache=cache)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """A transformers-made Llama saved as one safetensors file with a tokenizer: a directory `generate` reads."""
    out = tmp_path_factory.mktemp("hf")
    make_hf_tokenizer(out)
    tok = transformers.AutoTokenizer.from_pretrained(out)
    make_hf_llama(out, vocab=len(tok), max_shard_size=None)   # max_position_embeddings 128
    return out


@pytest.mark.slow
def test_cached_greedy_equals_uncached_and_transformers(exported):
    ours, _, cfg = load_exported(exported)
    hf = transformers.AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32).eval()
    torch.manual_seed(0)
    for prompt in ([0, 5, 17, 42, 9], torch.randint(2, cfg.vocab_size, (40,)).tolist()):
        cached = greedy(ours, prompt, 30, cfg.max_seq_len, cache=True, eot=1)
        assert cached == greedy(ours, prompt, 30, cfg.max_seq_len, cache=False, eot=1)
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=30, do_sample=False, eos_token_id=1,
                          pad_token_id=1)[0, len(prompt):].tolist()
        assert cached == [t for t in ref if t != 1], (cached, ref)
        assert len(cached) > 5


def test_both_paths_stop_at_max_seq_len_like_transformers(exported):
    ours, _, cfg = load_exported(exported)
    hf = transformers.AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32).eval()
    prompt = torch.randint(2, cfg.vocab_size, (100,), generator=torch.Generator().manual_seed(1)).tolist()
    cached = greedy(ours, prompt, 50, cfg.max_seq_len, cache=True)
    assert len(prompt) + len(cached) == cfg.max_seq_len == 128                 # 28 of the 50 asked
    assert cached == greedy(ours, prompt, 50, cfg.max_seq_len, cache=False)
    ref = hf.generate(torch.tensor([prompt]), max_length=128, min_new_tokens=28, do_sample=False,
                      eos_token_id=None, pad_token_id=1)[0, len(prompt):].tolist()
    assert cached == ref


def test_document_mask_and_chunked_prefill_match_the_full_forward():
    """A model trained with doc_mask_id: a prompt that holds an end token keeps its documents apart with the cache
    too; feeding the prompt in two chunks gives the full forward's logits."""
    cfg = ModelConfig(n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, ffn_hidden=96, vocab_size=50, max_seq_len=48,
                      doc_mask_id=3)
    model = build_model(cfg, seed=0).eval()
    prompt = [7, 8, 9, 3, 11, 12, 3, 14]
    assert greedy(model, prompt, 30, 48, cache=True) == greedy(model, prompt, 30, 48, cache=False)
    for doc_mask in (3, None):
        model.cfg = cfg.model_copy(update={"doc_mask_id": doc_mask})
        tokens = torch.tensor([prompt + [5, 6, 3, 7]])
        with torch.no_grad():
            full = model(tokens)
            kv = KVCache(model, 1, 48)
            parts = torch.cat([model(tokens[:, :5], cache=kv), model(tokens[:, 5:9], cache=kv),
                               model(tokens[:, 9:], cache=kv)], dim=1)
        torch.testing.assert_close(parts, full, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_generate_cli_notes_the_stop_and_refuses_a_long_prompt(exported, capsys):
    prompt = "record 1: the quick brown fox " * 9      # ~110 of the 128 tokens
    cached = cli_inprocess(capsys, "generate", "--model", exported, "--prompt", prompt,
                           "--max-new-tokens", "200", "--temperature", "0")
    assert cached.returncode == 0, cached.stderr
    assert "note: stopped after" in cached.stderr and "max_seq_len (128" in cached.stderr
    plain = cli_inprocess(capsys, "generate", "--model", exported, "--prompt", prompt,
                          "--max-new-tokens", "200", "--temperature", "0", "--no-cache")
    assert plain.stdout == cached.stdout
    assert_one_line_error(cli_inprocess(capsys, "generate", "--model", exported, "--prompt", "def f_1(x): " * 80),
                          "max_seq_len (128)")
