"""The model card written into every export (issue 67): README.md in Hugging Face's format, through huggingface_hub's
ModelCard/ModelCardData, from the run's records only: what the lineage record holds (export/lineage.py), the
checkpoint's train state and the run's evaluations (logs/<run>/eval.jsonl). Every figure here is one of those
records' (one home for each fact); what only a person can say (intended use, limitations, the license) is left
visibly to be written, and `license: other` until then.

Hub fields are used for what they mean on the Hub: `base_model` only for a Hub id (a local base's path and digest go
in our own `llmcluster.base`), `eval_results` (the `model-index`) with `model_name`. No torch here: the versions
of what is loaded are read from the process (sys.modules) or the installed distributions.
"""

from __future__ import annotations

import sys
from importlib import metadata
from pathlib import Path

from llmcluster.export.lineage import CARD, LINEAGE, base_digest, digest as lineage_digest

TO_BE_WRITTEN = "**To be written** by the model's owner before the model is shared or served."
FLOP_CONVENTION = ("6·N + 12·L·H·Q·T per token (N the matmul parameters, the trainer's MFU convention, "
                   "model/flops.py) × tokens seen")


def _versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for dist in ("llmcluster", "torch", "safetensors", "tokenizers", "huggingface_hub"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = None
    if out["llmcluster"] is None:   # a checkout run without installing it
        from llmcluster import __version__
        out["llmcluster"] = __version__
    torch = sys.modules.get("torch")   # the export imported it; a card never imports it
    out["cuda"] = getattr(getattr(torch, "version", None), "cuda", None) if torch else None
    return out


def _flops_per_token(state: dict) -> float | None:
    """Training FLOPs per token as the trainer counts them (its MFU's numerator)."""
    from llmcluster.config.load import validate
    from llmcluster.config.schema import JobConfig
    from llmcluster.errors import UserError
    from llmcluster.model.flops import flops_per_token

    try:
        cfg = validate(state["config"], JobConfig, "train_state.json")
    except (UserError, KeyError, TypeError):   # a config this version does not read: left out, not invented
        return None
    return flops_per_token(cfg.model, cfg.data.seq_len)


def card_fields(root: Path, rec: dict, state: dict) -> dict:
    """Our own `llmcluster:` block of the card's metadata: every value from the lineage record or the train state."""
    run, base = rec["run"], rec.get("base")
    config = state.get("config") or {}
    train = config.get("train") or {}
    per_token = _flops_per_token(state)
    tokens = run.get("tokens_seen")
    return {
        "lineage_sha256": None,   # filled by write(): lineage.json's digest
        "run": run["name"], "step": rec["checkpoint"]["step"],
        "base": None if base is None else {"path": base["path"],
                                           "sha256": base.get("sha256") or base_digest(base["files"]),
                                           "files": len(base["files"])},
        # a LoRA/QLoRA export: its adapter alone, in PEFT's format, beside the merged weights (export/hf.py)
        "adapter": "adapter/" if any(f.startswith("adapter/") for f in rec["export"]["files"]) else None,
        "datasets": [{"name": d["name"], "kind": d.get("kind"), "tokens": d.get("tokens"),
                      "meta_sha256": d["meta_sha256"], "tokenizer_sha256": d["tokenizer_sha256"],
                      "shards": len(d["shards"])} for d in rec["datasets"]],
        "training": {"steps": rec["checkpoint"]["step"], "tokens_seen": tokens, "precision": run.get("precision"),
                     "parallel": run.get("parallel"), "attempts": run.get("attempts"),
                     "lora": train.get("lora"), "optimizer": train.get("optimizer"), "lr": train.get("lr"),
                     "seq_len": (config.get("data") or {}).get("seq_len"), "global_batch": state.get("global_batch"),
                     "config_sha256": run["config_sha256"]},
        "compute": {"train_flops": None if per_token is None or tokens is None else per_token * tokens,
                    "flops_per_token": per_token, "flops_convention": FLOP_CONVENTION, **energy(run)},
        "software": _versions(),
    }


def energy(run: dict) -> dict:
    """Device-hours and energy from the lineage's run link: measured when the run's GPU ranks recorded NVML's
    counters (storage/energy.py); else on GPUs of the planner's table its estimate, said to be one; else none, and
    why."""
    from llmcluster.config.gpus import match_device_name
    from llmcluster.plan.power import training_energy_kwh

    device, world, wall = run.get("device"), run.get("world_size"), run.get("wall_s")
    hours = None if world is None or wall is None else world * wall / 3600
    out = {"device": device, "device_hours": hours, "energy_kwh_measured": None, "energy_kwh_estimate": None}
    spec = match_device_name(device) if device and device not in ("cpu", "mps") else None
    if run.get("energy_j") is not None:
        out["energy_kwh_measured"] = run["energy_j"] / 3.6e6
        out["energy_note"] = ("measured: NVML's energy counters of the run's GPUs, summed over its ranks and attempts "
                              "(logs/<run>/energy/), the GPUs alone (not the servers' CPUs, fans or cooling)")
    elif spec is not None and hours is not None:
        out["energy_kwh_estimate"] = training_energy_kwh(spec, hours)
        out["energy_note"] = (f"an ESTIMATE, not a measurement: {hours:.3g} {spec.name} GPU-hours (the attempts' wall "
                              "time, events.jsonl, x the checkpoint's world size) x the planner's power model "
                              "(TDP x server factor x average training load, plan/power.py), IT load before PUE")
    else:
        why = ("the run's events or world size are not recorded" if hours is None else
               f"trained on {device or 'an unrecorded device'}: the planner's power model prices known GPUs only")
        out["energy_note"] = f"not measured (no NVML figure recorded) and not estimated: {why}"
    return out


def eval_results(root: Path, run: str, step: int):
    """The run's evaluations of this step (logs/<run>/eval.jsonl) as the Hub's EvalResults: the newest per task."""
    from huggingface_hub import EvalResult

    from llmcluster.storage import eval_log

    newest: dict[str, dict] = {}
    for r in eval_log.read(Path(root) / "logs" / run, quiet=True):
        if r.get("run") == run and r.get("step") == step and r.get("endpoint") is None:
            newest.update(r["tasks"])
    return [EvalResult(task_type="text-generation", dataset_type=task, dataset_name=task, metric_type=metric,
                       metric_value=value)
            for task, t in sorted(newest.items()) for metric, value in sorted(t.get("metrics", {}).items())]


def make(root: Path, rec: dict, state: dict, lineage_sha256: str):
    from huggingface_hub import ModelCard, ModelCardData

    fields = card_fields(root, rec, state)
    fields["lineage_sha256"] = lineage_sha256
    run, step = rec["run"]["name"], rec["checkpoint"]["step"]
    evals = eval_results(root, run, step)
    data = ModelCardData(license="other", library_name="transformers", tags=["llmcluster", "llama"],
                         model_name=run, eval_results=evals or None, llmcluster=fields)
    return ModelCard(f"---\n{data.to_yaml()}\n---\n\n{_body(fields, bool(evals))}")


def _body(f: dict, evals: bool) -> str:
    t, c = f["training"], f["compute"]
    base = (f"`{f['base']['path']}` (sha256 of its {f['base']['files']} files: `{f['base']['sha256']}`)"
            if f["base"] else "none: trained from scratch")
    data = "\n".join(f"- `{d['name']}` ({d['kind']}): {_tokens(d['tokens'])}, meta.json sha256 `{d['meta_sha256']}`"
                     for d in f["datasets"])
    lora = t["lora"]
    lora = (f"rank {lora.get('rank')}, alpha {lora.get('alpha')} on {', '.join(lora.get('targets') or [])} (base "
            f"{lora.get('base_precision', 'fp32')})") if isinstance(lora, dict) else "none"
    hours = f"{c['device_hours']:.3g}" if c["device_hours"] is not None else "not recorded"
    flops = f"{c['train_flops']:.3g}" if c["train_flops"] is not None else "not known"
    adapter = (f"\n\nAdapter: `{f['adapter']}` (PEFT format; `model.safetensors` holds the base with the adapter "
               "merged in)") if f["adapter"] else ""
    return f"""# {f['run']} (step {f['step']})

Written by `llmcluster export` from the run's records. The lineage record beside this card (`{LINEAGE}`,
sha256 `{f['lineage_sha256']}`) holds every digest; `llmcluster lineage {f['run']} --verify` checks them again.

## Intended use

{TO_BE_WRITTEN}

## Limitations and risks

{TO_BE_WRITTEN}

## License

{TO_BE_WRITTEN} (`license: other` until then)

## Base model

{base}{adapter}

## Training data

{data}

## Training

{t['steps']} steps, {t['tokens_seen']} tokens seen, precision {t['precision']}, layout: {t['parallel']},
LoRA/QLoRA: {lora}.

## Compute

Training FLOPs: {flops} ({c['flops_convention']}). Device-hours ({c['device']}): {hours}. Energy: {c['energy_note']}.

## Evaluation

{"See `model-index` in this card's metadata (`llmcluster eval`'s results of this step)." if evals
 else "No evaluation of this step was recorded when it was exported (`llmcluster eval`)."}
"""


def _tokens(tokens) -> str:
    if not isinstance(tokens, dict):
        return "tokens not recorded"
    return " + ".join(f"{n:,} {split}" for split, n in tokens.items() if isinstance(n, int)) + " tokens"


def write(export_dir: Path, root: Path, rec: dict, state: dict) -> None:
    make(root, rec, state, lineage_digest(export_dir)).save(export_dir / CARD)


def refresh_evals(export_dir: Path, root: Path) -> bool:
    """After `llmcluster eval` of an export: its card's model-index from the run's evaluations of the exported step,
    the rest of the card (what a person wrote in it included) kept as it is. Only a card of ours, in an export with
    a lineage record (which names the run and step), is touched; README.md is outside the hashed files, so the
    lineage still verifies. Returns whether the card was rewritten."""
    from huggingface_hub import ModelCard

    from llmcluster.export import lineage

    path = export_dir / CARD
    if not path.is_file() or not (export_dir / LINEAGE).is_file():
        return False
    rec = lineage.read(export_dir)   # a malformed record: one line (the caller says it as a warning)
    card = ModelCard.load(path)      # YAML read as data (huggingface_hub's safe loader)
    ours = getattr(card.data, "llmcluster", None)
    run, step = rec["run"]["name"], rec["checkpoint"]["step"]
    if not isinstance(ours, dict) or ours.get("run") != run:
        return False
    card.data.model_name = run
    card.data.eval_results = eval_results(root, run, step) or None
    card.save(path)
    return True
