"""Which tasks an evaluation runs: the shipped local tasks (assets/eval_tasks, built by
scripts/build_eval_tasks.py from held-out stdlib files), local task YAML files (read as data: taskdata.py), or harness task names.

Each shipped task is a YAML + a JSONL. The YAML names its JSONL relative to itself; the harness (through
`datasets`) would read it relative to the working directory, so each evaluation writes the YAMLs it runs into an
include directory of its own with the JSONL's absolute path. A task's digest (sha256 of its YAML and data) goes
into eval.jsonl beside the harness's version, so two scores are comparable only when their digests agree.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import Path

from llmcluster.errors import UserError
from llmcluster.eval import taskdata
from llmcluster.paths import asset_dir
from llmcluster.render import yaml_text

TASKS_DIR = asset_dir("eval_tasks")
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-]*")


@dataclass(frozen=True)
class Task:
    name: str                  # what the harness calls it (--tasks NAME)
    digest: str | None         # sha256 of the YAML (+ its shipped JSONL); None: a harness task (its own hash)
    yaml_text: str | None      # the YAML to write into the include directory; None: the harness knows it
    chance: float | None       # a multiple-choice task's chance accuracy (metadata.chance), for the printout


def shipped() -> list[str]:
    return sorted(p.stem for p in TASKS_DIR.glob("*.yaml"))


def _load_yaml(path: Path, where: str) -> dict:
    """A task file read as data (taskdata: allowed keys only, includes resolved here), with a task name."""
    doc = taskdata.load(path, where)
    if not isinstance(doc.get("task"), str):
        raise UserError(f"--tasks {where}: no `task: NAME` in it")
    return doc


def _shipped_task(name: str) -> Task:
    src = TASKS_DIR / f"{name}.yaml"
    doc = _load_yaml(src, name)
    files = doc["dataset_kwargs"]["data_files"]
    h = hashlib.sha256(src.read_bytes())
    for split, rel in sorted(files.items()):
        data = TASKS_DIR / rel
        h.update(data.read_bytes())
        files[split] = str(data)
    chance = (doc.get("metadata") or {}).get("chance")
    return Task(name, h.hexdigest(), yaml_text([doc], literal_blocks=False), chance)


def _file_task(path: Path, spec: str) -> Task:
    doc = _load_yaml(path, spec)
    # the resolved task (its includes merged, none left for the harness to follow) is what runs, so it is what
    # the digest names; relative data_files resolve as the user's working directory sees them (the harness runs
    # there)
    text = yaml_text([doc], literal_blocks=False)
    return Task(doc["task"], hashlib.sha256(text.encode()).hexdigest(), text, (doc.get("metadata") or {}).get("chance"))


def resolve(spec: str | None) -> list[Task]:
    """`--tasks T,...` (None: every shipped task): shipped names, task YAML files, or harness task names."""
    names = [s.strip() for s in (spec or ",".join(shipped())).split(",") if s.strip()]
    if not names:
        raise UserError("--tasks: give at least one task (shipped: " + ", ".join(shipped()) + ")")
    out: list[Task] = []
    for n in names:
        p = Path(n)
        if n in shipped():
            out.append(_shipped_task(n))
        elif p.suffix in (".yaml", ".yml"):
            if not p.is_file():
                raise UserError(f"--tasks {n}: no such task file")
            out.append(_file_task(p, n))
        elif _NAME.fullmatch(n):   # the harness's own registry (offline: its data must be in the HF cache)
            out.append(Task(n, None, None, None))
        else:
            raise UserError(f"--tasks {n!r}: not a task name or a .yaml file (shipped: {', '.join(shipped())})")
    if len({t.name for t in out}) != len(out):
        raise UserError(f"--tasks {spec}: a task is named twice")
    return out


def write_include_dir(tasks: list[Task], folder: Path) -> Path:
    """The YAMLs of `tasks` that the harness does not know, in `folder` (for --include_path)."""
    folder.mkdir(parents=True, exist_ok=True)
    for t in tasks:
        if t.yaml_text is not None:
            (folder / f"{t.name}.yaml").write_text(t.yaml_text)
    return folder


# The harness's own task index (its TaskIndex over the YAML in its package: tasks, groups and tags), built once
# per lm_eval install (~10 s on a loaded 2-core machine) and cached per user, so an unknown name is one line at
# once instead of an exit 1 after the harness's start-up.
_INDEX = """import json, pathlib, lm_eval.tasks as t
from lm_eval.tasks._index import TaskIndex
print(json.dumps(sorted(TaskIndex.build([pathlib.Path(t.__file__).parent]))))"""
_WHICH = """import importlib.metadata as m, importlib.util as u
print(m.version('lm_eval')); print(u.find_spec('lm_eval').submodule_search_locations[0])"""


def harness_task_names(python: str) -> set[str] | None:
    """The names the harness's registry knows, or None when they cannot be read (the harness then says)."""
    import json
    import os
    import subprocess

    from llmcluster.eval.harness import offline_env

    try:
        which = subprocess.run([python, "-c", _WHICH], capture_output=True, text=True, timeout=60,
                               env=offline_env()).stdout.split("\n")
        key = hashlib.sha256("\0".join([python, *which[:2]]).encode()).hexdigest()[:16]
        cache = Path(os.environ.get("LLMCLUSTER_CACHE") or Path.home() / ".cache" / "llmcluster")
        path = cache / f"lmeval-tasks-{key}.json"
        try:
            names = json.loads(path.read_text())
            if isinstance(names, list) and names and all(isinstance(n, str) for n in names):
                return set(names)
        except (OSError, ValueError):
            pass
        built = subprocess.run([python, "-c", _INDEX], capture_output=True, text=True, timeout=600,
                               env=offline_env())
        names = json.loads(built.stdout.strip().splitlines()[-1])
        cache.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(names))
        os.replace(tmp, path)
        return set(names)
    except (OSError, ValueError, IndexError, subprocess.SubprocessError):
        return None


def check_harness_tasks(tasks: list[Task], python: str) -> None:
    """Each harness task name (not shipped, not a file) is one the harness knows, or one line now."""
    asked = [t.name for t in tasks if t.yaml_text is None]
    known = harness_task_names(python) if asked else None
    unknown = [n for n in asked if known is not None and n not in known]
    if unknown:
        raise UserError(f"--tasks {', '.join(unknown)}: not a shipped task ({', '.join(shipped())}), a task file "
                        f"or one of the harness's {len(known)} tasks, groups and tags (`{Path(python).parent / 'lm_eval'} ls "
                        "tasks` lists them: the harness's venv, not on PATH)")
