"""Power and cooling: IT load, facility load with PUE, heat, racks, and whether air can cool them."""

from __future__ import annotations

import math
from dataclasses import dataclass

from llmcluster.plan.spec import PlanCluster
from llmcluster.plan.tables import hardware

BTU_PER_H_PER_W = 3.412


@dataclass
class Power:
    node_kw: float          # provisioned (max) per node
    it_kw: float            # provisioned IT load: nodes x node max
    avg_it_kw: float        # while training: x Epoch's training load factor
    facility_kw: float      # it_kw x PUE
    btu_per_h: float        # heat to remove (all IT power ends as heat)
    nodes_per_rack: int
    racks: int
    rack_kw: float          # actual load of a full rack
    liquid_cooling: bool


def node_kw(cluster: PlanCluster) -> float:
    if cluster.node_power_kw:
        return cluster.node_power_kw
    return cluster.gpus_per_node * gpu_server_kw(cluster.spec)


def gpu_server_kw(spec) -> float:
    """A GPU's share of its server's maximum power (kW): its TDP × the server's overhead factor (Epoch AI)."""
    return spec.server_power_factor * spec.power_w / 1000


def training_energy_kwh(spec, gpu_hours: float) -> float:
    """The planner's estimate of the energy (IT load, before PUE) a training of `gpu_hours` on `spec` GPUs drew:
    each GPU's server share at the average training load (hardware.yaml's training_load), as `power` models it."""
    return gpu_hours * gpu_server_kw(spec) * hardware()["training_load"]


def power(cluster: PlanCluster, pue: float) -> Power:
    nk = node_kw(cluster)
    it = nk * cluster.nodes
    per_rack = max(1, int(cluster.rack_kw // nk))  # a node denser than the rack budget gets a rack alone
    racks = math.ceil(cluster.nodes / per_rack)
    rack_load = min(per_rack, cluster.nodes) * nk
    return Power(node_kw=nk, it_kw=it, avg_it_kw=it * hardware()["training_load"], facility_kw=it * pue,
                 btu_per_h=it * 1000 * BTU_PER_H_PER_W, nodes_per_rack=per_rack, racks=racks,
                 rack_kw=rack_load, liquid_cooling=rack_load > cluster.air_cooling_max_kw)
