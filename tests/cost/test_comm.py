"""Collective time models: hand-computed values and monotonicity properties."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cost.comm import (
    KINDS,
    collective_time,
    crosses_nodes,
    exposed_behind,
    hierarchical_time,
    span_time,
)
from cost.errors import CostInputError
from cost.hardware import CLUSTER_PRESETS, Cluster, Link

PROPERTY = settings(max_examples=80, deadline=None)
LINK = Link(name="test", bandwidth=100e9, latency=1e-5, efficiency=1.0)


@pytest.mark.parametrize(
    ("kind", "algorithm", "group", "expected"),
    [
        ("all_reduce", "ring", 4, 2 * 3 * 1e-5 + 2 * 3 / 4 * 0.01),
        ("all_gather", "ring", 4, 3 * 1e-5 + 3 / 4 * 0.01),
        ("reduce_scatter", "ring", 4, 3 * 1e-5 + 3 / 4 * 0.01),
        ("all_to_all", "ring", 4, 3 * 1e-5 + 3 / 4 * 0.01),
        ("send_recv", "ring", 2, 1e-5 + 0.01),
        ("broadcast", "ring", 4, 3 * 1e-5 + 0.01),
        ("all_reduce", "tree", 8, 2 * 3 * 1e-5 + 2 * 0.01),
        ("broadcast", "tree", 5, 3 * 1e-5 + 0.01),
    ],
)
def test_alpha_beta_hand_values(kind, algorithm, group, expected):
    assert collective_time(kind, 1e9, group, LINK, algorithm=algorithm) == pytest.approx(expected)


def test_link_efficiency_scales_bandwidth_term_only():
    slow = Link(name="half", bandwidth=100e9, latency=1e-5, efficiency=0.5)
    assert collective_time("all_gather", 1e9, 4, slow) == pytest.approx(3e-5 + 0.015)


def test_group_of_one_and_empty_message_are_free():
    assert collective_time("all_reduce", 1e9, 1, LINK) == 0.0
    assert collective_time("all_reduce", 0.0, 8, LINK) == 0.0


def test_bad_collective_input():
    with pytest.raises(CostInputError, match="unknown collective 'allreduce'"):
        collective_time("allreduce", 1.0, 2, LINK)
    with pytest.raises(ValueError, match="group >= 1"):
        collective_time("all_reduce", 1.0, 0, LINK)
    with pytest.raises(ValueError, match="algorithm 'mesh'"):
        collective_time("all_reduce", 1.0, 2, LINK, algorithm="mesh")


def test_hierarchical_all_reduce_hand_value():
    intra = Link(name="nv", bandwidth=300e9, latency=0.0)
    inter = Link(name="ib", bandwidth=25e9, latency=0.0)
    n = 8e9
    inside = 7 / 8 * n / 300e9  # reduce-scatter, then the same again as all-gather
    across = 2 * 3 / 4 * (n / 8) / 25e9  # all-reduce of one eighth over 4 nodes
    assert hierarchical_time("all_reduce", n, 8, 4, intra, inter) == pytest.approx(
        2 * inside + across
    )
    assert hierarchical_time("all_gather", n, 8, 4, intra, inter) == pytest.approx(
        inside + 3 / 4 * (n / 8) / 25e9
    )


def test_span_time_picks_ring_or_hierarchy():
    c = Cluster.preset("dgx-a100", nodes=4)
    n = 1e9
    assert span_time("all_reduce", n, c, 1, 8) == collective_time("all_reduce", n, 8, c.intra)
    assert span_time("all_reduce", n, c, 8, 4) == collective_time("all_reduce", n, 4, c.inter)
    assert span_time("all_reduce", n, c, 1, 32) == hierarchical_time(
        "all_reduce", n, 8, 4, c.intra, c.inter
    )
    assert span_time("all_reduce", n, c, 1, 1) == 0.0


kinds = st.sampled_from(KINDS)
algorithms = st.sampled_from(["ring", "tree"])
sizes = st.floats(min_value=0.0, max_value=1e11)
groups = st.integers(min_value=1, max_value=4096)
bandwidths = st.floats(min_value=1e8, max_value=1e13)


@PROPERTY
@given(kind=kinds, algorithm=algorithms, n1=sizes, n2=sizes, group=groups, bw=bandwidths)
def test_time_never_falls_as_bytes_rise(kind, algorithm, n1, n2, group, bw):
    link = Link(name="l", bandwidth=bw, latency=5e-6)
    lo, hi = sorted((n1, n2))
    assert collective_time(kind, lo, group, link, algorithm=algorithm) <= collective_time(
        kind, hi, group, link, algorithm=algorithm
    )


@PROPERTY
@given(kind=kinds, algorithm=algorithms, n=sizes, g1=groups, g2=groups, bw=bandwidths)
def test_time_never_falls_as_group_rises(kind, algorithm, n, g1, g2, bw):
    link = Link(name="l", bandwidth=bw, latency=5e-6)
    lo, hi = sorted((g1, g2))
    assert collective_time(kind, n, lo, link, algorithm=algorithm) <= collective_time(
        kind, n, hi, link, algorithm=algorithm
    )


@PROPERTY
@given(kind=kinds, algorithm=algorithms, n=sizes, group=groups, b1=bandwidths, b2=bandwidths)
def test_time_never_falls_as_bandwidth_falls(kind, algorithm, n, group, b1, b2):
    slow, fast = sorted((b1, b2))
    t_slow = collective_time(kind, n, group, Link(name="s", bandwidth=slow, latency=5e-6),
                             algorithm=algorithm)  # fmt: skip
    t_fast = collective_time(kind, n, group, Link(name="f", bandwidth=fast, latency=5e-6),
                             algorithm=algorithm)  # fmt: skip
    assert t_fast <= t_slow


@PROPERTY
@given(preset=st.sampled_from(sorted(CLUSTER_PRESETS)), kind=kinds, n=sizes,
       size=st.sampled_from([2, 4, 8]), outer=st.sampled_from([2, 4, 8, 16]))  # fmt: skip
def test_axis_crossing_nodes_is_never_cheaper_than_inside_one(preset, kind, n, size, outer):
    cluster = Cluster.preset(preset, nodes=outer)
    inside = [("other", outer), ("x", size)]  # x innermost: its groups stay in a node
    crossing = [("x", size), ("other", outer * 8 // size)]  # x outermost: crosses nodes
    assert cluster.axis_link(inside, "x") is cluster.intra
    assert cluster.axis_link(crossing, "x") is cluster.inter
    t_in = span_time(kind, n, cluster, *cluster.axis_span(inside, "x"))
    t_cross = span_time(kind, n, cluster, *cluster.axis_span(crossing, "x"))
    assert t_in <= t_cross
    assert collective_time(kind, n, size, cluster.intra) <= collective_time(
        kind, n, size, cluster.inter
    )


def test_exposed_behind_hides_only_up_to_the_free_window():
    assert exposed_behind(1.0, 3.0) == 0.0  # fully hidden
    assert exposed_behind(3.0, 1.0) == pytest.approx(2.0)  # the excess extends the step
    assert exposed_behind(1.0, 3.0, busy=2.5) == pytest.approx(0.5)  # NIC busy with other traffic
    assert exposed_behind(1.0, 3.0, busy=5.0) == pytest.approx(1.0)  # no free wire at all
    # monotone in the transfer and in the competing traffic
    grid = [0.0, 0.5, 1.0, 2.0, 4.0]
    for window in grid:
        for busy in grid:
            values = [exposed_behind(c, window, busy) for c in grid]
            assert values == sorted(values)
            assert exposed_behind(1.0, window, busy) <= exposed_behind(1.0, window, busy + 1.0)


def test_crosses_nodes_by_span():
    assert not crosses_nodes(1, 8, 8) and not crosses_nodes(4, 2, 8)
    assert crosses_nodes(8, 2, 8) and crosses_nodes(4, 4, 8) and crosses_nodes(1, 16, 8)
    assert not crosses_nodes(64, 1, 8)  # a group of one rides nothing


@PROPERTY
@given(kind=st.sampled_from(["all_reduce", "broadcast"]), n=sizes, group=groups, bw=bandwidths)
def test_best_is_the_faster_of_ring_and_tree(kind, n, group, bw):
    link = Link(name="x", bandwidth=bw, latency=5e-6, efficiency=0.8)
    ring, tree = (collective_time(kind, n, group, link, algorithm=a) for a in ("ring", "tree"))
    assert collective_time(kind, n, group, link, algorithm="best") == min(ring, tree)
