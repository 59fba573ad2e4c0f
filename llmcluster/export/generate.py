"""Sample text from an exported model (the Hugging Face-format directory export writes)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

from llmcluster.errors import UserError


def load_exported(path: Path):
    from llmcluster.data.tokenizer import load_tokenizer
    from llmcluster.export.hf import config_from_hf
    from llmcluster.model.llama import build_model

    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise UserError(f"no exported model at {path} (run `llmcluster export --run NAME` first)")
    try:
        cfg = config_from_hf(json.loads(cfg_file.read_text()))
    except (ValueError, KeyError) as e:
        raise UserError(f"{cfg_file}: not a Llama config ({e})") from None
    model = build_model(cfg, device="meta").to_empty(device="cpu")
    model.init_weights()  # buffers (RoPE tables); every parameter is overwritten below
    state = {k.removeprefix("model."): v for k, v in load_file(str(path / "model.safetensors")).items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [m for m in missing if not (cfg.tie_embeddings and m == "lm_head.weight")]
    if missing or unexpected:
        raise UserError(f"{path}: weights do not match config.json (missing {missing[:3]}, "
                        f"unexpected {unexpected[:3]})")
    return model.eval(), load_tokenizer(path), cfg  # a DocTokenizer: .tok encodes, .eos_id ends


def pick(logits: torch.Tensor, temperature: float, top_k: int, generator: torch.Generator) -> int:
    if temperature <= 0:
        return int(logits.argmax())
    logits = logits / temperature
    if top_k > 0:
        kth = torch.topk(logits, min(top_k, logits.numel())).values[-1]
        logits[logits < kth] = -float("inf")
    return int(torch.multinomial(torch.softmax(logits, -1), 1, generator=generator))


@torch.no_grad()
def sample(model, prompt_ids: list[int], max_new_tokens: int, temperature: float, top_k: int,
           max_len: int, eot: int | None, generator: torch.Generator, cache: bool = True) -> list[int]:
    """New tokens after the prompt, until `eot`, `max_new_tokens`, or prompt + new = `max_len` (the model's
    context: RoPE has no positions beyond it). With `cache`, each step feeds only the tokens the KV cache has
    not seen (the whole prompt once, then one token); without, the whole sequence every step. Same tokens."""
    from llmcluster.model.llama import KVCache

    ids = list(prompt_ids) or [eot or 0]
    if len(ids) > max_len:
        raise UserError(f"the prompt is {len(ids)} tokens: more than the model's max_seq_len ({max_len})")
    kv = KVCache(model, 1, max_len) if cache else None
    start = len(ids) if prompt_ids else 1
    for _ in range(max_new_tokens):
        if len(ids) >= max_len:
            break
        logits = model(torch.tensor([ids[kv.pos:] if kv is not None else ids]), cache=kv)
        nxt = pick(logits[0, -1].float(), temperature, top_k, generator)
        if eot is not None and nxt == eot:
            break
        ids.append(nxt)
    return ids[start:]


def generate_cli(model: str, prompt: str = "", max_new_tokens: int = 200, temperature: float = 0.8,
                 top_k: int = 50, seed: int = 0, root: str | None = None, cache: bool = True) -> int:
    """`llmcluster generate`: sample from an exported model (a run name under models/, or a directory)."""
    from llmcluster.export.marker import exported_model_dir

    path = exported_model_dir(model, root)
    if max_new_tokens < 1:
        raise UserError("--max-new-tokens must be at least 1")
    net, tok, cfg = load_exported(path)
    gen = torch.Generator().manual_seed(seed)
    prompt_ids = tok.tok.encode(prompt, add_special_tokens=False).ids if prompt else []
    if tok.bos_id is not None:
        prompt_ids = [tok.bos_id] + prompt_ids
    out = sample(net, prompt_ids, max_new_tokens, temperature, top_k, cfg.max_seq_len, tok.eos_id, gen, cache)
    if len(out) < max_new_tokens and len(prompt_ids or [0]) + len(out) >= cfg.max_seq_len:
        sys.stderr.write(f"note: stopped after {len(out)} new tokens at the model's max_seq_len "
                         f"({cfg.max_seq_len} tokens with the prompt)\n")
    print(prompt + tok.tok.decode(out, skip_special_tokens=True))
    return 0
