"""Interleaved fused projections (issue 20.3): CodeGen's fused QKV lays its columns out as 4
groups, each with its heads' q, v and k.  With more ranks than groups (tp=8), every group is
split over the axis: the QKV columns split blocked by 12 (4 groups x q, v, k), the heads and
the output projection's rows blocked by 4, and the layer keeps Megatron's one all-reduce."""

from __future__ import annotations

import dataclasses
import warnings

from autopar import Mesh, autoparallelize
from autopar.tools import zoo
from autopar.verify import verify


def test_codegen_groups_split_over_eight_ranks_match_single_device():
    """The plan is chosen at a shape where splitting the groups wins (h 1024, 32 heads, s 512)
    and reused on a tiny build (h 256, 32 heads), whose outputs and every gradient must equal
    one device's; forward, each layer moves only its one [b,s,h] all-reduce."""
    entry = zoo.family("codegen")
    big = dataclasses.replace(zoo.TINY, hidden=1024, heads=32, kv_heads=32, ffn=2048, seq=512)
    small = dataclasses.replace(zoo.TINY, hidden=256, heads=32, kv_heads=32, ffn=512)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with zoo.tiny_as(big):
            model, args, kwargs, loss_fn = zoo.build(entry, "tiny")
            prog = autoparallelize(model, Mesh(tp=8), args, loss_fn, example_kwargs=kwargs)
        layer = [c for c in prog.collectives() if c.direction == "fwd" and ".h.0" in c.where]
        assert [(c.kind, c.shape) for c in layer] == [("all_reduce", (2, 512, 1024))], layer
        qkv = [n for n in prog.graph_module.graph.nodes if n.name.endswith("qkv_proj_weight")]
        assert qkv and all("'tp:12'" in str(n.meta["autopar"].layout) for n in qkv)
        with zoo.tiny_as(small):
            model, args, kwargs, loss_fn = zoo.build(entry, "tiny")
        report = verify(model, Mesh(tp=8), args, loss_fn, example_kwargs=kwargs, plan=prog.plan)
    assert report.ok, str(report)
