"""What Slurm is told about the cluster, derived from the cluster spec and the planner's fat-tree.

`slurm.conf` NodeName lines and `gres.conf` come from the spec's hardware (per-node overrides kept apart),
`topology.conf` from `plan/network.py`'s fat-tree for the same nodes, NICs and switch radix, so the scheduler
packs a job onto the fewest switches the planner priced. The roles' templates only format these lists.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from llmcluster.config.cluster import CPU_ONLY, ClusterSpec
from llmcluster.config.gpus import FABRICS
from llmcluster.config.hostlist import compress_hostlist
from llmcluster.errors import UserError

RDMA_FABRICS = tuple(name for name, f in FABRICS.items() if f.line_gbit)   # ib-*, roce-*: switched, with HCAs
# The OS, the daemons and the page cache keep this share of a node's memory; Slurm hands out the rest
# (a node whose RealMemory exceeds what it has is set DRAIN by slurmctld).
MEMORY_RESERVE = 0.10
# What a value in slurm.conf, gres.conf or topology.conf may hold: slurmctld reads a newline as a new directive
# and a space as a new key=value, and nothing there can be quoted.
SLURM_WORD = re.compile(r"[A-Za-z0-9._,\[\]-]+")


def check_words(*values) -> None:
    """Behind the spec's own validation: every string bound for Slurm's files is one word, or provision stops."""
    for v in values:
        if isinstance(v, dict):
            check_words(*v.values())
        elif isinstance(v, (list, tuple)):
            check_words(*v)
        elif isinstance(v, str) and not SLURM_WORD.fullmatch(v):
            raise UserError(f"{v!r} cannot go into slurm.conf (letters, digits and ._,[]- only)")


def gres_type(gpu: str) -> str:
    """Slurm GRES type for a GPU of the table: 'A100-80GB' -> 'a100-80gb' (srun --gres=gpu:a100-80gb:4)."""
    return gpu.lower()


@dataclass(frozen=True)
class NodeShape:
    gpus: int
    cpus: int | None        # None: the node's own count (Ansible's facts) at apply time
    memory_mb: int | None


def node_shape(spec: ClusterSpec, host: str) -> NodeShape:
    from llmcluster.config.hostlist import expand_hostlist

    cpus, mem = spec.hardware.cpus_per_node, spec.hardware.memory_gb
    for key, o in spec.nodes.overrides.items():
        if host in expand_hostlist(key):
            cpus = o.cpus_per_node or cpus
            mem = o.memory_gb or mem
    mem_mb = int(mem * 1024 * (1 - MEMORY_RESERVE)) if mem else None
    return NodeShape(spec.node_gpus(host), cpus, mem_mb)


def slurm_nodes(spec: ClusterSpec, hosts: list[str]) -> list[dict]:
    """NodeName groups: hosts of one shape in one hostlist line; hosts whose size comes from facts one each."""
    groups: dict[NodeShape, list[str]] = {}
    for h in hosts:
        groups.setdefault(node_shape(spec, h), []).append(h)
    out = []
    for shape, names in groups.items():
        chunks = [names] if shape.cpus and shape.memory_mb else [[n] for n in names]
        for chunk in chunks:
            out.append({"names": compress_hostlist(chunk), "hosts": chunk, "cpus": shape.cpus,
                        "memory_mb": shape.memory_mb, "gpus": shape.gpus,
                        "gpu_type": gres_type(spec.hardware.gpu) if shape.gpus else None})
    return out


def slurm_gres(nodes: list[dict]) -> list[dict]:
    return [{"names": n["names"], "gpus": n["gpus"], "gpu_type": n["gpu_type"]} for n in nodes if n["gpus"]]


def fat_tree_for(spec: ClusterSpec):
    """The planner's fat-tree for this cluster, or None when there is no switched RDMA fabric to model."""
    if spec.hardware.fabric not in RDMA_FABRICS or spec.hardware.gpu == CPU_ONLY:
        return None
    from llmcluster.plan.network import fat_tree
    from llmcluster.plan.spec import PlanCluster

    return fat_tree(PlanCluster.from_cluster(spec))


def topology_switches(spec: ClusterSpec, hosts: list[str]) -> tuple[list[dict], str]:
    """topology.conf's switches for one rail of the planner's fat-tree, and a one-line description.

    Rail-optimised rails are identical trees over the same nodes, so Slurm's one tree is rail 0's; when every
    NIC fits one switch the rails share it. Leaves take radix/2 nodes (the other half of the ports go up);
    in two tiers every spine reaches every leaf; in three, pods of radix/2 leaves share radix/2 spines and
    every core reaches every spine."""
    ft = fat_tree_for(spec)
    if ft is None:
        return [], ""
    k = spec.topology.switch_radix
    desc = (f"{ft.tiers} tier(s), {ft.total} switches for {ft.rails} rail(s): {ft.leaf} leaf, {ft.spine} spine, "
            f"{ft.core} core, radix {k}")
    if ft.total == 1 or ft.tiers == 1:
        return [{"name": "leaf01", "nodes": compress_hostlist(hosts)}], desc
    rails = ft.rails
    n_leaf, n_spine, n_core = ft.leaf // rails, ft.spine // rails, ft.core // rails
    per_leaf = k // 2
    leaves = [{"name": f"leaf{i + 1:02d}", "nodes": compress_hostlist(hosts[i * per_leaf:(i + 1) * per_leaf])}
              for i in range(n_leaf)]
    leaves = [s for s in leaves if s["nodes"]]
    leaf_names = [s["name"] for s in leaves]
    if ft.tiers == 2:
        spines = [{"name": f"spine{i + 1:02d}", "switches": ",".join(leaf_names)} for i in range(n_spine)]
        return leaves + spines, desc
    pod = k // 2
    spines = []
    for i in range(n_spine):
        p = i // pod
        members = leaf_names[p * pod:(p + 1) * pod]
        if members:
            spines.append({"name": f"spine{i + 1:02d}", "switches": ",".join(members)})
    cores = [{"name": f"core{i + 1:02d}", "switches": ",".join(s["name"] for s in spines)} for i in range(n_core)]
    return leaves + spines + cores, desc

