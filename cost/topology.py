"""The cluster as a graph: GPUs, NVSwitch domains, NICs on rails, leaf and spine switches.

A mesh axis's process groups are mapped onto the graph and each collective is priced by the
links its group actually spans.

Algorithm (`Topology.build`):
1. One vertex per GPU and one NVSwitch per node; GPU–NVSwitch edges are the node's intra link.
2. One NIC per GPU (GPU–NIC edge). Rail-optimised fabric: the NIC of local GPU i of every node
   in a pod (`nodes_per_leaf` nodes, 32 in a SuperPOD unit) plugs into that pod's leaf switch
   of rail i; otherwise (top-of-rack) every NIC of a node plugs into its pod's single leaf
   (4 nodes of 8 NICs). NIC–leaf edges are the inter-node link.
3. Every leaf connects to the spine (one vertex for the spine layer); leaf–spine edges weigh 2
   (two switch traversals) and carry the fabric's bandwidth over the spine's
   oversubscription. Within a pod another rail is cheaper through the far node's NVSwitch.

Algorithm (`Topology.collective`, a group of `size` ranks `stride` apart in rank order):
1. The group's ring pairs: consecutive members inside a node, and across nodes the pairs that
   carry the inter-node step (members with the same local index in consecutive nodes when each
   node holds several: the node-local groups run in parallel, one per NIC; else consecutive
   members), wrap-around included. The first and the last group of the axis are walked.
2. Each pair's path is the graph's shortest path (cached per pair class: same node, same leaf,
   through the spine); the group rides the union of the paths' edge kinds.
3. Price: a group inside one NVSwitch domain runs the ring on the intra link. Otherwise the
   two-level algorithm (`cost.comm.span_time`) runs on the fabric link whose latency grows by
   `SWITCH_HOP_S` per switch beyond the first on the longest path and whose bandwidth is
   divided by the oversubscription when a path climbs to the spine.
4. `links` names what an axis rides and splits its time between the NVSwitch and the fabric
   (the hierarchical algorithm's inside-node and across-node parts).

Algorithm (`Topology.nccl_advice`, the NCCL settings the pricing assumed; printed, never set):
1. An axis whose groups stay in one node on NVLink 4 or later with more than two members has
   its all-reduce priced on the NVSwitch: NVLink SHARP (NVLS) does it in the switch.
2. An axis that crosses nodes on a rail-optimised fabric is priced ring-per-rail, one NIC per
   GPU, and another rail reached over the far node's NVSwitch (PXN): rings stay on their rail
   (`NCCL_CROSS_NIC=0`), every NIC is listed in GPU order (`NCCL_IB_HCA`), PXN on. On a
   top-of-rack fabric every NIC reaches the same leaf, so rings may cross NICs.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import cached_property

import networkx as nx

from cost.comm import collective_time, span_time
from cost.hardware import Cluster, Link

SWITCH_HOP_S = 0.5e-6  # extra latency per InfiniBand switch traversed beyond the first
NODES_PER_LEAF_RAIL = 32  # a DGX SuperPOD scalable unit: 32 nodes per rail leaf
NODES_PER_LEAF_TOR = 4  # top-of-rack: a 32-port leaf takes the 8 NICs of 4 nodes


@dataclass(frozen=True, kw_only=True)
class Topology:
    """The cluster's graph and the collective prices it implies."""

    cluster: Cluster
    rails: bool = True
    nodes_per_leaf: int | None = None
    oversubscription: float = 1.0
    _cache: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def pod(self) -> int:
        """Nodes under one leaf switch."""
        default = NODES_PER_LEAF_RAIL if self.rails else NODES_PER_LEAF_TOR
        return self.nodes_per_leaf or default

    @cached_property
    def graph(self) -> nx.Graph:
        """GPU, NVSwitch, NIC, leaf and spine vertices; edges typed by `kind` (step 1-3)."""
        c, g = self.cluster, nx.Graph()
        g.add_node("spine", kind="switch")
        for node in range(c.nodes):
            nvs = ("nvswitch", node)
            for local in range(c.gpus_per_node):
                rank = node * c.gpus_per_node + local
                leaf = self._leaf(node, local)
                g.add_edge(("gpu", rank), nvs, kind="nvlink", link=c.intra.name)
                g.add_edge(("gpu", rank), ("nic", rank), kind="pcie", link="pcie")
                g.add_edge(("nic", rank), leaf, kind="nic", link=c.inter.name)
                g.add_edge(leaf, "spine", kind="spine", link=f"{c.inter.name} spine", weight=2)
        return g

    def _leaf(self, node: int, local: int) -> tuple:
        pod = node // self.pod
        return ("leaf", pod, local) if self.rails else ("leaf", pod)

    def _pair_class(self, a: int, b: int) -> str:
        """What the path between ranks a and b climbs to: its node's NVSwitch, its pod's leaf
        (another rail is reached over the far node's NVSwitch, as NCCL's PXN does), or the
        spine. The same answer as `path`, without a graph search per pair."""
        gpn = self.cluster.gpus_per_node
        if a // gpn == b // gpn:
            return "node"
        return "leaf" if a // gpn // self.pod == b // gpn // self.pod else "spine"

    def path(self, a: int, b: int) -> list:
        """Vertices of the cheapest path between GPU ranks a and b (a spine link weighs 2)."""
        return nx.shortest_path(self.graph, ("gpu", a), ("gpu", b), weight="weight")

    def _pairs(self, stride: int, size: int, first: int) -> list[tuple[int, int]]:
        """Ring pairs of the group starting at rank `first` (step 1)."""
        gpn = self.cluster.gpus_per_node
        members = [first + i * stride for i in range(size)]
        pairs = list(zip(members, members[1:] + members[:1], strict=True))
        per_node = max(1, min(size, gpn // stride))
        if gpn % (stride * size) == 0 or per_node == 1 or size % per_node:
            return pairs
        heads = members[::per_node]  # same local index in consecutive nodes, one per NIC
        return pairs[: per_node - 1] + list(zip(heads, heads[1:] + heads[:1], strict=True))

    def classes(self, stride: int, size: int) -> dict[str, tuple[int, int]]:
        """Pair class → one example pair, over the axis's first and last group (step 1-2)."""
        key = ("classes", stride, size)
        if key not in self._cache:
            last = self.cluster.world_size - 1 - (size - 1) * stride
            found: dict[str, tuple[int, int]] = {}
            for first in sorted({0, max(last, 0)}):
                for a, b in self._pairs(stride, size, first):
                    found.setdefault(self._pair_class(a, b), (a, b))
            self._cache[key] = found
        return self._cache[key]

    def switches(self, a: int, b: int) -> int:
        """Switches on the path between GPU ranks a and b (NVSwitch not counted)."""
        return sum(1 for v in self.path(a, b) if v == "spine" or v[0] == "leaf")

    def fabric(self, stride: int, size: int) -> Link:
        """The inter-node link as this group sees it: hop latency, spine oversubscription."""
        key = ("fabric", stride, size)
        if key not in self._cache:
            inter, hops = self.cluster.inter, 1
            for a, b in self.classes(stride, size).values():
                if a // self.cluster.gpus_per_node != b // self.cluster.gpus_per_node:
                    hops = max(hops, self.switches(a, b))
            if hops > 1:
                inter = replace(inter, latency=inter.latency + (hops - 1) * SWITCH_HOP_S,
                                bandwidth=inter.bandwidth / self.oversubscription)  # fmt: skip
            self._cache[key] = inter
        return self._cache[key]

    def collective(self, kind: str, nbytes: float, stride: int, size: int) -> float:
        """Seconds of one collective over the group (step 3)."""
        if size == 1:
            return 0.0
        gpn = self.cluster.gpus_per_node
        if gpn % (stride * size) == 0:
            return collective_time(kind, nbytes, size, self.cluster.intra)
        cluster = replace(self.cluster, inter=self.fabric(stride, size))
        return span_time(kind, nbytes, cluster, stride, size)

    def links(self, kind: str, nbytes: float, stride: int, size: int) -> dict[str, float]:
        """Link name → share of this collective's time spent on it (step 4)."""
        if size == 1:
            return {}
        c, gpn = self.cluster, self.cluster.gpus_per_node
        if gpn % (stride * size) == 0:
            return {c.intra.name: 1.0}
        name = c.inter.name + (" via spine" if "spine" in self.classes(stride, size) else "")
        per_node = max(1, min(size, gpn // stride))
        total = self.collective(kind, nbytes, stride, size)
        if per_node == 1 or size % per_node or kind in ("all_to_all", "send_recv"):
            return {name: 1.0}
        wire = replace(c.intra, latency=0.0)
        inside = collective_time("reduce_scatter" if kind == "all_reduce" else kind, nbytes,
                                 per_node, wire) * (2 if kind == "all_reduce" else 1)  # fmt: skip
        share = min(1.0, inside / total) if total > 0 else 0.0
        return {c.intra.name: share, name: 1.0 - share}


NVLS_LINKS = ("nvlink4", "nvlink5")  # NVSwitch generations with NVLink SHARP


def nccl_advice(topology: Topology, axes: tuple[tuple[str, int], ...]) -> tuple[str, ...]:
    """The NCCL environment the topology's prices assume for the mesh `axes` (steps 1-2)."""
    c, out = topology.cluster, []
    inside = [a for a, s in axes if s > 2 and c.axis_in_node(axes, a)]
    if inside and c.intra.name in NVLS_LINKS:
        out.append(f"NCCL_NVLS_ENABLE=1: {', '.join(inside)}'s all-reduce runs in the NVSwitch "
                   f"(NVLink SHARP on {c.intra.name})")  # fmt: skip
    across = [a for a, s in axes if s > 1 and not c.axis_in_node(axes, a)]
    if not across:
        return tuple(out)
    names = ", ".join(across)
    if topology.rails:
        out += [f"NCCL_CROSS_NIC=0: {names} rings stay on their rail (GPU i's NIC to GPU i's "
                f"NIC, rail-optimised fabric)",
                f"NCCL_IB_HCA=<the node's {c.gpus_per_node} HCAs in GPU order, e.g. "
                f"mlx5_0,...,mlx5_{c.gpus_per_node - 1}>: one NIC per GPU, as {names} is priced",
                "NCCL_PXN_DISABLE=0: another rail is reached over the far node's NVSwitch "
                "(PXN), as priced"]  # fmt: skip
    else:
        out.append(f"NCCL_CROSS_NIC=1: top-of-rack fabric, {names} rings may use any NIC")
    return tuple(out)


def axis_links(topology: Topology, spans: dict, step_comm: dict[str, float],
               volumes: dict[str, tuple[str, float]]) -> list[tuple[str, str, float]]:  # fmt: skip
    """(axis, link, seconds) rows: each axis's exposed time split over the links it rides.
    `volumes` maps an axis to the (kind, bytes) of its typical collective."""
    rows = []
    for axis, seconds in step_comm.items():
        if seconds <= 0 or axis not in volumes:
            continue
        kind, nbytes = volumes[axis]
        stride, size = spans[axis]
        for link, share in topology.links(kind, nbytes, stride, size).items():
            rows.append((axis, link, seconds * share))
    return rows
