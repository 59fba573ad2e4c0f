"""Find, read and validate the cluster spec: `--cluster FILE|NAME`, then $LLMCLUSTER_CLUSTER, then ./cluster.yaml,
then the built-in one-node local default. Loaded like the job config (YAML, `--set`, closest-key hints, one line).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from llmcluster.config.cluster import ClusterSpec, old_format_key
from llmcluster.config.load import apply_overrides, check_kind, read_yaml, validate
from llmcluster.errors import UserError
from llmcluster.paths import STORAGE_ENV, locate_shipped, resolve_storage_root

CLUSTER_ENV = "LLMCLUSTER_CLUSTER"
LOCAL_FILE = "cluster.yaml"
DEFAULT_SOURCE = "built-in default (one local node)"


@dataclass(frozen=True)
class ResolvedCluster:
    spec: ClusterSpec
    source: str                      # the file, or DEFAULT_SOURCE
    how: str                         # "--cluster", "$LLMCLUSTER_CLUSTER", "./cluster.yaml" or "default"
    data: dict[str, Any] = field(default_factory=dict)      # what the file said (before overrides)
    overrides: list[str] = field(default_factory=list)

    @property
    def is_default(self) -> bool:
        return self.how == "default"


def locate_cluster(ref: str | Path) -> Path:
    """A cluster file, or the name of one shipped with the package (seed-a100, h200-8x, rtx4090-box)."""
    return locate_shipped("clusters", ref, "cluster")


def check_format(data: dict[str, Any], source: str) -> None:
    old = old_format_key(data)
    if old:
        raise UserError(f"{source}: '{old[0]}' is from an old cluster format: use {old[1]} (see docs/cluster.md)")


def _nodes_override(data: dict[str, Any], overrides: list[str]) -> None:
    """`--set nodes.count=16` on a spec that lists hosts (or the reverse) replaces the node list: planning explores
    sizes the host list does not have."""
    for item in overrides:
        key = item.split("=", 1)[0].strip()
        nodes = data.get("nodes")
        if isinstance(nodes, dict):
            if key == "nodes.count":
                nodes.pop("hosts", None)
                nodes.pop("overrides", None)
            elif key == "nodes.hosts":
                nodes.pop("count", None)


def cluster_from_data(data: dict[str, Any], source: str, overrides: list[str] | None = None) -> ClusterSpec:
    """Validate a cluster mapping (a file's, or a plan's inline `cluster:` section) with `--set` applied."""
    check_kind(data, source, "cluster spec")   # first: a plan's `cluster:` is not an old-format cluster spec
    check_format(data, source)
    overrides = list(overrides or [])
    _nodes_override(data, overrides)
    apply_overrides(data, overrides, ClusterSpec)
    return validate(data, ClusterSpec, source)


def read_cluster_file(ref: str | Path) -> tuple[Path, dict[str, Any]]:
    path = locate_cluster(ref)
    return path, read_yaml(path, "cluster spec")


def find_cluster(ref: str | None = None, environ: dict[str, str] | None = None,
                 cwd: Path | None = None) -> tuple[Path | None, str]:
    """(path, how) by the resolution order; (None, 'default') when nothing names a cluster."""
    environ = os.environ if environ is None else environ
    if ref:
        return locate_cluster(ref), "--cluster"
    if environ.get(CLUSTER_ENV):
        return locate_cluster(environ[CLUSTER_ENV]), f"${CLUSTER_ENV}"
    local = (cwd or Path.cwd()) / LOCAL_FILE
    if local.is_file():
        return local, f"./{LOCAL_FILE}"
    return None, "default"


def load_cluster(ref: str | None = None, overrides: list[str] | None = None, *,
                 environ: dict[str, str] | None = None, cwd: Path | None = None) -> ResolvedCluster:
    """The resolved, validated cluster spec (see the module docstring for the order)."""
    path, how = find_cluster(ref, environ, cwd)
    data = read_yaml(path, "cluster spec") if path else {}
    source = str(path) if path else DEFAULT_SOURCE
    import copy

    spec = cluster_from_data(copy.deepcopy(data), source, overrides)
    return ResolvedCluster(spec=spec, source=source, how=how, data=data, overrides=list(overrides or []))


def storage_root(cli_root: str | None = None, config_root: str | None = None, cluster: str | None = None) -> Path:
    """The storage root every command reads and writes: --root, else $LLMCLUSTER_STORAGE, else the job config's
    run.storage, else the cluster spec's storage.root (--cluster, $LLMCLUSTER_CLUSTER, ./cluster.yaml), else
    ./storage. One order for all, so `jobs`, `export` or `eval` find what `launch` or `train` wrote under the
    cluster's /storage (they looked in ./storage while launch wrote to the cluster's root)."""
    if cli_root or os.environ.get(STORAGE_ENV) or config_root:
        return resolve_storage_root(cli_root, config_root)
    return resolve_storage_root(None, load_cluster(cluster).spec.storage.root)


def origins(resolved: ResolvedCluster) -> list[tuple[str, Any, str]]:
    """(dotted key, resolved value, where it came from) for every leaf of the resolved spec, for `cluster show`."""
    from llmcluster.config.load import parse_override

    set_keys = {".".join(parse_override(o)[0]) for o in resolved.overrides}
    dumped = resolved.spec.model_dump(mode="json", by_alias=True)
    rows: list[tuple[str, Any, str]] = []

    def given(path: list[str]) -> bool:
        node: Any = resolved.data
        for part in path:
            if not isinstance(node, dict) or part not in node:
                return False
            node = node[part]
        return True

    def walk(node: Any, path: list[str]) -> None:
        if isinstance(node, dict) and node and not _free_form(path):
            for k, v in node.items():
                walk(v, path + [k])
            return
        key = ".".join(path)
        replaced_nodes = path[:1] == ["nodes"] and any(s in ("nodes.count", "nodes.hosts") for s in set_keys)
        if replaced_nodes or any(key == s or key.startswith(s + ".") or s.startswith(key + ".") for s in set_keys):
            where = "--set"
        elif given(path):
            where = resolved.source
        else:
            where = "default"
        rows.append((key, node, where))

    walk(dumped, [])
    return rows


def _free_form(path: list[str]) -> bool:
    """Mappings shown as one value: their keys are the user's (node selector labels, per-area entries)."""
    return path[-1:] in (["node_selector"], ["overrides"]) or path[:2] == ["storage", "kubernetes"] \
        or path[:2] == ["storage", "areas"]
