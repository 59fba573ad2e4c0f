"""Exports that serve as they are: the chat template and its end-of-turn token (one special id, among
generation_config.json's eos ids), and no sampling defaults for a server to apply to every request."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from chat_helpers import CHAT_MODEL, make_chat_export
from conftest import overrides, run_cli

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]


@pytest.fixture(scope="module")
def chat_export(tmp_path_factory) -> Path:
    return make_chat_export(tmp_path_factory.mktemp("chatexport"))


def test_export_holds_template_turn_end_among_eos_and_no_sampling(chat_export):
    conf = json.loads((chat_export / "tokenizer_config.json").read_text())
    gen = json.loads((chat_export / "generation_config.json").read_text())
    tok = json.loads((chat_export / "tokenizer.json").read_text())
    added = {t["content"]: t for t in tok["added_tokens"]}
    assert "<|im_start|>" in conf["chat_template"] and "<|im_end|>" in conf["chat_template"]
    assert added["<|im_end|>"]["special"] and added["<|im_start|>"]["special"]
    assert gen["eos_token_id"] == [added["<|endoftext|>"]["id"], added["<|im_end|>"]["id"]]
    assert not {"do_sample", "temperature", "top_k", "top_p"} & gen.keys()


def test_transformers_applies_the_chat_template(chat_export):
    transformers = pytest.importorskip("transformers")
    tok = transformers.AutoTokenizer.from_pretrained(chat_export)
    text = tok.apply_chat_template([{"role": "user", "content": "What is 7 + 7?"}], tokenize=False,
                                   add_generation_prompt=True)
    assert text == "<|im_start|>user\nWhat is 7 + 7?<|im_end|>\n<|im_start|>assistant\n"
    end = tok.encode("<|im_end|>", add_special_tokens=False)
    gen = json.loads((chat_export / "generation_config.json").read_text())
    assert len(end) == 1 and end[0] in gen["eos_token_id"]
    ids = tok.apply_chat_template([{"role": "user", "content": "What is 7 + 7?"}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)
    assert tok.decode(ids["input_ids"][0], skip_special_tokens=False) == text   # the round trip
    # the model learnt to end its turn: greedy decoding under the export's own generation config stops there
    model = transformers.AutoModelForCausalLM.from_pretrained(chat_export)
    out = model.generate(**ids, max_new_tokens=20, do_sample=False)[0, ids["input_ids"].shape[1]:].tolist()
    assert out[-1] == end[0] and len(out) < 20, tok.decode(out, skip_special_tokens=False)


def test_text_export_has_no_template_and_one_eos(tiny_root):
    """A pretraining run's export (no chat data): no template, the document end as its only eos."""
    run_cli("train", "--config", "llm_tiny", "--root", tiny_root,
            *overrides(*CHAT_MODEL, "train.steps=1", "run.name=textexp"), check=True)
    run_cli("export", "--run", "textexp", "--root", tiny_root, check=True)
    out = tiny_root / "models" / "textexp"
    assert "chat_template" not in json.loads((out / "tokenizer_config.json").read_text())
    gen = json.loads((out / "generation_config.json").read_text())
    assert gen["eos_token_id"] == 256 and "temperature" not in gen


def test_old_chat_tokenizer_exports_with_a_warning(tmp_path):
    """A chat dataset prepared before the markers were special tokens: the template is still exported, no end
    of turn id is invented, and the export says replies will not stop."""
    from llmcluster.data.chat import DEFAULT_TEMPLATE
    from llmcluster.data.tokenizer import byte_tokenizer
    from llmcluster.export.hf import chat_template

    f = tmp_path / "tokenizer.json"
    byte_tokenizer().save(str(f))
    template, turn = chat_template(f, None, {"eot_id": 256, "bos_id": None, "format_in": "chat"})
    assert template == DEFAULT_TEMPLATE and turn is None


def test_engine_warnings_before_launch(tmp_path, chat_export):
    """What vLLM's CPU engine accepts at start and fails (or silently changes) on the first request is said
    before launch: a head dim its kernel lacks, sampling defaults in generation_config.json, no chat template."""
    from llmcluster.serve.engine_check import engine_warnings
    from llmcluster.plan.served_model import from_directory

    assert engine_warnings(from_directory(chat_export), cpu=True) == []   # head dim 32, greedy, a template
    old = tmp_path / "old"
    old.mkdir()
    conf = json.loads((chat_export / "config.json").read_text())
    (old / "config.json").write_text(json.dumps({**conf, "num_attention_heads": 4, "head_dim": 16}))
    (old / "generation_config.json").write_text(json.dumps({"eos_token_id": 256, "do_sample": True,
                                                           "temperature": 0.8, "top_k": 50}))
    (old / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    lines = engine_warnings(from_directory(old), cpu=True)
    assert len(lines) == 3
    assert "head dim 16" in lines[0] and "first request" in lines[0]
    assert "temperature=0.8" in lines[1] and "do_sample=True" in lines[1]
    assert "chat template" in lines[2]
    assert len(engine_warnings(from_directory(old), cpu=False)) == 2   # a GPU's kernels take 16
