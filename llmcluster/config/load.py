"""Load a YAML job config, apply `--set` overrides, validate, and explain errors in one line."""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ValidationError

from llmcluster.config import strict_yaml
from llmcluster.errors import UserError
from llmcluster.paths import locate_shipped

M = TypeVar("M", bound=BaseModel)


def read_yaml(path: str | Path, what: str = "config") -> dict[str, Any]:
    """A YAML mapping from a file, or a one-line UserError."""
    p = Path(path)
    if not p.is_file():
        raise UserError(f"{what} file not found: {p}")
    try:
        data = strict_yaml.load(p.read_text(encoding="utf-8"))
    except strict_yaml.DuplicateKey as e:
        raise UserError(f"{p}: {e.problem}") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(e, "problem", None) or "invalid YAML"
        raise UserError(f"{p}: invalid YAML{where}: {problem}") from None
    except (UnicodeDecodeError, OSError) as e:
        raise UserError(f"{p}: cannot read {what}: {e}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise UserError(f"{p}: a {what} must be a YAML mapping of sections, got {type(data).__name__}")
    return data


# Top-level keys that only one kind of our files has, and what that kind is for: a file given where another kind is
# expected is named as what it is (a plan given to `train -c` failed on "model: input should be a valid dictionary").
KINDS: dict[str, tuple[tuple[str, ...], str]] = {
    "job config": (("run", "data", "train", "checkpoint", "log", "job", "serve"), "`llmcluster train -c FILE`"),
    "plan": (("cluster", "training"), "`llmcluster plan FILE`"),   # and `model:` (PLAN_NEEDS)
    "cluster spec": (("nodes", "hardware", "topology", "storage", "scheduler", "monitoring", "validate",
                      "reliability", "provision"), "`--cluster FILE`"),
}


# A plan always has a model; an old-format cluster spec's `cluster:` section (check_format's line) has none.
PLAN_NEEDS = "model"


def check_kind(data: dict[str, Any], source: str | Path, expected: str) -> None:
    """A one-line UserError when `data` has none of `expected`'s own keys but another kind's."""
    if any(k in data for k in KINDS[expected][0]):
        return
    for kind, (keys, use) in KINDS.items():
        if kind == "plan" and PLAN_NEEDS not in data:
            continue
        if kind != expected and any(k in data for k in keys):
            raise UserError(f"{source} is a {kind}, not a {expected}: use it with {use}")


def locate_config(name_or_path: str) -> Path:
    """A path, or a preset name from configs/ (llm_tiny, llm_7b, ...)."""
    return locate_shipped("configs", name_or_path, "config")


def parse_override(item: str) -> tuple[list[str], Any]:
    """'train.lr=3e-4' -> (['train', 'lr'], 0.0003). Values are typed by YAML."""
    if "=" not in item:
        raise UserError(f"override {item!r} must look like key.path=value")
    key, raw = item.split("=", 1)
    key = key.strip()
    parts = key.split(".")
    if not key or any(not part for part in parts):
        raise UserError(f"override {item!r}: bad key path {key!r}")
    try:
        value = strict_yaml.load(raw) if raw.strip() else ""
    except strict_yaml.DuplicateKey as e:
        raise UserError(f"override {item!r}: {e.problem}") from None
    except yaml.YAMLError:
        value = raw  # not YAML: keep the string, the schema decides
    return parts, value


def apply_overrides(data: dict[str, Any], overrides: list[str], schema: type[BaseModel]) -> dict[str, Any]:
    for item in overrides:
        parts, value = parse_override(item)
        _check_path(schema, parts)
        node = data
        for part in parts[:-1]:
            child = node.get(part)
            if not isinstance(child, dict):
                child = {}
                node[part] = child
            node = child
        node[parts[-1]] = value
    return data


def _section_fields(schema: type[BaseModel], path: list[str]) -> tuple[type[BaseModel] | None, list[str]]:
    """The model class at `path` inside `schema` and its valid keys (field names and aliases)."""
    cls: type[BaseModel] | None = schema
    for part in path:
        if cls is None:
            return None, []
        field = _field(cls, part)
        if field is None:
            return None, []
        cls = _model_of(field.annotation)
    if cls is None:
        return None, []
    keys = []
    for name, f in cls.model_fields.items():
        keys.append(f.alias or name)
    return cls, keys


def _model_of(ann) -> type[BaseModel] | None:
    """The section class an annotation names, also through `Section | None` (an optional section such as
    log.wandb, which `--set log.wandb.project=P` turns on)."""
    import types
    import typing

    union = typing.get_origin(ann) in (typing.Union, types.UnionType)
    for a in (*typing.get_args(ann),) if union else (ann,):
        if isinstance(a, type) and issubclass(a, BaseModel):
            return a
    return None


def _field(cls: type[BaseModel], key: str):
    for name, f in cls.model_fields.items():
        if key in (name, f.alias):
            return f
    return None


# Keys a job config no longer takes, and where they went (a config file or --set naming one gets this line).
MOVED = {"job.k8s.host_paths": "the cluster spec's scheduler.kubernetes.host_paths (the allow-list of host "
                               "mounts restricts the job: the cluster declares it, not the job)"}


def _unknown_key_message(schema: type[BaseModel], path: list[str]) -> str:
    _, keys = _section_fields(schema, path[:-1])
    dotted = ".".join(path)
    if dotted in MOVED:
        return f"{dotted} moved to {MOVED[dotted]}"
    prefix = ".".join(path[:-1])
    close = difflib.get_close_matches(path[-1], keys, n=1, cutoff=0.5)
    hint = f" (did you mean '{prefix + '.' if prefix else ''}{close[0]}'?)" if close else ""
    if not close and keys:
        hint = f" (valid keys{' in ' + prefix if prefix else ''}: {', '.join(keys)})"
    return f"unknown key '{dotted}'{hint}"


def _is_mapping_field(schema: type[BaseModel], path: list[str]) -> bool:
    """Whether path names a dict-typed field (free-form keys, e.g. job.env.NCCL_DEBUG)."""
    import typing

    cls, _ = _section_fields(schema, path[:-1])
    f = _field(cls, path[-1]) if cls is not None and path else None
    if f is None:
        return False
    ann = f.annotation
    origins = {typing.get_origin(a) for a in (ann, *typing.get_args(ann))}
    return dict in origins or ann is dict


def _check_path(schema: type[BaseModel], parts: list[str]) -> None:
    for i in range(len(parts)):
        if i and _is_mapping_field(schema, parts[:i]):
            return  # below a dict field any key is allowed; the schema checks the values
        cls, keys = _section_fields(schema, parts[:i])
        if cls is None:
            raise UserError(f"override key '{'.'.join(parts)}': '{'.'.join(parts[:i])}' is not a section")
        if parts[i] not in keys:
            raise UserError(_unknown_key_message(schema, parts[: i + 1]))


def explain(err: ValidationError, schema: type[BaseModel], source: str = "") -> str:
    """The first pydantic error as one line naming the key."""
    e = err.errors()[0]
    loc = [str(x) for x in e["loc"] if not isinstance(x, int)]
    where = f"{source}: " if source else ""
    if e["type"] == "extra_forbidden":
        return where + _unknown_key_message(schema, loc)
    msg = e["msg"]
    if msg.startswith("Value error, "):
        return where + msg[len("Value error, "):]
    key = ".".join(loc) or "config"
    got = e.get("input")
    shown = "" if isinstance(got, (dict, list)) or got is None else f" (got {got!r})"
    return f"{where}{key}: {msg[0].lower() + msg[1:]}{shown}"


def validate(data: Any, schema: type[M], source: str = "") -> M:
    try:
        return schema.model_validate(data)
    except ValidationError as err:
        raise UserError(explain(err, schema, source)) from None


def load_job_config(name_or_path: str | None, overrides: list[str] | None = None):
    """The validated JobConfig from a file or preset (None: all defaults = the tiny CPU job)."""
    from llmcluster.config.schema import JobConfig

    data: dict[str, Any] = {}
    source = ""
    if name_or_path:
        path = locate_config(name_or_path)
        data = read_yaml(path)
        source = str(name_or_path)
        check_kind(data, source, "job config")
    apply_overrides(data, list(overrides or []), JobConfig)
    return validate(data, JobConfig, source)


def require_named_run(cfg, name_or_path: str | None) -> None:
    """A job config that trains names its run: an empty file, or one without run.name (nor --set run.name), would
    otherwise train into the default run's checkpoints (the demo's llm-tiny) and resume or refuse them."""
    if "name" in cfg.run.model_fields_set:
        return
    what = f"{name_or_path} is empty" if not cfg.model_fields_set else f"{name_or_path} names no run"
    raise UserError(f"{what}: a training job needs run.name (`run: {{name: NAME}}` in the file, or --set "
                    "run.name=NAME); configs/llm_tiny.yaml is a complete example")


def config_to_dict(cfg: BaseModel) -> dict[str, Any]:
    return cfg.model_dump(mode="json", by_alias=True)


def saved_config_dict(cfg: BaseModel) -> dict[str, Any]:
    """The config as it may be written to disk (launch copies, checkpoints' train state): job.env values
    redacted, since sites put tokens there; the trainer never reads job.env (the launcher exports it)."""
    from llmcluster.config.job import redact_job

    data = config_to_dict(cfg)
    if isinstance(data.get("job"), dict):
        data["job"] = redact_job(data["job"])
    return data
