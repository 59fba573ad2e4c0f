"""Sample text from an exported model (the Hugging Face-format directory export writes)."""

from __future__ import annotations

import json
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


@torch.no_grad()
def sample(model, prompt_ids: list[int], max_new_tokens: int, temperature: float, top_k: int,
           max_len: int, eot: int | None, generator: torch.Generator) -> list[int]:
    ids = torch.tensor([prompt_ids or [eot or 0]], dtype=torch.long)
    for _ in range(max_new_tokens):
        logits = model(ids[:, -max_len:])[0, -1].float()
        if temperature <= 0:
            nxt = int(logits.argmax())
        else:
            logits = logits / temperature
            if top_k > 0:
                kth = torch.topk(logits, min(top_k, logits.numel())).values[-1]
                logits[logits < kth] = -float("inf")
            nxt = int(torch.multinomial(torch.softmax(logits, -1), 1, generator=generator))
        if eot is not None and nxt == eot:
            break
        ids = torch.cat([ids, torch.tensor([[nxt]])], dim=1)
    return ids[0, (len(prompt_ids) if prompt_ids else 1):].tolist()


def generate_cli(model: str, prompt: str = "", max_new_tokens: int = 200, temperature: float = 0.8,
                 top_k: int = 50, seed: int = 0, root: str | None = None) -> int:
    """`llmcluster generate`: sample from an exported model (a run name under models/, or a directory)."""
    from llmcluster.paths import resolve_storage_root
    from llmcluster.storage.layout import Storage, check_run_name

    path = Path(model)
    if not (path / "config.json").is_file():
        if "/" in model:
            raise UserError(f"no exported model at {path}")
        path = Storage(resolve_storage_root(root)).model_dir(check_run_name(model))
    if max_new_tokens < 1:
        raise UserError("--max-new-tokens must be at least 1")
    net, tok, cfg = load_exported(path)
    gen = torch.Generator().manual_seed(seed)
    prompt_ids = tok.tok.encode(prompt, add_special_tokens=False).ids if prompt else []
    if tok.bos_id is not None:
        prompt_ids = [tok.bos_id] + prompt_ids
    out = sample(net, prompt_ids, max_new_tokens, temperature, top_k, cfg.max_seq_len, tok.eos_id, gen)
    print(prompt + tok.tok.decode(out, skip_special_tokens=True))
    return 0
