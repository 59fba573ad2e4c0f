"""Read a plan file: YAML -> preset resolution -> `--set` overrides -> validated PlanSpec."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

from llmcluster.config.load import KINDS, apply_overrides, check_kind, read_yaml, validate
from llmcluster.errors import UserError
from llmcluster.paths import locate_shipped, preset_path
from llmcluster.plan.spec import PlanCluster, PlanSpec

def preset_model(name: str) -> dict[str, Any]:
    """The `model:` section of configs/<name>.yaml as it stands (ModelSpec extends ModelConfig), plus the
    sequence length the preset trains at."""
    path = preset_path(name)
    if path is None:
        raise UserError(f"model: '{name}' is not a preset in configs/ (give the dims instead: "
                        f"n_layers, d_model, n_heads, ffn_hidden, vocab_size)")
    cfg = read_yaml(path, "preset")
    section = cfg.get("model") or {}
    dims = dict(section)
    seq = (cfg.get("data") or {}).get("seq_len") or section.get("max_seq_len")
    if seq:
        dims["seq_len"] = seq
    dims["name"] = name
    dims.setdefault("ffn_type", "swiglu")
    return dims


def preset_eval(name: str) -> dict[str, Any]:
    """The preset job's in-training eval cadence (log.eval_interval, log.eval_batches), as a plan's `eval:`."""
    log = read_yaml(preset_path(name), "preset").get("log") or {}
    keys = {"eval_interval": "interval_steps", "eval_batches": "batches"}
    return {keys[k]: v for k, v in log.items() if k in keys}


def resolve_model(data: dict[str, Any]) -> None:
    """`model: llm_7b` or `model: {preset: llm_7b, seq_len: 4096}` -> explicit dims, in place."""
    model = data.get("model")
    preset = model if isinstance(model, str) else model.get("preset") if isinstance(model, dict) else None
    if preset is not None and "eval" not in data:  # the preset job's eval cadence unless the plan gives one
        data["eval"] = preset_eval(str(preset)) if preset_path(str(preset)) else {}
    if isinstance(model, str):
        data["model"] = preset_model(model)
    elif isinstance(model, dict) and "preset" in model:
        extra = {k: v for k, v in model.items() if k != "preset"}
        data["model"] = {**preset_model(str(model["preset"])), **extra}


def locate_plan(name_or_path: str | Path) -> Path:
    """A plan file, the name of a plan shipped with the package (seed-a100-7b, ...), or a job config preset's
    name (llm_8b_qlora, ...: planned as the trainer runs it, `job_config_plan`)."""
    try:
        return locate_shipped("plans", name_or_path, "plan")
    except UserError:
        preset = preset_path(str(name_or_path))
        if preset is None:
            raise
        return preset


# A job config's sections that no plan has (PlanSpec forbids them): a file holding one is planned as a job config.
JOB_SECTIONS = KINDS["job config"][0]
# The planner reads no weights: a QLoRA job config may leave train.init_from (required to train) to the user.
PLANNED_INIT_FROM = "train.init_from=not-read-by-the-planner"


def job_config_plan(path: Path, overrides: list[str], cluster: str | None) -> PlanSpec:
    """A job config (`llmcluster plan llm_8b_qlora --cluster rtx4090-box`) planned as `llmcluster train` runs it
    (plan/fit.py job_plan: its layout, batch, steps and fine-tuning method) on the cluster `--cluster` names (else
    $LLMCLUSTER_CLUSTER or ./cluster.yaml): job.nodes nodes of job.gpus_per_node GPUs (0: the spec's per node).
    `--set cluster.X=...` reaches the cluster spec, every other `--set` the job config."""
    from llmcluster.config.cluster_load import cluster_from_data
    from llmcluster.config.load import load_job_config
    from llmcluster.plan.fit import job_plan

    cluster_sets = [o.split(".", 1)[1] for o in overrides if o.split("=", 1)[0].strip().startswith("cluster.")]
    rest = [o for o in overrides if not o.split("=", 1)[0].strip().startswith("cluster.")]
    _check_cluster_keys([f"cluster.{o}" for o in cluster_sets])
    train = read_yaml(path, "config").get("train") or {}
    if not train.get("init_from") and not any(o.split("=", 1)[0].strip() == "train.init_from" for o in rest):
        rest.insert(0, PLANNED_INIT_FROM)
    cfg = load_job_config(str(path), rest)
    cluster_data, source = plan_cluster_data(None, path, cluster)
    spec = cluster_from_data(copy.deepcopy(cluster_data), source, cluster_sets)
    view = PlanCluster.from_cluster(spec).model_dump()
    nodes, per_node = cfg.job.nodes, cfg.job.gpus_per_node or view["gpus_per_node"]
    if nodes > view["nodes"] or per_node > view["gpus_per_node"]:
        raise UserError(f"{path}: the job asks for {nodes} x {per_node} GPUs (job.nodes x job.gpus_per_node), cluster "
                        f"{spec.name} has {view['nodes']} x {view['gpus_per_node']}: --set job.nodes=N, or another "
                        "--cluster")
    view.update(nodes=nodes, gpus_per_node=per_node)
    plan = job_plan(cfg, view["gpu"], view)
    return plan.model_copy(update={"cost": spec.cost})


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    """`extra` over `base`, section by section; `nodes` is replaced whole (hosts and count exclude each other)."""
    out = dict(base)
    for k, v in extra.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict) and k != "nodes":
            out[k] = _merge(out[k], v)
        else:
            out[k] = v
    return out


def plan_cluster_data(section: Any, plan_path: Path, cluster_ref: str | None) -> tuple[dict[str, Any], str]:
    """The cluster mapping a plan is made on, and where it came from: `--cluster FILE|NAME`; else the plan's
    `cluster:` (a name or path, `{base: NAME, ...changes}`, or an inline spec); else $LLMCLUSTER_CLUSTER or
    ./cluster.yaml."""
    from llmcluster.config.cluster_load import find_cluster, read_cluster_file

    def named(ref: str) -> tuple[dict[str, Any], str]:
        rel = plan_path.parent / ref
        path, data = read_cluster_file(rel if rel.is_file() else ref)
        return data, str(path)

    if cluster_ref:
        return named(cluster_ref)
    if isinstance(section, str):
        return named(section)
    if isinstance(section, dict):
        if "base" in section:
            data, src = named(str(section["base"]))
            return _merge(data, {k: v for k, v in section.items() if k != "base"}), f"{src} + {plan_path}"
        return section, str(plan_path)
    if section is not None:
        raise UserError(f"{plan_path}: cluster must be a cluster file or name, or a cluster spec mapping")
    path, how = find_cluster(None)
    if path is None:
        raise UserError(f"{plan_path}: no cluster: give --cluster FILE|NAME, a `cluster:` section, "
                        f"$LLMCLUSTER_CLUSTER or ./cluster.yaml")
    return read_cluster_file(path)[1], str(path)


def _check_cluster_keys(overrides: list[str]) -> None:
    """`--set cluster.X=...` keys checked against the cluster spec, so the error names the key as typed."""
    from pydantic import BaseModel

    from llmcluster.config.cluster import ClusterSpec

    class Keys(BaseModel):
        cluster: ClusterSpec

    apply_overrides({}, overrides, Keys)


def load_plan(path: str | Path, overrides: list[str] | None = None, cluster: str | None = None) -> PlanSpec:
    """The validated plan: its model, the cluster it is made on (`cluster`, i.e. `--cluster`, wins over the plan's
    own `cluster:`), and `--set` overrides (`cluster.X` reaches the cluster spec)."""
    from llmcluster.config.cluster_load import cluster_from_data

    path = locate_plan(path)
    data = read_yaml(path, "plan")
    if any(k in data for k in JOB_SECTIONS):
        return job_config_plan(path, list(overrides or []), cluster)
    check_kind(data, path, "plan")
    if "cost" in data:
        raise UserError(f"{path}: 'cost' belongs to the cluster spec now: use cluster.cost (see docs/cluster.md)")
    overrides = list(overrides or [])
    on_cluster = [o.split("=", 1)[0].strip() for o in overrides]
    cluster_sets = [o.split(".", 1)[1] for o, k in zip(overrides, on_cluster) if k.startswith("cluster.")]
    rest = [o for o, k in zip(overrides, on_cluster) if not k.startswith("cluster.")]
    for o in rest:
        key = o.split("=", 1)[0].strip()
        if key == "cluster":
            raise UserError("--set cluster=...: name the cluster with --cluster FILE|NAME")
        if key.split(".")[0] == "cost":
            raise UserError(f"--set {key}: cost belongs to the cluster spec now: use --set cluster.{key}")
    _check_cluster_keys([o for o, k in zip(overrides, on_cluster) if k.startswith("cluster.")])
    cluster_data, source = plan_cluster_data(data.pop("cluster", None), path, cluster)
    spec = cluster_from_data(copy.deepcopy(cluster_data), source, cluster_sets)
    # `--set model=llm_70b` (or model={...dims}) swaps the whole model: apply it before resolving presets.
    whole = [o for o in rest if o.split("=", 1)[0].strip() == "model"]
    apply_overrides(data, whole, PlanSpec)
    resolve_model(data)
    apply_overrides(data, [o for o in rest if o not in whole], PlanSpec)
    data["cluster"] = PlanCluster.from_cluster(spec).model_dump()
    data["cost"] = spec.cost.model_dump()
    return validate(data, PlanSpec, str(path))
