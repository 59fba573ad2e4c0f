"""Export a checkpoint to Hugging Face Llama format: config.json + model.safetensors + tokenizer files.

`transformers`' AutoModelForCausalLM / AutoTokenizer load the result with no code of ours. Our parameter
names already follow HF's Llama (see llmcluster/model/llama.py), so the mapping is a prefix: everything but
`lm_head` lives under `model.`.
"""

from __future__ import annotations

import errno
import json
import os
import secrets
import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

from llmcluster.config.hf import model_fields_from_hf
from llmcluster.config.load import validate
from llmcluster.config.schema import JobConfig, ModelConfig
from llmcluster.data.tokenizer import EOT, HF_TOKENIZER_FILES
from llmcluster.errors import DiskFull, UserError, disk_full_line, is_disk_full
from llmcluster.config.cluster_load import storage_root
from llmcluster.export.marker import (EXPORT_FORMAT, EXPORT_MARKER, check_export_request,  # noqa: F401
                                      check_export_target, is_our_export)
from llmcluster.storage.layout import Storage


def hf_config(cfg: ModelConfig, eos_id: int, bos_id: int | None = None) -> dict:
    rope = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling is not None:
        rope = {**cfg.rope_scaling.model_dump(), "rope_theta": cfg.rope_theta}
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
        # transformers < 5 reads rope_theta/rope_scaling; 5.x reads rope_parameters. Write both.
        "rope_theta": cfg.rope_theta,
        "rope_parameters": rope,
        "rope_scaling": rope if cfg.rope_scaling is not None else None,
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "initializer_range": cfg.init_std,
        "tie_word_embeddings": cfg.tie_embeddings,
        "bos_token_id": eos_id if bos_id is None else bos_id,
        "eos_token_id": eos_id,
        "torch_dtype": "float32",
        "dtype": "float32",
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
    return validate(model_fields_from_hf(hf), ModelConfig, "config.json")


def export(root: Path, run: str, step: int | None, out: Path | None = None) -> Path:
    from llmcluster.model.llama import build_model
    from llmcluster.checkpoint.checkpointer import load_model_weights, newest_verified_checkpoint, verify_checkpoint

    st = Storage(root)
    out = check_export_target(root, out or st.model_dir(run))  # before any work
    check_export_request(st, run, step)
    if step is None:  # the one `train --resume auto` would pick
        ckpt = newest_verified_checkpoint(st, run, lambda msg: print(msg, file=sys.stderr))
        if ckpt is None:
            raise UserError(f"run {run!r} has no complete checkpoint under {st.run_checkpoints(run)}")
    else:
        ckpt = st.step_dir(run, step)
        if problem := verify_checkpoint(ckpt):
            raise UserError(f"cannot export {ckpt}: {problem}")
    step, cfg, state = _train_state(ckpt)
    saved_state = state   # train_state.json, for the lineage record (`state` is the weights further down)
    # A QLoRA run's checkpoint holds the adapters alone: its base is train.init_from's, quantized to NF4 as the
    # trainer did (checkpoint/nf4_base.py). The merged weights are that dequantized base + s·B·A, kept in float32
    # as every export is (not bf16): vLLM serves a float32 checkpoint in float32, so it answers greedily as
    # `generate` does, and bf16 would round away the part of s·B·A below the base's bf16 step.
    nf4 = cfg.train.lora is not None and cfg.train.lora.base_precision == "nf4"
    # train_state.json is only as trusted as whoever can write checkpoints/: the model it describes is built
    # on the meta device and every shape checked against the DCP metadata before a byte is allocated.
    shapes = checkpoint_shapes(ckpt)
    _check_layers(cfg.model.n_layers, shapes, ckpt)
    model = build_model(cfg.model, device="meta")
    if cfg.train.lora is not None:
        from llmcluster.model.lora import apply_lora
        apply_lora(model, cfg.train.lora)
    _check_shapes(model, shapes, ckpt, trained_only=nf4)
    model = model.to_empty(device="cpu")
    if cfg.model.tie_embeddings:   # to_empty gives each module its own new tensor
        model.lm_head.weight = model.embed_tokens.weight
    model.init_weights()           # the RoPE buffers (derived, not saved); every parameter is loaded below
    if nf4:
        from llmcluster.checkpoint.nf4_base import restore_base
        restore_base(model, Path(cfg.train.init_from), state, ckpt)
    load_model_weights(ckpt, model, frozen=not nf4)

    from llmcluster.data.dataset import tokenizer_dir

    tok_dir = tokenizer_dir(root, cfg.data)
    tok_src = tok_dir / "tokenizer.json"
    if not tok_src.is_file():
        raise UserError(f"the run's tokenizer is missing: {tok_src}")
    meta = json.loads((tok_dir / "meta.json").read_text())
    eos_id, bos_id = int(meta["eot_id"]), meta.get("bos_id")
    # prepare read it as an object already (it is the dataset's copy of the HF tokenizer's own)
    hf_conf = json.loads((tok_dir / "tokenizer_config.json").read_text()) \
        if (tok_dir / "tokenizer_config.json").is_file() else None
    template, turn_id = chat_template(tok_src, hf_conf, meta)
    # After init_from: the original config.json's fields we do not set (dtype names, token ids, anything a
    # newer transformers added) are kept, and ours - what the weights now are - override the rest.
    base = {}
    if cfg.train.init_from and (Path(cfg.train.init_from) / "config.json").is_file():
        base = json.loads((Path(cfg.train.init_from) / "config.json").read_text())

    tmp = out.parent / f".tmp-{out.name}-{os.getpid()}-{secrets.token_hex(3)}"  # ours alone
    swapping = False
    try:
        tmp.mkdir(parents=True)
        _write(tmp / "config.json", json.dumps({**base, **hf_config(cfg.model, eos_id, bos_id)}, indent=2))
        # No sampling fields: vLLM applies generation_config.json's as the defaults of every request that does
        # not set them, silently replacing the API's. The end of a chat turn stops generation too.
        _write(tmp / "generation_config.json", json.dumps(
            {"bos_token_id": eos_id if bos_id is None else bos_id,
             "eos_token_id": eos_id if turn_id in (None, eos_id) else [eos_id, turn_id]}))
        state = model.state_dict()
        if cfg.train.lora is not None:  # merged weights here; the adapters alone, PEFT-format, in adapter/
            from llmcluster.model.lora import merged_state_dict, save_peft_adapter
            state = merged_state_dict(model)
            if cfg.train.init_from:
                save_peft_adapter(model, cfg.train.lora, tmp / "adapter", str(Path(cfg.train.init_from).resolve()))
        save_file(to_hf_names(state, cfg.model.tie_embeddings), str(tmp / "model.safetensors"),
                  metadata={"format": "pt", "source": f"llmcluster {run} step {step}"})
        _write(tmp / "tokenizer.json", tok_src.read_bytes())
        # safetensors writes its file 0600 whatever the umask; the export's files all get the umask's mode
        shutil.copymode(tmp / "tokenizer.json", tmp / "model.safetensors")
        if hf_conf is not None:  # an HF model's tokenizer: its own files, verbatim (+ the template it was tuned on)
            for name in HF_TOKENIZER_FILES:
                if (tok_dir / name).is_file():
                    _write(tmp / name, (tok_dir / name).read_bytes())
            if template is not None and hf_conf.get("chat_template") != template:
                _write(tmp / "tokenizer_config.json", json.dumps({**hf_conf, "chat_template": template}, indent=2))
        else:
            _write(tmp / "tokenizer_config.json", json.dumps({
                "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": EOT, "eos_token": EOT, "unk_token": None,
                "pad_token": EOT, "model_max_length": cfg.model.max_seq_len, "add_bos_token": False,
                "clean_up_tokenization_spaces": False, **({"chat_template": template} if template else {})},
                indent=2))
            _write(tmp / "special_tokens_map.json", json.dumps(
                {"bos_token": EOT, "eos_token": EOT, "pad_token": EOT}, indent=2))
        _write(tmp / EXPORT_MARKER, json.dumps({"format": EXPORT_FORMAT, "run": run, "step": step,
                                                "checkpoint": str(ckpt)}))
        _write_records(tmp, root, run, ckpt, saved_state, cfg)
        for f in tmp.rglob("*"):
            if f.is_file():
                _fsync(f)
        for d in [*(p for p in tmp.rglob("*") if p.is_dir()), tmp]:
            _fsync(d)
        check_export_target(root, out)   # again: minutes have passed, and someone may have made it meanwhile
        swapping = True                  # from here `tmp` may hold what was at `out`
        _swap_in(tmp, out)
    except Exception as e:   # a full disk: whatever the writer raised (safetensors says it in its own error)
        if not swapping and is_disk_full(e, tmp):
            need = sum(t.numel() * t.element_size() for t in model.state_dict().values())
            intact = f"{ckpt} is untouched" + (f"; the earlier export at {out} is intact" if is_our_export(out)
                                               else "")
            raise DiskFull(disk_full_line(f"the export of step_{step}", out.parent, intact, need)) from None
        if isinstance(e, OSError):
            raise UserError(f"cannot write the export to {out}: {e.strerror or e}") from None
        raise
    finally:
        # our own temporary, or after a swap what `out` held: removed only when that is ours (or empty)
        if not swapping or not tmp.exists() or _replaceable(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def _write_records(tmp: Path, root: Path, run: str, ckpt: Path, saved_state: dict, cfg: JobConfig) -> None:
    """The export's lineage.json (every file above hashed: written last but for the card) and its model card."""
    from llmcluster.data.dataset import data_sources
    from llmcluster.export import card, lineage

    rec = lineage.build(tmp, root, run, ckpt, saved_state, [(n, d) for n, d, _w in data_sources(root, cfg.data)])
    lineage.write(tmp, rec)
    card.write(tmp, root, rec, saved_state)


def chat_template(tok_file: Path, hf_conf: dict | None, meta: dict) -> tuple[str | None, int | None]:
    """(the chat template an export serves with, its end-of-turn token id) for the run's tokenizer.

    The template is the tokenizer's own, else the default (ChatML) when the data was chat or the tokenizer was
    made for chat data (it holds the ChatML markers). The end of turn is the first token the template writes
    after a reply, when that is one special token; a tokenizer made for chat data before the markers were special
    tokens has none: replies would not stop, so it is said."""
    from tokenizers import Tokenizer

    from llmcluster.data.chat import CHAT_MARKERS, DEFAULT_TEMPLATE, ChatRenderer

    tok = Tokenizer.from_file(str(tok_file))
    own = (hf_conf or {}).get("chat_template")
    template = own if isinstance(own, str) else None
    if template is None and (meta.get("format_in") == "chat"
                             or all(tok.token_to_id(m) is not None for m in CHAT_MARKERS)):
        template = DEFAULT_TEMPLATE
    if template is None:
        return None, None
    eos_id, bos_id = int(meta["eot_id"]), meta.get("bos_id")
    try:
        marker = ChatRenderer(template, None if bos_id is None else tok.id_to_token(bos_id),
                              tok.id_to_token(eos_id)).end_of_turn()
    except UserError as e:
        marker = None
        print(f"warning: export: {e}", file=sys.stderr)
    ids = tok.encode(marker, add_special_tokens=False).ids if marker else []
    specials = {i for i, t in tok.get_added_tokens_decoder().items() if t.special}
    if not ids or ids[0] not in specials:
        print(f"warning: export: the chat template's end of turn ({marker!r}) is not one special token of the "
              "tokenizer: chat replies will not stop before max_tokens (prepare the chat data again to make it "
              "one)", file=sys.stderr)
        return template, None
    return template, ids[0]


def _train_state(ckpt: Path) -> tuple[int, JobConfig, dict]:
    from llmcluster.checkpoint.checkpointer import TRAIN_STATE

    where = str(ckpt / TRAIN_STATE)
    try:
        state = json.loads((ckpt / TRAIN_STATE).read_text())
        step = int(state["step"])
        config = state["config"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise UserError(f"cannot export {ckpt}: {TRAIN_STATE} is unreadable ({type(e).__name__}: {e})") from None
    return step, validate(config, JobConfig, where), state


def checkpoint_shapes(ckpt: Path) -> dict[str, tuple[int, ...]]:
    """The model's tensor shapes as the checkpoint's DCP metadata records them (read as data only), refused
    when they add up to more bytes than the checkpoint's files hold (the metadata can be rewritten too)."""
    import math

    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from llmcluster.checkpoint.safe_load import METADATA, UnsafeCheckpoint, read_metadata_file

    try:
        md = read_metadata_file(ckpt / METADATA)
        model = {k.removeprefix("model."): v for k, v in md.state_dict_metadata.items()
                 if k.startswith("model.") and isinstance(v, TensorStorageMetadata)}
        shapes = {k: tuple(int(x) for x in v.size) for k, v in model.items()}
        need = sum(math.prod(shapes[k]) * v.properties.dtype.itemsize for k, v in model.items())
        files = {info.relative_path for info in (md.storage_data or {}).values()}
        have = sum((ckpt / f).stat().st_size for f in files if (ckpt / f).is_file())
    except (UnsafeCheckpoint, AttributeError, TypeError, ValueError, OSError) as e:
        raise UserError(f"refusing checkpoint {ckpt}: {e}") from None
    if need > have:
        raise UserError(f"refusing checkpoint {ckpt}: its {METADATA} describes a {need:,}-byte model, its files "
                        f"hold {have:,} bytes")
    return shapes


def _check_layers(n_layers: int, shapes: dict, ckpt: Path) -> None:
    """The one size that multiplies modules, not bytes: checked before even the meta model is built."""
    have = {k.split(".")[1] for k in shapes if k.startswith("layers.")}
    if n_layers != len(have):
        raise UserError(f"cannot export {ckpt}: train_state.json says {n_layers} layers, its checkpoint holds "
                        f"{len(have)}")


def _check_shapes(model, shapes: dict, ckpt: Path, trained_only: bool = False) -> None:
    """`trained_only`: the checkpoint holds the trained parameters alone (an NF4 run's: its base is not saved)."""
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    for name, t in model.state_dict().items():   # persistent entries: what the checkpoint holds
        if trained_only and name not in trained:
            continue
        want = tuple(t.shape)
        if shapes.get(name) != want:
            got = "missing" if name not in shapes else list(shapes[name])
            raise UserError(f"cannot export {ckpt}: train_state.json's model does not match its checkpoint: "
                            f"{name} is {list(want)} there, {got} in {ckpt.name}/.metadata")


def _write(path: Path, data: str | bytes) -> None:
    with open(path, "wb") as f:
        f.write(data.encode() if isinstance(data, str) else data)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _replaceable(d: Path) -> bool:
    """What an export may be swapped over: an empty directory or an earlier export of ours."""
    return d.is_dir() and not d.is_symlink() and (is_our_export(d) or not any(d.iterdir()))


def _swap_in(tmp: Path, out: Path) -> None:
    """Put the finished `tmp` at `out` atomically; an earlier export at `out` ends up at `tmp` (then removed).
    Linux renameat2(RENAME_EXCHANGE) swaps in one step; elsewhere two renames (a moment without `out`).
    Only a missing, empty or own-marked `out` is replaced: whatever was swapped out is looked at before it is
    given up, and anything else (made between the last check and the swap) is put back and refused."""
    refused = UserError(f"export --out {out}: changed while exporting (now neither empty nor an earlier "
                        f"llmcluster export): left as it is; the export was not written")
    if not out.exists() and not out.is_symlink():
        try:
            os.rename(tmp, out)              # onto an empty directory made meanwhile: fine; anything else fails
        except OSError as e:
            if e.errno in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR, errno.EISDIR):
                raise refused from None
            raise
    elif _rename_exchange(tmp, out):
        if not _replaceable(tmp):            # what came out is not ours to drop: put it back
            if not _rename_exchange(tmp, out):
                raise UserError(f"export --out {out}: changed while exporting and could not be put back: "
                                f"what it held is at {tmp}")
            raise refused
    else:
        old = out.parent / f"{tmp.name}.old"
        os.rename(out, old)
        if not _replaceable(old):
            os.rename(old, out)
            raise refused
        os.rename(tmp, out)
        os.rename(old, tmp)
    _fsync(out.parent)


def _rename_exchange(a: Path, b: Path) -> bool:
    try:
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    return renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0


def export_cli(run: str, root: str | None = None, step: int | None = None, out: str | None = None) -> int:
    """`llmcluster export`: the checkpoint of `run` (newest verified, or `step`) -> Hugging Face format."""
    from llmcluster.storage.layout import check_run_name

    check_run_name(run)
    dest = export(storage_root(root), run, step, Path(out) if out else None)
    size = sum(f.stat().st_size for f in dest.iterdir())
    print(f"exported {run} to {dest} ({size / 1e6:.1f} MB, Hugging Face Llama format)")
    return 0
