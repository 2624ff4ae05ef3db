"""The cluster as a graph: which links an axis's groups span and what its collectives cost."""

from __future__ import annotations

import pytest

from autopar.planner.auto import plan_shape
from cost.comm import collective_time
from cost.hardware import Cluster
from cost.topology import Topology

H100 = Cluster.preset("dgx-h100", nodes=64)


def test_graph_has_gpus_nvswitches_nics_rail_leaves_and_a_spine():
    topo = Topology(cluster=Cluster.preset("dgx-h100", nodes=4))
    kinds = [v[0] if isinstance(v, tuple) else v for v in topo.graph.nodes]
    assert kinds.count("gpu") == kinds.count("nic") == 32
    assert kinds.count("nvswitch") == 4 and kinds.count("spine") == 1
    assert kinds.count("leaf") == 8  # one pod of 4 nodes, one leaf per rail
    assert len(Topology(cluster=Cluster.preset("dgx-h100", nodes=4), rails=False).graph) == 70
    # same rail, other node: GPU → NIC → rail leaf → NIC → GPU, no spine
    assert topo.path(0, 8) == [("gpu", 0), ("nic", 0), ("leaf", 0, 0), ("nic", 8), ("gpu", 8)]
    # another rail: over the far node's NVSwitch (PXN), not up to the spine
    assert topo.path(0, 9)[-3:] == [("gpu", 8), ("nvswitch", 1), ("gpu", 9)]
    assert "spine" in Topology(cluster=Cluster.preset("dgx-h100", nodes=64)).path(0, 33 * 8)


def test_a_tp_group_straddling_two_nodes_pays_the_fabric():
    topo = Topology(cluster=H100)
    inside = topo.collective("all_reduce", 64e6, 1, 8)
    straddling = topo.collective("all_reduce", 64e6, 1, 16)
    assert inside == pytest.approx(collective_time("all_reduce", 64e6, 8, H100.intra))
    assert straddling > 1.5 * inside
    assert set(topo.links("all_reduce", 64e6, 1, 16)) == {"nvlink4", "ib-ndr-400g"}
    assert topo.links("all_reduce", 64e6, 1, 8) == {"nvlink4": 1.0}


def test_rail_optimised_fabric_makes_same_rail_groups_cheaper():
    rails = Topology(cluster=H100, rails=True, oversubscription=2.0)
    tor = Topology(cluster=H100, rails=False, oversubscription=2.0)
    # 8 GPUs with the same local index in 8 nodes: one rail leaf vs. leaf–spine–leaf
    assert set(rails.classes(8, 8)) == {"leaf"} and "spine" in tor.classes(8, 8)
    assert rails.collective("all_reduce", 64e6, 8, 8) < tor.collective("all_reduce", 64e6, 8, 8)
    # beyond one pod both climb to the spine
    assert "spine" in rails.classes(8 * 32, 2)
    assert rails.links("all_reduce", 64e6, 8, 64) == {"ib-ndr-400g via spine": 1.0}


def test_plan_prints_the_links_each_axis_rides_and_their_share():
    plan = plan_shape("llama3-70b", Cluster.preset("dgx-h100", nodes=8), 256)
    rows = plan.links()
    assert rows and all(seconds >= 0 for _, _, seconds in rows)
    assert sum(s for *_, s in rows) == pytest.approx(sum(plan.best.step.comm.values()), rel=1e-9)
    text = str(plan)
    assert "links: exposed communication per axis" in text
    for axis, link, _ in rows:
        assert any(line.split()[:1] == [axis] and link in line for line in text.splitlines())
