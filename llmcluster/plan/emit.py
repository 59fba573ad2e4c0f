"""`plan PLAN --emit-config FILE`: a search candidate written out as a job config `llmcluster train` reads.

The model section is the plan's dims in the job config's names (`seq_len` becomes `data.seq_len` and
`model.max_seq_len`); the layout is the candidate's `set`, so the file and the copyable `--set` line in
the search table are one fact. A plan whose model is a preset (`model: llm_7b`) starts from that preset's file
and changes only what the plan decides. A plan whose model is not a Llama shape has no candidate (search filters).
"""

from __future__ import annotations

from pathlib import Path

from pydantic import ValidationError

from llmcluster.config import strict_yaml
from llmcluster.config.load import read_yaml
from llmcluster.config.schema import JobConfig
from llmcluster.errors import UserError
from llmcluster.paths import preset_path
from llmcluster.plan.spec import PlanSpec
from llmcluster.render import comment_text, line_text, shell_join, yaml_text


def job_config(plan: PlanSpec, candidate: dict) -> dict:
    m, c = plan.model, plan.cluster
    cfg: dict = {
        "run": {"name": (m.name or "planned").replace("/", "-")},
        "model": {"n_layers": m.n_layers, "d_model": m.d_model, "n_heads": m.n_heads, "n_kv_heads": m.n_kv_heads,
                  "ffn_hidden": m.ffn_hidden, "vocab_size": m.vocab_size, "max_seq_len": m.seq_len,
                  "tie_embeddings": m.tie_embeddings},
        "data": {"seq_len": m.seq_len},
        "train": {**train_precision(plan.parallel.precision), "global_batch": candidate["global_batch"]},
        "parallel": {},
        "job": {"nodes": c.nodes, "gpus_per_node": c.gpus_per_node},
    }
    for item in candidate["set"]:
        key, value = item.split("=", 1)
        section, name = key.split(".", 1)
        cfg[section][name] = strict_yaml.load(value)
    preset = preset_path(m.name) if m.name else None
    if preset is not None:
        cfg = _over_preset(read_yaml(preset, "preset"), cfg)
    try:
        JobConfig.model_validate(cfg)  # what is written must load
    except ValidationError as e:
        raise UserError(f"--emit-config: the best candidate is not a valid job config: "
                        f"{e.errors()[0]['msg']}") from None
    return cfg


def train_precision(precision: str) -> dict:
    """The plan's precision in the trainer's words: `fp8` is float8 matmuls in the blocks (torchao's tensorwise
    recipe, as torchtitan's default) with bf16 everywhere else, so plan and train keep one vocabulary."""
    if precision == "fp8":
        return {"precision": "bf16", "float8": {"recipe": "tensorwise"}}
    return {"precision": precision}


def _over_preset(base: dict, planned: dict) -> dict:
    """The preset the plan's model came from, as written (its data, steps, lr, compile, checkpoint settings and
    run name), with only what the plan decides changed: the layout, the batch, the precision, the job's size,
    and model or data values that differ from the preset's (a plan's `seq_len`, say)."""
    preset = JobConfig.model_validate(base)
    out = {k: dict(v) if isinstance(v, dict) else v for k, v in base.items()}
    for section, values in planned.items():
        if section == "run":
            continue
        current = getattr(preset, section)
        changed = {k: v for k, v in values.items()
                   if section in ("parallel", "job") or getattr(current, k, None) != v}
        if changed:
            out[section] = {**(out.get(section) or {}), **changed}
    return out


def write_job_config(path: str | Path, plan: PlanSpec, candidate: dict) -> Path:
    out = Path(line_text(path, "--emit-config"))   # before writing: the printed command must be able to name it
    head = (f"# Written by `llmcluster plan --emit-config`: the best layout the planner found for "
            f"{comment_text(plan.model.name or 'this model')} on {plan.cluster.nodes} x {plan.cluster.gpus_per_node} "
            f"{comment_text(plan.cluster.gpu)}"
            f"\n# (predicted {candidate['tokens_per_s_per_gpu']:,.0f} tokens/s per GPU, "
            f"MFU {candidate['mfu']:.1%}, {candidate['memory_bytes'] / 2**30:.1f} GiB per GPU).\n")
    try:
        out.write_text(head + yaml_text([job_config(plan, candidate)]))
    except OSError as e:
        raise UserError(f"--emit-config {out}: cannot write: {e.strerror}") from None
    return out


def train_command(path: str | Path) -> str:
    """The copyable command that trains from the emitted file, quoted for the shell (a path may hold spaces, a
    quote or `$`)."""
    return shell_join(["llmcluster", "train", "--config", str(path)])
