"""A run's fingerprint: what its checkpoints' tensors are (model shape, vocabulary, tokenizer, optimizer), saved
in every checkpoint's train_state.json and compared once before any weight is loaded (issue 53). A checkpoint of
another shape is refused in one line naming each field and both values, instead of torch's size-mismatch traceback.

The layout (data parallel, FSDP, TP, pipeline stages, ft replica groups) is recorded too but never refused: DCP
reshards it (tests/test_train_resume_world.py, tests/test_pipeline.py resume a PP run on one rank and as FSDP).
A checkpoint written before fingerprints existed has none: the config saved in its train state gives the model's
shape, compared the same way; one that matches loads as before.

`preflight` runs the checks that the config and the storage decide in the CLI process, before torchrun or torch
start (pure Python: no torch here)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from llmcluster.errors import UserError

FINGERPRINT = "fingerprint"   # its key in train_state.json
# The config key a field comes from (for the refusal's line); a field added later without an entry is named as is.
KEYS = {"n_layers": "model.n_layers", "d_model": "model.d_model", "n_heads": "model.n_heads",
        "n_kv_heads": "model.n_kv_heads", "ffn_hidden": "model.ffn_hidden", "vocab_size": "model.vocab_size",
        "tie_embeddings": "model.tie_embeddings", "tokenizer": "tokenizer.json sha256", "optimizer": "optimizer",
        "lora": "train.lora", "base_weights": "train.init_from's weights sha256",
        "base_index": "train.init_from's model.safetensors.index.json sha256", "pipeline_stages": "pipeline stages", "ft_groups": "ft replica groups"}
MODEL = ("n_layers", "d_model", "n_heads", "n_kv_heads", "ffn_hidden", "vocab_size", "tie_embeddings")
LAYOUT = ("pipeline_stages", "ft_groups")
BASE_INDEX = "model.safetensors.index.json"   # a sharded HF base's map from weight to file   # recorded, resharded by DCP: never refused


def run_fingerprint(cfg, tokenizer: str | None = None, **more) -> dict:
    """The fingerprint of a (resolved) job config; `tokenizer`: its tokenizer.json's sha256 (prefix); `more`:
    further fields (an open dict: every field but the layout's is compared)."""
    m, p, lora = cfg.model, cfg.parallel, cfg.train.lora
    fp = {"n_layers": m.n_layers, "d_model": m.d_model, "n_heads": m.n_heads, "n_kv_heads": m.n_kv_heads or m.n_heads,
          "ffn_hidden": m.ffn_hidden, "vocab_size": m.vocab_size, "tie_embeddings": m.tie_embeddings,
          "optimizer": cfg.train.optimizer, "lora": _lora(lora),
          "pipeline_stages": p.pp * (p.pp_virtual_stages or (2 if p.pp_schedule == "interleaved_1F1B" else 1)),
          "ft_groups": p.dp_replicate if cfg.ft.enabled else 0}
    if tokenizer:
        fp["tokenizer"] = tokenizer
    if lora is not None and lora.base_precision == "nf4" and cfg.train.init_from:
        fp["base_weights"] = base_weights_sha256(Path(cfg.train.init_from))
        # which file each weight is read from; a checkpoint without this field (older) is not compared on it
        fp["base_index"] = base_index_sha256(Path(cfg.train.init_from))
    return {**fp, **more}


def base_weights_sha256(path: Path) -> str:
    """sha256 over the safetensors files of an HF model directory, in name order (16 hex digits): an NF4 run's
    checkpoint leaves the base out and a resume quantizes these files again, so they must be the same ones."""
    from llmcluster.storage.layout import sha256_file

    return weights_digest({f.name: sha256_file(f) for f in path.glob("*.safetensors")})


def weights_digest(files: dict[str, str]) -> str:
    """base_weights_sha256 from the digests of a directory's files (name -> sha256; only *.safetensors count): the
    lineage record (export/lineage.py) checks its base against an NF4 run's fingerprint without hashing again."""
    import hashlib

    pairs = sorted((n, d) for n, d in files.items() if n.endswith(".safetensors") and "/" not in n)
    return hashlib.sha256(" ".join(f"{n}:{d}" for n, d in pairs).encode()).hexdigest()[:16]


def dataset_digest(meta_digests: list[str]) -> str:
    """What a run trains on, saved in its train state: its dataset's meta.json sha256, or for a mixture the sha256
    of every source's, in order (a resume over a rebuilt dataset is refused by it; the lineage checks it too)."""
    import hashlib

    return meta_digests[0] if len(meta_digests) == 1 else hashlib.sha256(" ".join(meta_digests).encode()).hexdigest()


def base_index_sha256(path: Path) -> str:
    """sha256 of the base's model.safetensors.index.json (16 hex digits), "none" without one: the index says which
    of the hashed files each weight comes from, so a remapped index is another base."""
    from llmcluster.storage.layout import sha256_file

    index = path / BASE_INDEX
    return sha256_file(index)[:16] if index.is_file() else "none"


def _lora(lora) -> str | None:
    """train.lora as the fingerprint names it; the base's precision when not fp32 (a resume that changes it, or
    the optimizer kind, is refused: the saved adapters and states were trained against that base)."""
    if lora is None:
        return None
    base = "" if lora.base_precision == "fp32" else f", base {lora.base_precision}"
    return f"rank {lora.rank} on {'+'.join(lora.targets)}{base}"


def _differences(saved: dict, now: dict, fields) -> list[str]:
    return [f"{KEYS.get(k, k)} {saved[k]} -> {now[k]}" for k in fields if k in saved and k in now and saved[k] != now[k]]


def check_fingerprint(path: Path, state: dict, now: dict, run: str) -> str | None:
    """Before any weight is loaded: a checkpoint of another model is refused (one line, exit 2). Returns a note
    when only the layout changed (DCP reshards it), else None."""
    saved = state.get(FINGERPRINT)
    if not isinstance(saved, dict):   # written before fingerprints: its saved config still gives the model's shape
        saved = _shape_of_saved_config(state.get("config"))
    diff = _differences(saved, now, [k for k in now if k not in LAYOUT])
    if diff:
        raise UserError(f"run {run}: checkpoint {path} is of another model than the config asks for "
                        f"({'; '.join(diff)}; checkpoint -> config): train the new model under another run.name, "
                        "or set the config back to the checkpoint's")
    layout = _differences(saved, now, LAYOUT)
    return f"resharding {path}: {'; '.join(layout)}" if layout else None


def _shape_of_saved_config(config) -> dict:
    """The model fields of a checkpoint's saved config (every train_state.json has one: the resolved config)."""
    model = config.get("model") if isinstance(config, dict) else None
    if not isinstance(model, dict):
        return {}
    shape = {k: model[k] for k in MODEL if k in model}
    if "n_heads" in model and model.get("n_kv_heads") is None:
        shape["n_kv_heads"] = model["n_heads"]
    return shape


def checked_state(path: Path, now: dict, storage, run: str) -> tuple[dict, list[str]]:
    """The train state of the checkpoint a run starts from, once its fingerprint passed (`check_fingerprint`), and
    the lines to say: a start from another run's checkpoint (--init-from-checkpoint), a resharded layout."""
    state = json.loads((path / "train_state.json").read_text())
    notes = [] if is_own_checkpoint(storage, run, path) else [
        f"run {run}: starting from another run's checkpoint {path} (--init-from-checkpoint): its weights, optimizer "
        "state and data position"]
    note = check_fingerprint(path, state, now, run)
    return state, notes + ([note] if note else [])


def is_own_checkpoint(storage, run: str, path: Path) -> bool:
    try:
        return Path(path).resolve().parent == storage.run_checkpoints(run).resolve()
    except OSError:
        return False


def foreign_resume_error(run: str, path: str) -> UserError:
    return UserError(f"--resume {path} is not a checkpoint of run {run}: add --init-from-checkpoint to start run "
                     f"{run} from it (its weights, optimizer and data position), or --resume a step of {run}")


def _config_fingerprint(cfg) -> dict:
    """What the config alone decides (no dataset read): the model's shape unless train.init_from gives it, the
    vocabulary when the config sets it; the trainer compares the whole fingerprint again before loading."""
    fp = run_fingerprint(cfg)
    drop = set(MODEL) if cfg.train.init_from else set() if "vocab_size" in cfg.model.model_fields_set else {"vocab_size"}
    return {k: v for k, v in fp.items() if k not in drop}


def preflight(cfg, root: Path, resume: str, foreign_ok: bool) -> None:
    """The refusals the config and the storage decide, in the CLI process before ranks, torch or a run directory:
    `--resume never` over existing checkpoints, a foreign `--resume PATH` without --init-from-checkpoint, and a
    fingerprint mismatch with the checkpoint a resume would start from (for `auto`, the newest complete one).
    In an existing run the refusal is recorded as a no-op start, as the trainer's own refusals are."""
    from llmcluster.storage.events import EVENTS, EventLog
    from llmcluster.storage.layout import Storage

    storage = Storage(root)
    try:
        _preflight(cfg, storage, resume, foreign_ok)
    except UserError as e:
        try:
            logs = storage.run_logs(cfg.run.name)
            if (logs / EVENTS).is_file() and int(os.environ.get("RANK", "0")) == 0:   # one writer: rank 0
                EventLog(logs, True).discard(str(e))
        except (OSError, UserError, ValueError):
            pass   # the refusal's line matters more than its record
        raise


def _preflight(cfg, storage, resume: str, foreign_ok: bool) -> None:
    run = cfg.run.name
    if resume in ("never", "auto"):
        try:
            complete = [(s, d) for s, d, ok in storage.checkpoint_steps(run) if ok]
        except (OSError, UserError):
            return   # the trainer reports unusable storage with its own line
        if complete and resume == "never":
            raise UserError(f"run {run} already has checkpoints up to step {complete[-1][0]}: "
                            "choose another run.name or --resume auto")
        path = complete[-1][1] if complete else None
    else:
        path = Path(resume)
        if not path.is_dir():
            raise UserError(f"--resume {resume}: no such checkpoint directory (--resume takes auto, never or a "
                                "step_N directory)")
        if not foreign_ok and not is_own_checkpoint(storage, run, path):
            raise foreign_resume_error(run, resume)
    if path is None:
        return
    try:
        state = json.loads((path / "train_state.json").read_text())   # safe_load.TRAIN_STATE (that module imports torch)
    except (OSError, ValueError):
        return   # unreadable: verification decides (the trainer's line)
    if isinstance(state, dict):
        check_fingerprint(path, state, _config_fingerprint(cfg), run)
