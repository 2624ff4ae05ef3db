"""Communication: latency–bandwidth (alpha–beta) models of collectives.

Conventions: `nbytes` is the full message — the all-reduce input, the all-gather output, the
reduce-scatter input, one rank's all-to-all buffer, the point-to-point payload. `group` is the
number of ranks; a group of one costs nothing. A link's achieved bandwidth is its per-GPU,
per-direction bandwidth times its collective efficiency.

Algorithm (`collective_time`):
1. Ring (default): g−1 steps (2(g−1) for all-reduce), each paying the link latency; every rank
   sends (g−1)/g of the message (2(g−1)/g for all-reduce; a pipelined broadcast all of it) at
   the achieved bandwidth.
2. Tree (all-reduce, broadcast): ⌈log2 g⌉ latency steps each way; the pipelined double binary
   tree moves the whole message in and out once (2·N/B for all-reduce, N/B for broadcast).
3. Send/recv: one latency plus N/B.
4. Best (all-reduce, broadcast): the faster of ring and tree, as NCCL's tuner picks per message
   size (small messages: the tree's log-depth latency; large ones: the ring's bandwidth).

Algorithm (`hierarchical_time`, a group of k ranks in each of n nodes):
1. Reduce-scatter (or nothing, for all-gather) inside each node over the fast link.
2. The collective across nodes on 1/k of the message, the k node-local groups in parallel, each
   on its own NIC.
3. All-gather (or nothing, for reduce-scatter) inside each node.
4. Latency: the steps of one flat ring over all k·n ranks, each paced by the fabric's latency.
   Both terms are never below the same group's flat ring inside one node, so an axis that
   crosses nodes is never cheaper than the same axis inside one.
"""

from __future__ import annotations

import math
from dataclasses import replace

from cost.errors import CostInputError
from cost.hardware import Cluster, Link

KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv", "broadcast")


def collective_time(
    kind: str, nbytes: float, group: int, link: Link, *, algorithm: str = "ring"
) -> float:
    """Seconds for one collective of `nbytes` over `group` ranks on `link` (alpha–beta)."""
    _check(kind, nbytes, group, algorithm)
    if group == 1 or nbytes <= 0:
        return 0.0
    if algorithm == "best":
        return min(
            collective_time(kind, nbytes, group, link, algorithm=a) for a in ("ring", "tree")
        )
    alpha, bw = link.latency, link.achieved_bandwidth
    if kind == "send_recv":
        return alpha + nbytes / bw
    if algorithm == "tree" and kind in ("all_reduce", "broadcast"):
        passes = 2 if kind == "all_reduce" else 1
        return passes * math.ceil(math.log2(group)) * alpha + passes * nbytes / bw
    share = 1.0 if kind == "broadcast" else (group - 1) / group
    if kind == "all_reduce":
        return 2 * (group - 1) * alpha + 2 * share * nbytes / bw
    return (group - 1) * alpha + share * nbytes / bw


def hierarchical_time(kind: str, nbytes: float, per_node: int, nodes: int, intra: Link,
                      inter: Link) -> float:  # fmt: skip
    """Seconds for a collective over `per_node` ranks in each of `nodes` nodes (steps 1–3 for
    the bandwidth; the latency of one flat ring over all ranks, every step paced by the fabric)."""
    if kind in ("all_to_all", "send_recv", "broadcast") or per_node == 1 or nodes == 1:
        link = inter if nodes > 1 else intra
        return collective_time(kind, nbytes, per_node * nodes, link)
    wire_intra, wire_inter = replace(intra, latency=0.0), replace(inter, latency=0.0)
    across = collective_time(kind, nbytes / per_node, nodes, wire_inter)
    steps = (2 if kind == "all_reduce" else 1) * (per_node * nodes - 1)
    if kind == "all_reduce":
        inside = 2 * collective_time("reduce_scatter", nbytes, per_node, wire_intra)
    else:
        inside = collective_time(kind, nbytes, per_node, wire_intra)
    return steps * inter.latency + inside + across


def _check(kind: str, nbytes: float, group: int, algorithm: str) -> None:
    if kind not in KINDS:
        raise CostInputError(f"unknown collective {kind!r}; known: {', '.join(KINDS)}")
    if algorithm not in ("ring", "tree", "best"):
        raise CostInputError(
            f"unknown collective algorithm {algorithm!r}; use 'ring', 'tree' or 'best'"
        )
    if group < 1 or nbytes < 0:
        raise CostInputError(f"collective needs group >= 1 and nbytes >= 0, got {group}, {nbytes}")


def span_time(kind: str, nbytes: float, cluster: Cluster, stride: int, size: int) -> float:
    """Seconds for a collective over `size` ranks spaced `stride` apart in global rank order:
    one ring on NVLink inside a node, one ring on the fabric when each node holds a single
    member, and the hierarchical algorithm when each of several nodes holds several."""
    gpn = cluster.gpus_per_node
    if size == 1 or nbytes <= 0:  # no message, no collective (as `collective_time`)
        return 0.0
    if gpn % (stride * size) == 0:
        return collective_time(kind, nbytes, size, cluster.intra)
    per_node = max(1, min(size, gpn // stride))
    if per_node == 1 or size % per_node:
        return collective_time(kind, nbytes, size, cluster.inter)
    return hierarchical_time(kind, nbytes, per_node, size // per_node, cluster.intra, cluster.inter)


def exposed_behind(comm: float, window: float, busy: float = 0.0) -> float:
    """Seconds of a background transfer of `comm` seconds that a compute window of `window`
    seconds cannot hide, when other traffic keeps the same NIC busy for `busy` seconds of it.

    Derivation: the transfer runs concurrently with the compute and finishes at the later of
    the two; a NIC moves one stream's bytes at a time at full rate (or several at a shared
    rate: the same total), so the window offers max(0, window − busy) seconds of free wire and
    the rest of the transfer, max(0, comm − that), extends the step. Monotone non-decreasing in
    `comm` and `busy`, so a cheaper collective never prices a step higher.
    """
    return max(0.0, comm - max(0.0, window - busy))


def crosses_nodes(stride: int, size: int, gpus_per_node: int) -> bool:
    """Whether a group of `size` ranks `stride` apart leaves its node (rides the NIC)."""
    return size > 1 and gpus_per_node % (stride * size) != 0


def decomposed_time(nbytes: float, group: int, link: Link, chunk_s: float) -> float:
    """Seconds of a gather (or scatter) of `nbytes` over `group` ranks decomposed into ring
    steps under its matmuls (a collective matmul, autopar.ops.overlap), `chunk_s` the seconds
    of one step's partial matmul, communication included.

    Derivation: `group` steps each compute one chunk; every step but the last also moves one
    chunk (alpha + nbytes / group / bw) to the next rank, concurrently, so such a step takes
    the longer of the two and the last step only computes.  The unfused pair takes the
    collective (`collective_time`: the same group - 1 hops back to back) plus the whole
    matmul; the difference is the communication the decomposition hides."""
    hop = link.latency + nbytes / group / link.achieved_bandwidth
    return (group - 1) * max(chunk_s, hop) + chunk_s
