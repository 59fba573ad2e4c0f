"""A chat-tuned export for the tests that serve or export one (test_export_chat, the vLLM fixture's chat model)."""

from __future__ import annotations

import json
from pathlib import Path

from conftest import overrides, run_cli

# A model small enough to learn the chats' shape in seconds on 2 cores; head dim 32 (vLLM's CPU kernel has it)
# (conftest's overrides() is the 16-dim-head tiny model; the byte tokenizer + ChatML markers is 259 tokens)
CHAT_MODEL = ("model.n_heads=2", "model.n_kv_heads=1", "model.vocab_size=259", "model.max_seq_len=256",
              "data.seq_len=128", "train.micro_batch=8", "train.warmup_steps=5", "log.interval=50",
              "log.eval_interval=1000", "checkpoint.interval_steps=1000")


def chat_records(n: int) -> str:
    return "".join(json.dumps({"messages": [{"role": "user", "content": f"What is {i} + {i}?"},
                                            {"role": "assistant", "content": f"{2 * i}."}]}) + "\n"
                   for i in range(n))


def make_chat_export(base: Path, steps: int = 150) -> Path:
    """A chat-tuned export: byte-tokenized chats (ChatML markers as special tokens), a tiny model trained on
    them, exported. Returns the export directory."""
    root = base / "storage"
    src = base / "chat.jsonl"
    src.write_text(chat_records(60))
    run_cli("data", "prepare", "--root", root, "--name", "chat", "--format", "chat", "--source", src,
            "--tokenizer", "byte", "--val-fraction", "0", check=True)
    run_cli("train", "--config", "llm_tiny", "--root", root,
            *overrides(*CHAT_MODEL, "data.dataset=chat", f"train.steps={steps}", "run.name=chat"), check=True)
    run_cli("export", "--run", "chat", "--root", root, check=True)
    return root / "models" / "chat"
