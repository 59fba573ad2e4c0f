"""The package imports one way (issue 33; docs/architecture.md): the rules in one table, read from the source.

Every `import` and `from ... import` of every module counts, the ones inside functions too (a lazy import is still
a dependency: it runs on some path). A room is a folder of `llmcluster/` (a top-level module is a room of its own).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "llmcluster"

# The layers, lowest first: a room imports rooms of lower layers only (never its own layer's other rooms, never a
# higher one). Changing this table is changing the architecture: docs/architecture.md draws the same table.
LAYERS: list[set[str]] = [
    {"errors"},                                       # UserError and the exit codes: imports nothing of ours
    {"render", "floor", "paths", "console", "testing", "quiet", "llmcluster"},   # base modules: stdlib (+ errors)
    {"config"},                                       # the one vocabulary: a leaf over the base modules
    {"model", "storage"},                             # the model (config only); the layout and a run's records
    {"data", "distributed"},                          # tokens on disk; process groups, mesh, torch shims
    {"checkpoint", "plan"},                           # write/verify/load checkpoints; sizing and time (no torch)
    {"launch", "export"},                             # schedulers and the launch record; HF export
    {"monitor"},                                      # metrics, scrape configs, the run's tracking sinks
    {"serve", "provision"},                           # vLLM start, bench and its API keys; Ansible
    {"eval"},                                         # lm-eval over exports, checkpoints and served endpoints
    {"ft"},                                           # per-step fault tolerance's training side (torchft)
    {"train"},                                        # the training loop (it schedules downstream evaluations)
    {"validate"},                                     # cluster checks (run small trainings)
    {"cli"},                                          # the thin CLI over all of it
    {"__main__"},
]
LAYER = {room: i for i, rooms in enumerate(LAYERS) for room in rooms}

# Rules the layers alone do not say, each with its reason.
ONLY = {   # room -> the rooms (besides its own) it may import at all
    "config": {"errors", "paths", "render"},
    "model": {"config"},
    "render": {"errors"},
    "errors": set(),
}
NO_TORCH = ["plan", "launch", "storage", "provision", "config", "render"]   # head node, fast start
# Modules of other rooms that must not reach torch either: what an auditor runs on a machine without it (issue 67:
# `llmcluster lineage` reads and verifies an export's record, docs/lineage.md), and the model card's maker.
# cli.lineage is checked at run time only: its --root helper's module (cli/common.py) reaches torch statically through
# --procs-per-node's lazy import, a path `lineage` never takes (tests/test_lineage.py runs it with torch unimportable).
NO_TORCH_MODULES = ["llmcluster.export.lineage", "llmcluster.export.card", "llmcluster.export.marker"]
NEVER_TRAINING_LOOP = ["launch", "export", "eval", "serve", "plan", "monitor", "checkpoint", "ft"]


def _room(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "llmcluster"


def _modules() -> dict[str, set[str]]:
    """module name -> every module name it imports (ours resolved to a module that exists, others top-level)."""
    raw: dict[str, set[str]] = {}
    for path in PKG.rglob("*.py"):
        rel = path.relative_to(PKG.parent).with_suffix("").parts
        name = ".".join(rel[:-1] if rel[-1] == "__init__" else rel)
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                deps |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
            elif isinstance(node, ast.Import):
                deps |= {a.name for a in node.names}
        raw[name] = deps
    ours = set(raw)

    def resolve(dep: str) -> str | None:
        if not dep.startswith("llmcluster"):
            return dep.split(".")[0]
        parts = dep.split(".")
        return next((c for i in range(len(parts), 0, -1) if (c := ".".join(parts[:i])) in ours), None)
    return {m: {r for d in deps if (r := resolve(d)) and r != m} for m, deps in raw.items()}


GRAPH = _modules()


def _crossings():
    for mod, deps in sorted(GRAPH.items()):
        for dep in sorted(deps):
            if dep.startswith("llmcluster") and _room(dep) != _room(mod):
                yield mod, dep


def test_every_room_is_in_the_layer_table():
    rooms = {_room(m) for m in GRAPH}
    assert rooms <= set(LAYER), f"rooms missing from LAYERS (and docs/architecture.md): {sorted(rooms - set(LAYER))}"


def test_imports_go_down_the_layers_only():
    bad = [f"{m} (layer {LAYER[_room(m)]}) imports {d} (layer {LAYER[_room(d)]})"
           for m, d in _crossings() if LAYER[_room(d)] >= LAYER[_room(m)]]
    assert not bad, "imports against the direction of docs/architecture.md:\n" + "\n".join(bad)


@pytest.mark.parametrize("room", sorted(ONLY))
def test_rooms_with_a_closed_list(room):
    bad = [f"{m} imports {d}" for m, d in _crossings() if _room(m) == room and _room(d) not in ONLY[room]]
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("room", NEVER_TRAINING_LOOP)
def test_no_room_but_the_cli_and_validate_reaches_the_training_loop(room):
    """launch, export, eval, serve (and the rooms below them) never import the trainer's room: reading a
    checkpoint or a run's records does not mean importing the training loop. Nor does ft: the trainer drives it
    (a Replica is given the trainer), never the other way."""
    bad = [f"{m} imports {d}" for m, d in _crossings() if _room(m) == room and _room(d) == "train"]
    assert not bad, "\n".join(bad)


def _reach(module: str) -> set[str]:
    seen, todo = set(), [module]
    while todo:
        for dep in GRAPH.get(todo.pop(), ()):
            if dep not in seen:
                seen.add(dep)
                todo.append(dep)
    return seen


@pytest.mark.parametrize("room", NO_TORCH)
def test_head_node_rooms_never_reach_torch(room):
    """Statically, through every import (lazy ones too), no module of these rooms reaches torch."""
    bad = [m for m in GRAPH if _room(m) == room and "torch" in _reach(m)]
    assert not bad, f"{room}: these modules reach torch: {bad}"


@pytest.mark.parametrize("module", NO_TORCH_MODULES)
def test_head_node_modules_never_reach_torch(module):
    assert module in GRAPH, f"{module} is gone: update NO_TORCH_MODULES"
    assert "torch" not in _reach(module), f"{module} reaches torch"


def test_head_node_rooms_import_without_torch_at_run_time():
    """And at run time: importing every module of those rooms leaves torch out of sys.modules (the static check
    above could miss an import by importlib; this one could miss a lazy path: each covers the other)."""
    mods = sorted(m for m in GRAPH if _room(m) in NO_TORCH) + NO_TORCH_MODULES + ["llmcluster.cli.lineage"]
    code = ("import importlib, sys\n"
            f"for m in {mods!r}: importlib.import_module(m)\n"
            "assert 'torch' not in sys.modules, 'torch imported'\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=PKG.parent, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_no_core_module_imports_the_cli():
    bad = [f"{m} imports {d}" for m, d in _crossings() if _room(d) == "cli" and _room(m) not in {"cli", "__main__"}]
    assert not bad, "\n".join(bad)


def test_the_check_can_fail():
    """The graph reader sees function-level imports (the kind a quick grep for '^from' misses)."""
    assert "llmcluster.model.lora" in GRAPH["llmcluster.train.parallelize"]


def test_no_room_but_train_imports_ft():
    """ft is the training side of fault tolerance: launch renders and supervises the groups without it (no torch
    on the head node), and only the training loop drives a group."""
    above = {"train", "validate", "cli", "__main__"}
    bad = [f"{m} imports {d}" for m, d in _crossings() if _room(d) == "ft" and _room(m) not in above]
    assert not bad, "\n".join(bad)
