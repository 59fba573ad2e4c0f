"""Our model keys from a Hugging Face Llama-family config.json: no torch, so the planners read exports too."""

from __future__ import annotations

from llmcluster.errors import UserError


def rope_from_hf(hf: dict) -> tuple[float, dict | None]:
    """(rope_theta, our rope_scaling) from transformers 5's rope_parameters or 4's rope_theta/rope_scaling."""
    rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "default":
        return theta, None
    if kind != "llama3":
        raise UserError(f"config.json: rope_type {kind!r} is not supported (default and llama3 are)")
    return theta, {k: rope[k] for k in ("factor", "low_freq_factor", "high_freq_factor",
                                        "original_max_position_embeddings")}


def model_fields_from_hf(hf: dict) -> dict:
    """Our model-section keys from an HF Llama-family config.json, or a one-line error for what our model
    does not implement (it would load, and compute something else)."""
    kind = hf.get("model_type")
    if kind not in ("llama", "mistral"):
        raise UserError(f"config.json: model_type {kind!r} is not supported (Llama-family: llama, mistral)")
    for key, ok in (("attention_bias", False), ("mlp_bias", False), ("hidden_act", "silu"),
                    ("sliding_window", None)):
        if hf.get(key, ok) != ok:
            raise UserError(f"config.json: {key}={hf[key]!r} is not supported (the model implements {ok!r})")
    if hf.get("head_dim") not in (None, hf["hidden_size"] // hf["num_attention_heads"]):
        raise UserError(f"config.json: head_dim {hf['head_dim']} != hidden_size / num_attention_heads "
                        "is not supported")
    theta, scaling = rope_from_hf(hf)
    return {
        "n_layers": hf["num_hidden_layers"], "d_model": hf["hidden_size"], "n_heads": hf["num_attention_heads"],
        "n_kv_heads": hf.get("num_key_value_heads"), "ffn_hidden": hf["intermediate_size"],
        "vocab_size": hf["vocab_size"], "max_seq_len": hf.get("max_position_embeddings", 2048),
        "rope_theta": theta, "rope_scaling": scaling,
        "norm_eps": hf.get("rms_norm_eps", 1e-5), "tie_embeddings": hf.get("tie_word_embeddings", False),
    }
