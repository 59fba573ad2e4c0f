"""Where things live: the repo's presets, and the storage root resolution order."""

from __future__ import annotations

import os
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent
REPO_DIR = PACKAGE_DIR.parent
CONFIGS_DIR = REPO_DIR / "configs"
DEFAULT_STORAGE = "./storage"  # the embedded default; /storage on a cluster
STORAGE_ENV = "LLMCLUSTER_STORAGE"


def resolve_storage_root(cli_root: str | None = None, config_root: str | None = None) -> Path:
    """--root, else $LLMCLUSTER_STORAGE, else the config's run.storage, else ./storage."""
    for candidate in (cli_root, os.environ.get(STORAGE_ENV), config_root, DEFAULT_STORAGE):
        if candidate:
            return Path(candidate).expanduser().resolve()
    raise AssertionError("unreachable")


def preset_path(name: str) -> Path | None:
    """configs/<name>.yaml if `name` is a preset name (with or without .yaml), else None."""
    stem = name[:-5] if name.endswith(".yaml") else name
    if "/" in stem or not stem:
        return None
    p = CONFIGS_DIR / f"{stem}.yaml"
    return p if p.is_file() else None
