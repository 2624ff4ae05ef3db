from __future__ import annotations

import pytest

from autopar.ir.layout import PARTIAL, Layout, R, Shard, parse_placement
from autopar.rules import map_view


def test_layout_prints_per_dim_and_partial():
    assert str(Layout.from_placements(3, {"tp": Shard(2)})) == "P(None, None, 'tp')"
    assert str(Layout.from_placements(2, {"tp": PARTIAL})) == "P(None, None, partial=('tp',))"
    assert str(Layout.from_placements(2, {"tp": Shard(1, 3)})) == "P(None, 'tp:3')"
    two = Layout.from_placements(2, {"dp": Shard(0), "tp": Shard(0)})
    assert str(two) == "P(('dp', 'tp'), None)"


def test_layout_round_trips_placements_and_local_shape():
    lay = Layout.from_placements(3, {"tp": Shard(1, 3)})
    assert lay.placement("tp") == Shard(1, 3)
    assert lay.placement("dp") == R
    assert lay.local_shape((2, 96, 8), {"tp": 4}) == (2, 24, 8)
    assert Layout.replicate(2).is_replicated


@pytest.mark.parametrize("text", ["R", "P", "S(0)", "S(2:3)"])
def test_parse_placement_inverts_str(text):
    assert str(parse_placement(text)) == text


def test_parse_placement_rejects_garbage():
    with pytest.raises(ValueError, match="not a placement"):
        parse_placement("Q(1)")


def test_view_maps_split_dims_through_dim_groups():
    # [b, s, h] -> [b, s, heads, d]: splitting h splits the heads
    assert map_view((2, 8, 64), (2, 8, 4, 16), Shard(2), 2) == Shard(2)
    # fused QKV: [b, s, 3h] split in 3 blocks -> [b, s, 3, heads, d] split on heads
    assert map_view((2, 8, 192), (2, 8, 3, 4, 16), Shard(2, 3), 2) == Shard(3)
    # and back: merging (3, heads, d) with heads split gives a 3-block split
    assert map_view((2, 8, 3, 4, 16), (2, 8, 192), Shard(3), 2) == Shard(2, 3)
    # splitting the head dim d of [b, s, 4, 16] -> [b, s, 64] is not contiguous per rank
    assert map_view((2, 8, 4, 16), (2, 8, 64), Shard(3), 2) == Shard(2, 4)
    # partial sums and replicas pass through views unchanged
    assert map_view((4, 4), (16,), PARTIAL, 2) == PARTIAL
