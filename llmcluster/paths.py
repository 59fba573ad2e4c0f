"""Where things live: the files shipped inside the package, and the storage root resolution order.

Presets (`configs/`), example plans (`plans/`) and the monitoring rules and dashboards (`monitoring/`) ship inside
the package under `llmcluster/assets/` and are read through importlib.resources, so a wheel install finds them as a
checkout does (the checkout's top-level `configs/`, `plans/` and `monitoring/` are links to the same folders).
"""

from __future__ import annotations

import os
from importlib.resources import files
from pathlib import Path

from llmcluster.errors import UserError

DEFAULT_STORAGE = "./storage"  # the embedded default; /storage on a cluster
STORAGE_ENV = "LLMCLUSTER_STORAGE"


def asset_dir(kind: str) -> Path:
    """The shipped folder `kind` (configs, plans, monitoring, ...) as a filesystem path."""
    # files() of an installed (unzipped) package is a real directory; Path() makes it one type everywhere.
    return Path(str(files("llmcluster") / "assets" / kind))


CONFIGS_DIR = asset_dir("configs")
PLANS_DIR = asset_dir("plans")
MONITORING_DIR = asset_dir("monitoring")


def resolve_storage_root(cli_root: str | None = None, config_root: str | None = None) -> Path:
    """--root, else $LLMCLUSTER_STORAGE, else the config's run.storage, else ./storage."""
    for candidate in (cli_root, os.environ.get(STORAGE_ENV), config_root, DEFAULT_STORAGE):
        if candidate:
            return Path(candidate).expanduser().resolve()
    raise AssertionError("unreachable")


def shipped_file(kind: str, name: str) -> Path | None:
    """assets/<kind>/<name>.yaml if `name` is a bare name (with or without .yaml) shipped there, else None."""
    stem = name[:-5] if name.endswith(".yaml") else name
    if "/" in stem or not stem or stem.startswith("."):
        return None
    p = asset_dir(kind) / f"{stem}.yaml"
    return p if p.is_file() else None


def shipped_names(kind: str) -> list[str]:
    return sorted(p.stem for p in asset_dir(kind).glob("*.yaml"))


def locate_shipped(kind: str, ref: str | Path, what: str) -> Path:
    """The file at `ref`, else the one shipped as assets/<kind>/<ref>.yaml; else one line listing those shipped."""
    p = Path(ref).expanduser()
    if p.is_file():
        return p
    shipped = shipped_file(kind, str(ref))
    if shipped is not None:
        return shipped
    stem = Path(str(ref)).name.removesuffix(".yaml")
    if "/" in str(ref) and shipped_file(kind, stem) is not None:
        # `plans/seed-a100-7b.yaml` outside the checkout: the shipped one is reachable by its name anywhere
        raise UserError(f"{what} file not found: {ref} (relative to {Path.cwd()}); the shipped {what} of that "
                        f"name is `{stem}`")
    raise UserError(f"{what} file not found: {ref} (nor a shipped {what}: {', '.join(shipped_names(kind))})")


def preset_path(name: str) -> Path | None:
    """The preset job config `name` (llm_tiny, llm_7b, ...), else None."""
    return shipped_file("configs", name)
