"""Export a checkpoint to Hugging Face Llama format: config.json + model.safetensors + tokenizer files.

`transformers`' AutoModelForCausalLM / AutoTokenizer load the result with no code of ours. Our parameter
names already follow HF's Llama (see llmcluster/model/llama.py), so the mapping is a prefix: everything but
`lm_head` lives under `model.`.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

from llmcluster.config.load import validate
from llmcluster.config.schema import JobConfig, ModelConfig
from llmcluster.data.tokenizer import EOT
from llmcluster.errors import UserError
from llmcluster.paths import resolve_storage_root
from llmcluster.storage.layout import Storage


def hf_config(cfg: ModelConfig, eot_id: int) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.ffn_hidden,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.kv_heads,
        "head_dim": cfg.head_dim,
        "vocab_size": cfg.vocab_size,
        "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm_eps,
        # transformers < 5 reads rope_theta; 5.x reads rope_parameters. Write both.
        "rope_theta": cfg.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "rope_scaling": None,
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "initializer_range": cfg.init_std,
        "tie_word_embeddings": cfg.tie_embeddings,
        "bos_token_id": eot_id,
        "eos_token_id": eot_id,
        "torch_dtype": "float32",
        "use_cache": True,
    }


def to_hf_names(state: dict[str, torch.Tensor], tied: bool) -> dict[str, torch.Tensor]:
    out = {}
    for k, v in state.items():
        if k.startswith("lm_head."):
            if tied:
                continue  # HF re-ties lm_head to embed_tokens from tie_word_embeddings
            out[k] = v
        else:
            out["model." + k] = v
    # safetensors refuses shared/non-contiguous storage: give every tensor its own.
    return {k: v.detach().to("cpu").contiguous().clone() for k, v in out.items()}


def config_from_hf(hf: dict) -> ModelConfig:
    """Our ModelConfig from an HF Llama config.json (ours or anyone's with the same architecture)."""
    rope = hf.get("rope_parameters") or {}
    data = {
        "n_layers": hf["num_hidden_layers"], "d_model": hf["hidden_size"], "n_heads": hf["num_attention_heads"],
        "n_kv_heads": hf.get("num_key_value_heads"), "ffn_hidden": hf["intermediate_size"],
        "vocab_size": hf["vocab_size"], "max_seq_len": hf.get("max_position_embeddings", 2048),
        "rope_theta": rope.get("rope_theta", hf.get("rope_theta", 10000.0)),
        "norm_eps": hf.get("rms_norm_eps", 1e-5), "tie_embeddings": hf.get("tie_word_embeddings", False),
    }
    return validate(data, ModelConfig, "config.json")


def export(root: Path, run: str, step: int | None, out: Path | None = None) -> Path:
    from llmcluster.model.llama import build_model
    from llmcluster.train.checkpoint import (TRAIN_STATE, load_model_weights, newest_verified_checkpoint,
                                             verify_checkpoint)

    st = Storage(root)
    if step is None:  # the one `train --resume auto` would pick
        ckpt = newest_verified_checkpoint(st, run, lambda msg: print(msg, file=sys.stderr))
        if ckpt is None:
            raise UserError(f"run {run!r} has no complete checkpoint under {st.run_checkpoints(run)}")
    else:
        ckpt = st.step_dir(run, step)
        problem = verify_checkpoint(ckpt) if ckpt.is_dir() else "no such checkpoint"
        if problem:
            raise UserError(f"cannot export {ckpt}: {problem}")
    state = json.loads((ckpt / TRAIN_STATE).read_text())
    step = int(state["step"])
    cfg = validate(state["config"], JobConfig, str(ckpt / TRAIN_STATE))
    model = build_model(cfg.model, device="cpu")
    load_model_weights(ckpt, model)

    from llmcluster.data.dataset import resolve_dataset_dir

    tok_src = resolve_dataset_dir(root, cfg.data.dataset, cfg.data.kind) / "tokenizer.json"
    if not tok_src.is_file():
        raise UserError(f"the run's tokenizer is missing: {tok_src}")
    from tokenizers import Tokenizer

    eot_id = Tokenizer.from_file(str(tok_src)).token_to_id(EOT)

    out = out or st.model_dir(run)
    tmp = out.parent / f".tmp-{out.name}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    (tmp / "config.json").write_text(json.dumps(hf_config(cfg.model, eot_id), indent=2))
    (tmp / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": eot_id, "eos_token_id": eot_id, "do_sample": True, "temperature": 0.8, "top_k": 50}))
    save_file(to_hf_names(model.state_dict(), cfg.model.tie_embeddings), str(tmp / "model.safetensors"),
              metadata={"format": "pt", "source": f"llmcluster {run} step {step}"})
    shutil.copy(tok_src, tmp / "tokenizer.json")
    (tmp / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": EOT, "eos_token": EOT, "unk_token": None,
        "pad_token": EOT, "model_max_length": cfg.model.max_seq_len, "add_bos_token": False,
        "clean_up_tokenization_spaces": False}, indent=2))
    (tmp / "special_tokens_map.json").write_text(json.dumps(
        {"bos_token": EOT, "eos_token": EOT, "pad_token": EOT}, indent=2))
    (tmp / "llmcluster.json").write_text(json.dumps({"run": run, "step": step, "checkpoint": str(ckpt)}))
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    return out


def export_cli(args) -> int:
    from llmcluster.storage.layout import check_run_name

    check_run_name(args.run)
    root = resolve_storage_root(args.root)
    out = export(root, args.run, args.step, Path(args.out) if args.out else None)
    size = sum(f.stat().st_size for f in out.iterdir())
    print(f"exported {args.run} to {out} ({size / 1e6:.1f} MB, Hugging Face Llama format)")
    return 0
