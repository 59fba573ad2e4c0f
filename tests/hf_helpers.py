"""A real Hugging Face tokenizer and a small random Llama, made here with `tokenizers` and `transformers`."""

from __future__ import annotations

import json
from pathlib import Path

CORPUS = [f"record {i}: the quick brown fox {'jumps over ' * (i % 7)}the lazy dog number {i * 37}.\n"
          f"def f_{i}(x):\n    return x * {i} + {i % 5}\n" for i in range(400)]


def make_hf_tokenizer(out: Path, vocab: int = 384, texts=CORPUS) -> Path:
    """A byte-level BPE with Llama-style <s>/</s>, saved by transformers as an HF tokenizer directory, with a
    post-processor that prepends <s> (as Llama's does)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=["<s>", "</s>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>").save_pretrained(out)
    return out


def make_hf_llama(out: Path, vocab: int, tie: bool = False, max_shard_size: str | None = "60KB",
                  rope_scaling: bool = True, seed: int = 0, **shape) -> Path:
    """A small random LlamaForCausalLM (GQA, rope_theta 500000, Llama-3 rope scaling), saved in safetensors
    shards (several files, so loading must follow the index) plus its tokenizer."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    kw = dict(vocab_size=vocab, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, rope_theta=500000.0,
              tie_word_embeddings=tie, bos_token_id=0, eos_token_id=1, rms_norm_eps=1e-5)
    kw.update(shape)      # e.g. a head dim vLLM's CPU kernel runs (num_attention_heads=2: 32)
    if rope_scaling:
        kw["rope_scaling"] = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                              "high_freq_factor": 4.0, "original_max_position_embeddings": 32,
                              "rope_theta": 500000.0}
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**kw))
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(out, safe_serialization=True, **kwargs)
    return out


def read_json(p: Path) -> dict:
    return json.loads(Path(p).read_text())


def make_hf_storage(base: Path, **shape) -> dict:
    """A small random Llama (`shape`: make_hf_llama's keyword arguments) with its tokenizer under base/llama, and a
    storage root base/storage holding the CORPUS prepared with that tokenizer as the text dataset `corpus`."""
    from conftest import run_cli

    model = make_hf_tokenizer(base / "llama")
    vocab = json.loads((model / "tokenizer.json").read_text())["model"]["vocab"]
    make_hf_llama(model, vocab=len(vocab) + 2, **shape)  # + <s>, </s>
    corpus = base / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in CORPUS))
    root = base / "storage"
    run_cli("data", "prepare", "--root", root, "--name", "corpus", "--kind", "text", "--source", corpus,
            "--tokenizer", model, "--val-fraction", "0.1", check=True)
    return {"model": model, "root": root}
