"""The inter-node fabric: a non-blocking, rail-optimised fat-tree sized from the switch radix.

Rail-optimised: NIC i of every node joins fabric (rail) i, so the same GPU index talks across nodes in
one switch hop; each rail is its own non-blocking fat-tree of k-port switches:
  one tier   E <= k            1 switch
  two tiers  E <= k^2/2        leaves E/(k/2) (half the ports down, half up), spines E/k
  three      E <= k^3/4        leaves E/(k/2), spines E/(k/2), cores E/k
When all nodes' NICs fit in one switch the rails share it. Bisection bandwidth of a non-blocking tree:
half the endpoints at full line rate. Every link is one cable with a transceiver at each end.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from llmcluster.config.gpus import FABRICS
from llmcluster.errors import UserError
from llmcluster.plan.spec import PlanCluster


@dataclass
class FatTree:
    rails: int
    endpoints: int          # NIC ports in the whole cluster
    tiers: int
    leaf: int
    spine: int
    core: int
    cables: int
    transceivers: int
    bisection_bandwidth_gbps: float   # Gb/s (line rate), all rails together

    @property
    def total(self) -> int:
        return self.leaf + self.spine + self.core


def fat_tree(cluster: PlanCluster) -> FatTree:
    k, rails, nodes = cluster.switch_radix, cluster.nics, cluster.nodes
    endpoints = rails * nodes
    line = FABRICS[cluster.fabric].line_gbit
    bisection = endpoints / 2 * line
    if endpoints <= k:  # one switch takes every rail
        return FatTree(rails, endpoints, 1, 1, 0, 0, endpoints, 2 * endpoints, bisection)
    e = nodes  # endpoints per rail
    if e <= k:
        tiers, leaf, spine, core = 1, 1, 0, 0
    elif e <= k * k // 2:
        tiers, leaf, spine, core = 2, math.ceil(e / (k // 2)), math.ceil(e / k), 0
    elif e <= k ** 3 // 4:
        tiers, leaf, spine, core = 3, math.ceil(e / (k // 2)), math.ceil(e / (k // 2)), math.ceil(e / k)
    else:
        raise UserError(f"cluster: {nodes} nodes per rail exceed a 3-tier fat-tree of radix {k} "
                        f"({k ** 3 // 4}); raise cluster.switch_radix")
    cables = endpoints * tiers  # node->leaf, plus one full set of uplinks per tier above
    return FatTree(rails, endpoints, tiers, leaf * rails, spine * rails, core * rails, cables, 2 * cables,
                   bisection)
