"""Collective communication costs, with nccl-tests' bus-bandwidth factors (doc/PERFORMANCE.md).

nccl-tests report algbw = S / t and busbw = algbw x factor, where the factor makes busbw comparable to
the link bandwidth whatever the rank count: all_reduce 2(n-1)/n; reduce_scatter, all_gather, all_to_all
(n-1)/n; broadcast, reduce 1. So a collective of S bytes over n ranks takes factor x S / busbw, plus a
latency term (a tree's log2 n steps: NCCL switches to trees where rings' 2(n-1) steps would dominate).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from llmcluster.plan.spec import PlanSpec

BUS_FACTORS = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
    "reduce": lambda n: 1.0,
}


def bus_bandwidth(kind: str, ranks: int, size_bytes: float, time_s: float) -> tuple[float, float]:
    """(algbw, busbw) in GB/s, exactly as nccl-tests prints them."""
    algbw = size_bytes / time_s / 1e9
    return algbw, algbw * BUS_FACTORS[kind](ranks)


def collective_time(kind: str, ranks: int, size_bytes: float, busbw_GBps: float, latency_s: float) -> float:
    if ranks <= 1 or size_bytes <= 0:
        return 0.0
    return BUS_FACTORS[kind](ranks) * size_bytes / (busbw_GBps * 1e9) + latency_s * math.ceil(math.log2(ranks))


@dataclass(frozen=True)
class Link:
    busbw_GBps: float
    latency_s: float
    inter_node: bool


@dataclass(frozen=True)
class Links:
    """The link each parallel group's collectives run over (ranks ordered tp, dp, pp: TP innermost)."""
    tp: Link
    dp: Link
    pp: Link
    intra_busbw_GBps: float
    node_nic_GBps: float     # all NICs of one node together


def plan_links(plan: PlanSpec) -> Links:
    from llmcluster.config.gpus import FABRICS, PCIE_ALLREDUCE_BUSBW_GBPS

    c, p = plan.cluster, plan.parallel
    kind = c.intra_node or ("nvlink" if c.spec.nvlink_gbps else "pcie")
    intra = c.intra_node_busbw_GBps or (c.spec.allreduce_busbw_GBps if kind == "nvlink" else PCIE_ALLREDUCE_BUSBW_GBPS)
    if c.fabric not in FABRICS:
        from llmcluster.errors import UserError
        raise UserError(f"cluster.fabric: unknown fabric '{c.fabric}': expected one of {', '.join(FABRICS)}")
    nic = c.nic_GBps or FABRICS[c.fabric].achieved_GBps
    node_nic = c.nics * nic
    intra_link = Link(intra, c.intra_latency_us * 1e-6, False)
    g = c.gpus_per_node

    def group_link(size: int, stride: int) -> Link:
        """A group of `size` ranks `stride` apart: inside one node, or sharing the node's NICs."""
        if size * stride <= g:
            return intra_link
        local = max(1, min(size, g // stride))  # members of one group on the same node
        # NCCL splits a multi-node collective over the node's NICs; groups running at the same time
        # (one per `local`-sized slice of the node) share them.
        bw = min(intra, node_nic * local / g) if local > 1 else node_nic / g
        return Link(bw, c.inter_latency_us * 1e-6, True)

    dp = plan.dp
    return Links(tp=group_link(p.tp, 1), dp=group_link(dp, p.tp), pp=group_link(p.pp, p.tp * dp),
                 intra_busbw_GBps=intra, node_nic_GBps=node_nic)
