"""What an export is, without torch: its marker, the directory rules `export --out` keeps, and the refusals that
need only arguments and storage (a run without checkpoints, a step that is not there, a model name without an
export), so that `export`, `generate` and `eval` refuse in a fraction of a second instead of after importing torch
(issue 69). export/hf.py writes exports; this module only reads and checks."""

from __future__ import annotations

import json
import os
from pathlib import Path

from llmcluster.errors import UserError
from llmcluster.storage.layout import AREAS, DATASET_KINDS, Storage, check_run_name

EXPORT_MARKER = "llmcluster.json"   # written into every export: what makes a directory ours to replace
EXPORT_FORMAT = "llmcluster-hf-export"


def is_our_export(d: Path) -> bool:
    try:
        info = json.loads((d / EXPORT_MARKER).read_text())
    except (OSError, ValueError):
        return False
    # exports written before the "format" key carry run, step and checkpoint
    return isinstance(info, dict) and (info.get("format") == EXPORT_FORMAT
                                       or {"run", "step", "checkpoint"} <= info.keys())


def check_export_target(root: Path, out: Path) -> Path:
    """`export --out DIR` replaces only a fresh directory or an earlier export of ours; never `.`, $HOME, `/`,
    the storage root, its areas, or anything that contains them."""
    target = Path(os.path.abspath(out))
    resolved = target.resolve()
    storage = Path(os.path.abspath(root)).resolve()
    cwd, home = Path.cwd().resolve(), Path.home().resolve()
    protected = {Path("/"), home, cwd, storage, *(storage / a for a in AREAS),
                 *(storage / "datasets" / k for k in DATASET_KINDS)}
    if resolved in protected or any(p.is_relative_to(resolved) for p in (storage, cwd, home)):
        raise UserError(f"export --out {out}: refusing to replace {resolved} (the working directory, $HOME, '/', "
                        "the storage root or one of its areas): give a new directory")
    if target.is_symlink() or (target.exists() and not target.is_dir()):
        raise UserError(f"export --out {out}: exists and is not a directory: give a new directory")
    if target.is_dir() and any(target.iterdir()) and not is_our_export(target):
        raise UserError(f"export --out {out}: not empty and not an earlier llmcluster export (no {EXPORT_MARKER}): "
                        "refusing to replace it; give a new or empty directory")
    return target


def check_export_request(st: Storage, run: str, step: int | None) -> None:
    """The refusals of `export --run RUN [--step N]` that storage alone decides: no complete checkpoint at all, or
    no step_N. Whether the chosen checkpoint verifies is export/hf.py's (it hashes every file)."""
    check_run_name(run)
    steps = st.checkpoint_steps(run)
    complete = [s for s, _d, ok in steps if ok]
    if step is None:
        if not complete:
            raise UserError(f"run {run!r} has no complete checkpoint under {st.run_checkpoints(run)}")
    elif not st.step_dir(run, step).is_dir():
        named = f" (run {run}'s complete steps: {', '.join(map(str, complete))})" if complete else f" (run {run} has none)"
        raise UserError(f"cannot export {st.step_dir(run, step)}: no such checkpoint{named}")


def exported_model_dir(model: str, root: str | None, hint: str = "run `llmcluster export --run NAME` first") -> Path:
    """An exported model's directory: `model` itself when it holds a config.json, else the run `model`'s export
    under the storage root's models/; refused in one line when there is none."""
    from llmcluster.config.cluster_load import storage_root

    path = Path(model)
    if (path / "config.json").is_file():
        return path
    if "/" in model:
        raise UserError(f"no exported model at {path}")
    path = Storage(storage_root(root)).model_dir(check_run_name(model))
    if not (path / "config.json").is_file():
        raise UserError(f"no exported model at {path} ({hint})")
    return path
