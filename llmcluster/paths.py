"""Where things live: the files shipped inside the package, and the storage root resolution order.

Presets (`configs/`), example plans (`plans/`) and the monitoring rules and dashboards (`monitoring/`) ship inside
the package under `llmcluster/assets/` and are read through importlib.resources, so a wheel install finds them as a
checkout does (the checkout's top-level `configs/`, `plans/` and `monitoring/` are links to the same folders).
"""

from __future__ import annotations

import os
import stat
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
    """--root, else $LLMCLUSTER_STORAGE, else config_root, else ./storage. Commands call
    config/cluster_load.storage_root, which passes the job config's run.storage or the cluster spec's storage.root."""
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
    if p.is_dir():
        raise UserError(f"{what} {ref} is a directory: give a {what} file (a .yaml) in it, or a shipped {what}'s name")
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


# What a file we write starts with: an existing file is overwritten only if it looks like one of ours.
SIGNATURES = {".png": b"\x89PNG\r\n\x1a\n", ".prom": b"# HELP llmcluster_"}


def check_output_path(path: str | Path, what: str, inside: tuple[str, ...] = ()) -> Path:
    """Check an output path before any work starts (issue 34); one line (UserError) for each refusal.

    Without `inside`: `path` is a file to write. Its directory must exist and be writable; an existing path
    is overwritten only if it is a regular file (not a link, not a directory) owned by the caller, with the
    suffix `path` asks for and the start of a file of ours (SIGNATURES; an empty file passes) - so a typo
    like `--plot /etc/passwd` or a colleague's file is never replaced.
    With `inside` (e.g. ("goodput.png",)): `path` is a directory to write those files into. It may be
    missing (made later, one level: its parent must exist) or a directory; each of the files in it is then
    checked as above."""
    p = Path(path).expanduser()
    if inside:
        if p.is_symlink() or p.exists():
            if not p.is_dir():
                raise UserError(f"{what} {path}: not a directory")
            for name in inside:
                check_output_path(p / name, what)
        elif not p.parent.is_dir():
            raise UserError(f"{what} {path}: no such directory {p.parent} (make it first)")
        elif not os.access(p.parent, os.W_OK):
            raise UserError(f"{what} {path}: cannot create it in {p.parent} (permission denied)")
        return p
    if not p.parent.is_dir():
        raise UserError(f"{what} {path}: no such directory {p.parent} (make it first)")
    if p.is_symlink() or p.exists():
        st = p.lstat()
        if stat.S_ISDIR(st.st_mode):
            raise UserError(f"{what} {path}: is a directory (give a file name)")
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or not _looks_ours(p, st.st_size):
            raise UserError(f"{what} {path}: exists and is not a {p.suffix or 'file'} file written by llmcluster; "
                            "refusing to overwrite it (remove it or choose another path)")
    if not os.access(p.parent, os.W_OK):
        raise UserError(f"{what} {path}: cannot write into {p.parent} (permission denied)")
    return p


def _looks_ours(p: Path, size: int) -> bool:
    sig = SIGNATURES.get(p.suffix)
    if sig is None:
        return False      # no suffix we write: not ours
    try:
        with open(p, "rb") as f:
            return size == 0 or f.read(len(sig)) == sig
    except OSError:
        return False
