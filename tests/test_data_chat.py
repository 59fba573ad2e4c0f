"""Chat/SFT data: conversations rendered by the tokenizer's template (or the default), only assistant tokens
trained; the masks survive slicing + merge and reach the trainer as ignored targets."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from conftest import assert_one_line_error, cli_inprocess, overrides, read_metrics, run_cli
from hf_helpers import make_hf_tokenizer

pytestmark = pytest.mark.timeout(600)


def _chats(n: int) -> list[dict]:
    return [{"messages": [{"role": "system", "content": "Be brief."},
                          {"role": "user", "content": f"What is {i} + {i}?"},
                          {"role": "assistant", "content": f"{2 * i}."},
                          {"role": "user", "content": "And squared?"},
                          {"role": "assistant", "content": f"{(2 * i) ** 2}, number {i}."}]} for i in range(n)]


def _write(tmp: Path, n: int) -> Path:
    p = tmp / "chat.jsonl"
    p.write_text("".join(json.dumps(c) + "\n" for c in _chats(n)))
    return p


def _read(root: Path, name: str, what: str, dtype) -> np.ndarray:
    d = root / "datasets" / "code" / name
    meta = json.loads((d / "meta.json").read_text())
    return np.concatenate([np.fromfile(d / s["file"], dtype=dtype) for s in meta[what]["train"]])


def test_default_template_trains_assistant_replies_only(capsys, tmp_path):
    root = tmp_path / "s"
    proc = cli_inprocess(capsys, "data", "prepare", "--root", root, "--name", "chat", "--format", "chat",
                         "--source", _write(tmp_path, 3), "--tokenizer", "byte", "--val-fraction", "0")
    assert proc.returncode == 0, proc.stderr
    tokens = _read(root, "chat", "shards", "<u2")
    mask = _read(root, "chat", "masks", "u1")
    assert len(tokens) == len(mask)
    from llmcluster.data.chat import CHAT_MARKERS
    from llmcluster.data.tokenizer import byte_tokenizer

    tok = byte_tokenizer(CHAT_MARKERS)
    eot, im_end = tok.token_to_id("<|endoftext|>"), tok.token_to_id("<|im_end|>")
    # the end of a turn is one special token (a server stops on it), trained after each of the 6 replies
    assert im_end == 258 and (tokens == im_end).sum() == 5 * 3 and mask[tokens == im_end].sum() == 2 * 3
    trained = tok.decode([int(t) for t, m in zip(tokens, mask) if m and t != eot], skip_special_tokens=False)
    assert trained == "".join(f"{2 * i}.<|im_end|>\n{(2 * i) ** 2}, number {i}.<|im_end|>\n" for i in range(3))
    whole = tok.decode([int(t) for t in tokens if t != eot], skip_special_tokens=False)
    assert whole.startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 0 + 0?")
    assert mask[tokens == eot].tolist() == [1, 1, 1]  # the end of a conversation that ends on a reply


def test_hf_chat_template_and_masks_through_slices(capsys, tmp_path):
    tok_dir = make_hf_tokenizer(tmp_path / "tok")
    conf = json.loads((tok_dir / "tokenizer_config.json").read_text())
    conf["chat_template"] = ("{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}"
                             "{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}\n{% endfor %}"
                             "{% if add_generation_prompt %}[assistant] {% endif %}")
    (tok_dir / "tokenizer_config.json").write_text(json.dumps(conf))
    srcs = []
    for i in range(2):
        p = tmp_path / f"c{i}.jsonl"
        p.write_text("".join(json.dumps(c) + "\n" for c in _chats(6)[3 * i: 3 * i + 3]))
        srcs.append(p)
    one, many = tmp_path / "one", tmp_path / "many"
    args = ["--name", "hfchat", "--format", "chat", "--source", *srcs, "--tokenizer", tok_dir, "--val-fraction", "0"]
    assert cli_inprocess(capsys, "data", "prepare", "--root", one, *args).returncode == 0
    for i in range(2):
        assert cli_inprocess(capsys, "data", "prepare", "--root", many, *args, "--shard", f"{i}/2",
                             "--workers", "2").returncode == 0
    assert cli_inprocess(capsys, "data", "merge", "--root", many, "--name", "hfchat").returncode == 0
    a, b = (json.loads((r / "datasets/code/hfchat/meta.json").read_text()) for r in (one, many))
    assert a["shards"] == b["shards"] and a["masks"] == b["masks"]
    tokens, mask = _read(one, "hfchat", "shards", "<u2"), _read(one, "hfchat", "masks", "u1")
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    assert tokens[0] == 0 and (tokens == 0).sum() == 6  # the template's own <s>, not a second one
    trained = tok.decode([int(t) for t, m in zip(tokens, mask) if m], skip_special_tokens=False)
    assert "[assistant]" not in trained and "[user]" not in trained and "What is" not in trained
    # the template's </s> after each of the 12 replies, and each conversation's document-ending </s>
    assert trained.count("</s>") == 12 + 6 and "64, number 4." in trained


def test_sampler_ignores_untrained_targets_and_training_runs(capsys, tmp_path):
    root = tmp_path / "s"
    run_cli("data", "prepare", "--root", root, "--name", "chat", "--format", "chat", "--source",
            _write(tmp_path, 40), "--tokenizer", "byte", "--val-fraction", "0.1", check=True)
    from llmcluster.data.dataset import Sampler, open_dataset

    ds = open_dataset(root, "chat", "code")
    # Every window of the epoch in one batch: which windows come first depends on the shuffle, and a few
    # of them can all fall inside prompts.
    sampler = Sampler(ds, 32, 0)
    n = sampler.index.total
    _, x, y = next(sampler.micro_batches(n, 0, 1, n))
    assert (y == -100).any() and (y != -100).any()
    assert (y[:, :-1][y[:, :-1] != -100] == x[:, 1:][y[:, :-1] != -100]).all()  # kept targets = next tokens
    run_cli("train", "--config", "llm_tiny", "--root", root,
            *overrides("data.dataset=chat", "model.vocab_size=259", "train.steps=6", "run.name=sft",
                       "log.eval_interval=6"), check=True)
    rows = read_metrics(root, "sft")
    assert len(rows) == 6 and all(np.isfinite(r["loss"]) for r in rows) and "val_loss" in rows[-1]
    state = json.loads((root / "checkpoints" / "sft" / "step_6" / "train_state.json").read_text())
    assert state["config"]["model"]["doc_mask_id"] == ds.meta["eot_id"]  # packed chats kept apart


def test_document_mask_keeps_packed_documents_apart():
    import torch

    from llmcluster.config.schema import ModelConfig
    from llmcluster.model.llama import build_model

    cfg = ModelConfig(n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, ffn_hidden=128, vocab_size=50,
                      max_seq_len=64)
    plain = build_model(cfg, seed=0).eval()
    masked = build_model(cfg.model_copy(update={"doc_mask_id": 0}), seed=0).eval()
    a, b = torch.randint(1, 50, (1, 9)), torch.randint(1, 50, (1, 12))
    packed = torch.cat([a, torch.zeros(1, 1, dtype=torch.long), b], dim=1)
    with torch.no_grad():
        alone, inside, crossing = plain(b), masked(packed)[:, 10:], plain(packed)[:, 10:]
        assert (inside - alone).abs().max() < 1e-4  # RoPE is relative: the offset does not matter
        assert (crossing - alone).abs().max() > 1e-3  # without the mask, b attends to a
        assert torch.equal(masked(a), plain(a))  # no boundary: plain causal attention


def test_bad_messages_are_one_line(capsys, tmp_path):
    p = tmp_path / "bad.jsonl"
    p.write_text(json.dumps({"messages": [{"role": "wizard", "content": "hi"}]}) + "\n")
    assert_one_line_error(cli_inprocess(capsys, "data", "prepare", "--root", tmp_path / "s", "--format", "chat",
                                        "--source", p, "--tokenizer", "byte"), "bad.jsonl#0", "role")


def test_sft_under_tensor_parallelism_matches_one_process(tmp_path):
    """The document mask reaches attention by keyword, past TP's input preparation: 2 TP ranks = 1 process."""
    from conftest import torchrun

    root = tmp_path / "s"
    run_cli("data", "prepare", "--root", root, "--name", "chat", "--format", "chat", "--source",
            _write(tmp_path, 40), "--tokenizer", "byte", "--val-fraction", "0.1", check=True)
    common = ("data.dataset=chat", "model.vocab_size=259", "train.steps=4", "log.eval_interval=4",
              "parallel.dp_shard=1")
    run_cli("train", "--config", "llm_tiny", "--root", root, *overrides(*common, "run.name=one"), check=True)
    proc = torchrun(2, "train", "--config", "llm_tiny", "--root", root,
                    *overrides(*common, "run.name=tp", "parallel.tp=2", "parallel.dp_replicate=1"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    one, tp = ({r["step"]: r["loss"] for r in read_metrics(root, run)} for run in ("one", "tp"))
    assert sorted(one) == sorted(tp) == [1, 2, 3, 4]
    for step in one:
        assert abs(one[step] - tp[step]) < 1e-4, (step, one[step], tp[step])
