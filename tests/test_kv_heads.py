"""Grouped-query attention with fewer K/V heads than ranks (REFERENCE.md, g < t): the K/V
projections split into g pieces, each shared by t/g ranks (``S(0)x(t/g)``), every rank reads
the K/V head its query heads use, no forward communication for K/V, and the weight gradient
of a piece is summed over the ranks sharing it (``grad_sum_shared``)."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest
import torch

from autopar import Mesh, autoparallelize
from autopar.codegen import shard_tensor, unshard_tensors
from autopar.frontend.fused import split_fused_projections
from autopar.frontend.trace import Piece, join_pieces, trace
from autopar.ir import meta
from autopar.ir.layout import Layout, Shard, parse_placement
from autopar.ops import collectives as C
from autopar.runtime.checkpoints import ShardSpec, global_pieces, tensor_pieces
from autopar.tools import zoo
from autopar.tools.testing import Config, build, lm_loss, run_rank_scripts, tokens
from autopar.verify import verify

aten = torch.ops.aten


def test_shared_split_prints_parses_and_slices():
    lay = Layout.from_placements(2, {"tp": Shard(0, rep=2)})
    assert str(lay) == "P('tp'x2, None)"
    assert lay.placement("tp") == Shard(0, 1, 2) and str(lay.placement("tp")) == "S(0)x2"
    assert parse_placement("S(1)x4") == Shard(1, 1, 4)
    assert lay.local_shape((4, 3), {"tp": 8}) == (1, 3)
    mesh = Mesh(tp=8)
    w = torch.arange(12.0).reshape(4, 3)
    coords = [{"tp": r} for r in range(8)]
    shards = [shard_tensor(w, lay, mesh, c) for c in coords]
    assert [int(s[0, 0]) // 3 for s in shards] == [0, 0, 1, 1, 2, 2, 3, 3]  # piece r // 2
    assert torch.equal(unshard_tensors(shards, lay, mesh, coords), w)


def test_checkpoint_pieces_of_a_shared_split_are_the_pieces_of_its_head():
    """Every rank saves its piece at the piece's global offset; the rep ranks sharing it save
    the same values there (DCP keeps one)."""
    lay, mesh = Layout.from_placements(2, {"tp": Shard(0, rep=2)}), Mesh(tp=4)
    full = torch.randn(8, 3)
    out, cover = torch.zeros(8, 3), torch.zeros(8, 3)
    for r in range(4):
        coords = mesh.coordinates(r)
        spec = ShardSpec(shape=(8, 3), padded=(8, 3), layout=lay, sizes={"tp": 4}, coords=coords)
        for offsets, view in global_pieces(shard_tensor(full, lay, mesh, coords), spec, 0):
            out[offsets[0] : offsets[0] + view.shape[0]] = view
            cover[offsets[0] : offsets[0] + view.shape[0]] += 1
    assert torch.equal(out, full) and bool((cover == 2).all())


def test_repeat_kv_becomes_grouped_query_attention():
    model, args, kwargs, _ = zoo.build(zoo.family("llama"), "tiny")
    gm = trace(model, args, kwargs).gm
    sdpa = [n for n in gm.graph.nodes if n.target is aten.scaled_dot_product_attention.default]
    assert sdpa and all(n.kwargs.get("enable_gqa") for n in sdpa)
    assert all(n.args[1].meta["val"].shape[1] == 2 for n in sdpa)  # the 2 K/V heads, unrepeated
    assert not [n for n in gm.graph.nodes if n.target is aten.expand.default]


def _compile(tp: int, heads: int, kv_heads: int, fused_qkv: bool = False):
    c = Config(heads=heads, kv_heads=kv_heads, fused_qkv=fused_qkv)
    model = build("llama", c)
    return model, c, autoparallelize(model, Mesh(tp=tp), tokens(c), loss_fn=lm_loss)


def test_kv_projection_is_shared_by_the_ranks_of_its_head():
    _, _, prog = _compile(8, 8, 2)
    lay = {prog.traced.params[n.name]: str(n.meta["autopar"].layout)
           for n in prog.graph_module.graph.nodes if n.name in prog.traced.params}  # fmt: skip
    assert lay["layers.0.wk.weight"] == "P('tp'x4, None)"
    assert lay["layers.0.wv.weight"] == "P('tp'x4, None)"
    nodes = list(prog.graph_module.graph.nodes)
    sdpa = [n for n in nodes if n.target is aten.scaled_dot_product_attention.default]
    assert all(n.meta["autopar"].strategy == "(S(1),S(1)x4,S(1)x4)->S(1)" for n in sdpa)
    shared = [n for n in nodes if n.target is C.grad_sum_shared]
    assert len(shared) == 2 * 2 * 2  # wk, wv and their biases, two layers
    fwd = [c for c in prog.collectives() if c.direction == "fwd" and ".w" in c.where]
    assert not [c for c in fwd if c.where.endswith((".wk", ".wv"))]


@pytest.mark.parametrize(("tp", "heads", "kv_heads", "fused_qkv"),
                         [(4, 8, 2, False), (8, 8, 2, False), (4, 8, 1, False), (4, 8, 2, True)])  # fmt: skip
def test_shared_kv_heads_match_single_device(tp, heads, kv_heads, fused_qkv):
    model, c, prog = _compile(tp, heads, kv_heads, fused_qkv)
    sdpa = [n for n in prog.graph_module.graph.nodes
            if n.target is aten.scaled_dot_product_attention.default]  # fmt: skip
    shared = f"x{tp // kv_heads}" if kv_heads > 1 else "replicated_kv_heads"  # MQA: whole head
    assert all(shared in n.meta["autopar"].strategy for n in sdpa)
    report = verify(model, Mesh(tp=tp), tokens(c), loss_fn=lm_loss)
    assert report.ok, str(report)


@pytest.mark.parametrize(("name", "size"), [("llama", "realistic"), ("mistral", "realistic"),
                                          ("qwen2", "realistic"), ("llama", "node"),
                                          ("mistral", "node"), ("qwen2", "node"),
                                          ("olmo2", "node"), ("gemma2", "node"),
                                          ("stablelm_parallel_qknorm", "realistic"),
                                          ("falcon_new_arch", "realistic")])  # fmt: skip
def test_gqa_families_meet_the_hand_design_at_tp8(name, size):
    """4 K/V heads on 8 ranks (h 2048 / 16 heads, and one node's h 4096 / 32 heads, b 4):
    no K/V message, the hand design's activation all-reduces and traffic, weights 1/8."""
    row = zoo.check(zoo.family(name), 8, run_verify=False, size=size, kv_heads=4)
    assert row.comm is not None and row.comm.ok, zoo.table([row])
    assert not [m for m in row.comm.actual.messages if m.where.endswith(("k_proj", "v_proj"))]
    assert row.param_fraction == pytest.approx(1 / 8, rel=0.1)


def test_multi_query_kv_is_computed_by_every_rank_at_tp8():
    """Falcon's one K/V head on 8 ranks at one node's shape: every rank computes it from the
    gathered input (no forward K/V message, the hand design's one activation all-reduce per
    layer).  Computing it on the rank's 1/8 of the tokens and gathering it was priced cheaper
    while the gather's backward reduce-scatter went unpriced: the hoist of the K/V gradient
    sum to the weights, free, was assumed whatever the plan split (``_price_weights_backward``)."""
    row = zoo.check(zoo.family("falcon"), 8, run_verify=False, size="node")
    assert row.comm is not None and row.comm.ok, zoo.table([row])
    assert not [m for m in row.comm.actual.messages if m.where.endswith("self_attention")]


def _reads_shared_heads_locally(prog, hidden: int) -> bool:
    """The shared K/V pieces read by each sharer as its own part (``unshare``, local), and
    no K/V-shaped message in attention's forward: only [b,s,1] norm statistics and the
    [b,s,h] activation messages of the residual stream."""
    unshared = [n for n in prog.graph_module.graph.nodes if n.target is C.unshare]
    fwd = [c for c in prog.collectives() if c.direction == "fwd" and "self_attn" in c.where]
    return bool(unshared) and all(c.shape[-1] in (1, hidden) for c in fwd)


@pytest.mark.parametrize("name", ["olmo2", "gemma2"])
def test_shared_k_heads_through_norms_and_eager_attention_match_single_device(name):
    """2 K/V heads shared by 4 ranks, read past SDPA's ``enable_gqa``: OLMo2's k_norm over
    the whole K projection reads each sharer's half of its piece (``unshare``, local) and
    all-reduces the [b,s,1] partial sum of squares; Gemma-2's eager attention after
    ``repeat_kv`` reads the repeated heads as each sharer's own query heads' (``unshare``).  The plan is chosen at
    a shape where that wins (h 512, s 2048, b 4) and reused on the tiny build, whose outputs and
    every gradient must equal one device's."""
    entry = zoo.family(name)
    big = dataclasses.replace(zoo.TINY, hidden=512, heads=8, kv_heads=2, ffn=1024, seq=2048,
                              batch=4)
    small = dataclasses.replace(zoo.TINY, heads=8, kv_heads=2)
    with zoo.tiny_as(big):
        model, args, kwargs, loss_fn = zoo.build(entry, "tiny", kv_heads=2)
        plan = autoparallelize(model, Mesh(tp=4), args, loss_fn, example_kwargs=kwargs).plan
    with zoo.tiny_as(small):
        model, args, kwargs, loss_fn = zoo.build(entry, "tiny", kv_heads=2)
    prog = autoparallelize(model, Mesh(tp=4), args, loss_fn, example_kwargs=kwargs, plan=plan)
    assert _reads_shared_heads_locally(prog, model.config.hidden_size), str(prog.plan)
    report = verify(model, Mesh(tp=4), args, loss_fn, example_kwargs=kwargs, plan=plan)
    assert report.ok, str(report)


def test_shared_kv_gradients_sum_on_the_sub_groups_of_a_device_mesh():
    """A real 4-process Gloo job on a tp=4 DeviceMesh, 2 K/V heads: the runtime binds the
    sub-groups of the 2 ranks sharing a head, each K/V weight gradient is summed there (the
    listed message is the piece, not the pieces side by side), and every rank's gradient is
    its shard of one device's."""
    _, _, prog = _compile(4, 8, 2)
    shared = [c for c in prog.collectives() if c.where.endswith((".wk", ".wv"))]
    assert shared and all(c.kind == "all_reduce" and c.direction == "bwd" for c in shared)
    assert {c.shape for c in shared} <= {(8, 64), (8,)}  # this rank's piece of [16, 64]
    root = Path(__file__).resolve().parents[1]
    codes, errs = run_rank_scripts(__file__, 4, timeout=300, root=str(root))
    assert all(code == 0 for code in codes), "\n".join(e[-2000:] for e in errs)


def _device_mesh_main(rank: int, port: int) -> None:
    from datetime import timedelta

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from autopar.codegen import shard_tensor

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=4, timeout=timedelta(seconds=120))  # fmt: skip
    device_mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("tp",))
    model, c, prog = _compile(4, 8, 2)
    x, y = tokens(c)
    lm_loss(model(x), y).backward()
    module = autoparallelize(build("llama", c), device_mesh, (x, y), lm_loss)
    out = module(x, y)
    (out[0] if isinstance(out, tuple) else out).backward()
    lay = {prog.traced.params[n.name]: n.meta["autopar"].layout
           for n in prog.graph_module.graph.nodes if n.name in prog.traced.params}  # fmt: skip
    for name, p in module.named_parameters():
        want = shard_tensor(model.get_parameter(name).grad, lay[name], prog.mesh, {"tp": rank})
        torch.testing.assert_close(p.grad, want, rtol=1e-5, atol=1e-6, msg=name)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    _device_mesh_main(int(sys.argv[1]), int(sys.argv[2]))


def test_grouped_fused_qkv_is_cut_per_kv_head():
    """Falcon's ``new_decoder_architecture`` fused QKV, viewed per K/V head as [.., g, a/g + 2,
    d]: with g = 2 groups on 4 ranks it is cut into its query, key and value rows of every
    group (``Piece.groups``), which join back to the user's weight; on 2 ranks each rank holds
    whole groups and the projection stays fused."""
    with zoo.tiny_as(dataclasses.replace(zoo.TINY, heads=8, kv_heads=2)):
        model, args, kwargs, _ = zoo.build(zoo.family("falcon_new_arch"), "tiny", kv_heads=2)
    traced = trace(model, args, example_kwargs=kwargs)
    fqn = "transformer.h.0.self_attention.query_key_value.weight"
    cut = split_fused_projections(traced, 4)
    mine = sorted((n for n, p in cut.pieces.items() if p.fqn == fqn), key=lambda n: cut.pieces[n].start)
    pieces = [cut.pieces[n] for n in mine]
    assert [(p.start, p.stop, p.groups) for p in pieces] == [(0, 32, 2), (32, 40, 2), (40, 48, 2)]
    w = traced.tensors[fqn]
    assert [tuple(cut.tensors[n].shape) for n in mine] == [(64, 64), (16, 64), (16, 64)]
    assert torch.equal(cut.tensors[mine[1]][:8], w[32:40])  # group 0's key, then group 1's
    assert torch.equal(cut.tensors[mine[1]][8:], w[80:88])
    assert torch.equal(join_pieces([cut.tensors[n] for n in mine], pieces), w)
    assert not split_fused_projections(traced, 2).pieces


@pytest.mark.parametrize("name", ["stablelm_parallel_qknorm", "falcon_new_arch"])
def test_shared_kv_pieces_of_norm_scales_and_grouped_qkv_match_single_device(name):
    """2 K/V heads shared by 4 ranks where the K/V weights are not plain projections:
    StableLM's per-head k-norm scales (a stack of replicated weights, read by the shared K
    heads as each rank's own piece: repeated in place, then sliced) and Falcon's grouped fused
    QKV (cut per K/V head).  The plan chosen at h 512, s 2048, b 4 on the meta device is reused
    on the tiny build, whose outputs and every gradient must equal one device's."""
    entry = zoo.family(name)
    big = dataclasses.replace(zoo.TINY, hidden=512, heads=8, kv_heads=2, ffn=1024, seq=2048,
                              batch=4)
    with zoo.tiny_as(big):
        model, args, kwargs, loss_fn = zoo.build(entry, "tiny", device="meta", kv_heads=2)
        plan = autoparallelize(model, Mesh(tp=4), args, loss_fn, example_kwargs=kwargs).plan
    with zoo.tiny_as(dataclasses.replace(zoo.TINY, heads=8, kv_heads=2, batch=4)):
        model, args, kwargs, loss_fn = zoo.build(entry, "tiny", kv_heads=2)
    prog = autoparallelize(model, Mesh(tp=4), args, loss_fn, example_kwargs=kwargs, plan=plan)
    layouts = {prog.traced.params[n.name]: str(meta.layout(n))
               for n in prog.graph_module.graph.nodes if n.name in prog.traced.params}
    kv = [k for k in layouts if k.endswith(("k_proj.weight", "v_proj.weight",
                                            "query_key_value.weight.1", "query_key_value.weight.2"))]
    assert len(kv) == 4 and all(layouts[k] == "P('tp'x2, None)" for k in kv), layouts
    if name.startswith("stablelm"):
        shared = [n for n in prog.graph_module.graph.nodes
                  if n.target is C.split and meta.layout(n).rep("tp") == 2]
        assert len(shared) == 2, "the k-norm scales of each layer: one shared piece per rank"
    report = verify(model, Mesh(tp=4), args, loss_fn, example_kwargs=kwargs, plan=plan)
    assert report.ok, str(report)


def test_checkpoint_pieces_of_a_grouped_piece_are_its_rows_in_each_group():
    """A grouped piece (rows 1:5 of each of 2 groups of 6, ``Piece.groups``) held whole by a
    rank saves as two boxes of the user's [12, 2] weight, one per group."""
    w = torch.arange(24.0).reshape(12, 2)
    piece = Piece(fqn="w", dim=0, start=1, stop=5, groups=2)
    local = piece.of(w)
    spec = ShardSpec(shape=(8, 2), padded=(8, 2), layout=Layout.replicate(2), sizes={},
                     coords={}, saved=(12, 2), base=(1, 0), grouped=(0, 4, 6))  # fmt: skip
    saved = tensor_pieces(local, spec)
    assert saved.shape == (12, 2) and sorted(saved.pieces) == [(1, 0), (7, 0)]
    assert all(torch.equal(t, w[o[0]:o[0] + 4]) for o, t in saved.pieces.items())


def test_two_norms_of_one_residual_reduce_its_gradient_once():
    """Falcon's ``new_decoder_architecture``: ``ln_attn`` and ``ln_mlp`` read one residual,
    both replicated before column-split projections.  Their input gradients are partial sums
    of one value: one all-reduce of the residual's gradient (the two norms' sum), not one per
    norm (``lower_collectives`` step 10); each norm's scale and bias get their own.  The
    tiny tp=2 build, whose outputs and every gradient must equal one device's."""
    with zoo.tiny_as(dataclasses.replace(zoo.TINY, heads=8, kv_heads=2, batch=4)):
        model, args, kwargs, loss_fn = zoo.build(zoo.family("falcon_new_arch"), "tiny", kv_heads=2)
    prog = autoparallelize(model, Mesh(tp=2), args, loss_fn, example_kwargs=kwargs)
    def scale(n):  # the norm's weight, through its gradient reduction
        w = n.args[2].args[0] if n.args[2].target is C.grad_all_reduce else n.args[2]
        return prog.traced.params.get(w.name, "")

    norms = {scale(n): n for n in prog.graph_module.graph.nodes
             if n.target is aten.layer_norm.default}  # fmt: skip
    attn, mlp = norms["transformer.h.1.ln_attn.weight"], norms["transformer.h.1.ln_mlp.weight"]
    assert attn.args[0] is mlp.args[0] and attn.args[0].target is C.grad_all_reduce
    assert not [u for u in attn.users if u.target is C.grad_all_reduce]
    assert not [u for u in mlp.users if u.target is C.grad_all_reduce]
    report = verify(model, Mesh(tp=2), args, loss_fn, example_kwargs=kwargs, plan=prog.plan)
    assert report.ok, str(report)
