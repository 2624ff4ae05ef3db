"""HF's RMSNorm on a 16-bit input fused into ``rms_norm_16`` (autopar.ops.norms,
passes/fuse_norms.py): the op computes the chain's values and autograd's gradients while
keeping the 16-bit input and the fp32 rstd instead of the fp32 copy and the normalized value;
the pass rewrites every such norm of a bf16 program and nothing else."""

from __future__ import annotations

import copy
import pickle
import warnings

import pytest
import torch

import passes.fuse_norms as fuse
from autopar import Mesh, autoparallelize
from autopar.axes.recompute import measure_saved, saved_bytes
from autopar.ir import meta
from autopar.ir.layout import Layout
from autopar.ops.norms import rms_norm_16
from autopar.runtime.pool import get_pool
from autopar.tools import zoo

BF16, F16, F32 = torch.bfloat16, torch.float16, torch.float32
EPS = 1e-6


def chain(x, w, eps=EPS, square="pow", weight_first=True):
    """HF's ``LlamaRMSNorm.forward`` (``w`` None: without the weight)."""
    x32 = x.to(F32)
    sq = x32.pow(2) if square == "pow" else x32 * x32
    out = (x32 * torch.rsqrt(sq.mean(-1, keepdim=True) + eps)).to(x.dtype)
    if w is None:
        return out
    return w * out if weight_first else out * w


def _grads(fn, x, w, g):
    x = x.detach().clone().requires_grad_()
    w = None if w is None else w.detach().clone().requires_grad_()
    out = fn(x, w)
    out.backward(g.to(out.dtype))
    return out, x.grad, None if w is None else w.grad


CASES = [(BF16, BF16), (BF16, None), (BF16, F32), (F16, F16), (F32, F32), (F32, None)]


@pytest.mark.parametrize(("dtype", "wdtype"), CASES)
def test_op_is_the_chain_forward_bitwise_and_its_gradients_autograds(dtype, wdtype):
    torch.manual_seed(0)
    x = (3 * torch.randn(3, 8, 64)).to(dtype)
    w = None if wdtype is None else (1 + 0.1 * torch.randn(64)).to(wdtype)
    g = torch.randn(3, 8, 64)
    ref = _grads(chain, x, w, g)
    got = _grads(lambda a, b: rms_norm_16(a, b, EPS, dtype), x, w, g)
    assert torch.equal(got[0], ref[0]) and got[0].dtype == ref[0].dtype
    tol = dict(rtol=1e-6, atol=1e-6) if dtype == F32 else dict(rtol=1.6e-2, atol=1e-2)
    for a, b in zip(got[1:], ref[1:], strict=True):
        if b is None:
            assert a is None
            continue
        assert a.dtype == b.dtype
        torch.testing.assert_close(a, b, **tol)


def gemma(x, w, eps=EPS):
    """HF's ``GemmaRMSNorm.forward``: the fp32 ``1 + w`` multiplies before the cast."""
    x32 = x.float()
    out = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (out * (1.0 + w.float())).type_as(x)


@pytest.mark.parametrize("dtype", [BF16, F32])
def test_op_in_gemma_order_is_gemmas_norm(dtype):
    torch.manual_seed(0)
    x, w = (3 * torch.randn(3, 8, 64)).to(dtype), (0.1 * torch.randn(64)).to(dtype)
    g = torch.randn(3, 8, 64)
    ref = _grads(gemma, x, w, g)
    got = _grads(lambda a, b: rms_norm_16(a, 1.0 + b.float(), EPS, dtype, cast_last=True), x, w, g)
    assert torch.equal(got[0], ref[0]) and got[0].dtype == ref[0].dtype
    tol = dict(rtol=1e-6, atol=1e-6) if dtype == F32 else dict(rtol=1.6e-2, atol=1e-2)
    for a, b in zip(got[1:], ref[1:], strict=True):
        assert a.dtype == b.dtype
        torch.testing.assert_close(a, b, **tol)
    if dtype == BF16:  # saved: x32, rstd, x32 * rstd, 1 + w (8 bytes an element) vs x, rstd, 1 + w
        x, w = x.requires_grad_(), w.requires_grad_()
        n, rows, h = x.numel(), x.numel() // 64, 64
        skip = {w.untyped_storage().data_ptr()}
        assert saved_bytes(lambda: gemma(x, w), skip) == 8 * n + 4 * rows + 4 * h
        fused = saved_bytes(lambda: rms_norm_16(x, 1.0 + w.float(), EPS, BF16, cast_last=True), skip)
        assert fused == 2 * n + 4 * rows + 4 * h


def test_op_gradcheck_in_float64():
    torch.manual_seed(0)
    x = torch.randn(2, 3, 8, dtype=torch.float64, requires_grad=True)
    w = torch.randn(8, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b: rms_norm_16(a, b, EPS, torch.float64), (x, w))
    assert torch.autograd.gradcheck(lambda a: rms_norm_16(a, None, EPS, torch.float64), (x,))


def test_op_keeps_the_16_bit_input_and_rstd_only():
    """The chain keeps a fp32 copy of x, its bf16 normalized value and rstd (6 bytes an
    element); the op keeps x and rstd (2)."""
    x = torch.randn(4, 16, 64, dtype=BF16, requires_grad=True)
    w = torch.randn(64, dtype=BF16, requires_grad=True)
    skip = {w.untyped_storage().data_ptr()}
    rows, n = 4 * 16, x.numel()
    assert saved_bytes(lambda: chain(x, w), skip) == 6 * n + 4 * rows
    assert saved_bytes(lambda: rms_norm_16(x, w, EPS, BF16), skip) == 2 * n + 4 * rows


def test_op_compiles_whole_and_pickles():
    x = torch.randn(2, 4, 16, dtype=BF16, requires_grad=True)
    w = torch.randn(16, dtype=BF16, requires_grad=True)
    torch._dynamo.reset()
    fn = torch.compile(lambda a, b: rms_norm_16(a, b, EPS, BF16), fullgraph=True,
                       backend="aot_eager")  # fmt: skip
    ref = _grads(lambda a, b: rms_norm_16(a, b, EPS, BF16), x, w, torch.ones(2, 4, 16))
    got = _grads(fn, x, w, torch.ones(2, 4, 16))
    for a, b in zip(got, ref, strict=True):
        assert torch.equal(a, b)
    assert pickle.loads(pickle.dumps(rms_norm_16)) is rms_norm_16


# ------------------------------------------------------------------- the pass on small graphs


class Norm(torch.nn.Module):
    """HF's RMSNorm, its variants by keyword; ``leak``: also return the fp32 copy."""

    def __init__(self, h=16, weight=True, square="pow", weight_first=True, between=False,
                 leak=False) -> None:  # fmt: skip
        super().__init__()
        self.weight = torch.nn.Parameter(1 + 0.1 * torch.randn(h)) if weight else None
        self.square, self.weight_first, self.between, self.leak = square, weight_first, between, leak

    def forward(self, x):
        x32 = x.to(F32)
        sq = x32.pow(2) if self.square == "pow" else x32 * x32
        var = sq.mean(-1, keepdim=True)
        if self.between:  # something between the mean and the rsqrt (an all-reduce's place)
            var = var * 0.5
        out = (x32 * torch.rsqrt(var + EPS)).to(x.dtype)
        if self.weight is not None:
            out = self.weight * out if self.weight_first else out * self.weight
        return (out, x32.sum()) if self.leak else out


def _fused(module, x, layout=None):
    """(the exported graph module with the pass run, its inputs, the unfused one's outputs)."""
    torch.manual_seed(0)
    module = module.to(x.dtype)
    gm = torch.export.export(module, (x,)).graph_module
    inputs = [*(p.detach() for p in module.parameters()), x]
    before = copy.deepcopy(gm)(*inputs)
    if layout is not None:
        src = next(n for n in gm.graph.nodes if n.op == "placeholder" and n.name == "x")
        meta.update(src, layout=layout)
    return fuse.fuse_norms(gm, None), inputs, before


def _calls(gm):
    return [n for n in gm.graph.nodes if n.target is rms_norm_16]


@pytest.mark.parametrize("variant", [{}, {"weight": False}, {"square": "mul"},
                                     {"weight_first": False}])  # fmt: skip
def test_pass_fuses_the_hf_chain_and_its_variants(variant):
    torch.manual_seed(0)
    gm, inputs, before = _fused(Norm(**variant), torch.randn(2, 8, 16).to(BF16))
    (call,) = _calls(gm)
    assert [n.op for n in gm.graph.nodes if n.op == "call_function" and n is not call
            and n.target is not fuse.ASSERT] == []  # fmt: skip
    assert (call.args[1] is None) == (variant.get("weight") is False)
    assert call.args[2:] == (EPS, BF16) and call.meta["val"].dtype == BF16
    assert torch.equal(gm(*inputs)[0], before[0])  # the chain's values


@pytest.mark.parametrize("family", ["gemma", "gemma3"])
def test_pass_fuses_gemmas_norm_in_its_order(family):
    """Gemma's (and Gemma 3's) ``(1 + w)`` norm: the fp32 ``1 + w`` stays in the graph as the
    op's weight, multiplied before the down-cast (``type_as``)."""
    import importlib

    mod = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    norm = getattr(mod, f"{family.capitalize()}RMSNorm")(16)
    with torch.no_grad():
        norm.weight.normal_(0, 0.1)
    gm, inputs, before = _fused(norm, torch.randn(2, 8, 16).to(BF16))
    (call,) = _calls(gm)
    assert call.kwargs == {"cast_last": True} and call.args[1].meta["val"].dtype == F32
    assert torch.equal(gm(*inputs)[0], before[0])


def test_the_fused_op_is_priced_as_the_chain_it_replaces():
    from cost.compute import node_flops_bytes

    gm = torch.export.export(Norm().to(BF16), (torch.randn(2, 8, 16).to(BF16),)).graph_module
    chain = sum(torch.tensor(node_flops_bytes(n)) for n in gm.graph.nodes if n.op == "call_function")
    (call,) = _calls(fuse.fuse_norms(gm, None))
    assert tuple(chain.tolist()) == node_flops_bytes(call)


@pytest.mark.parametrize("case", ["fp32", "leak", "between", "split"])
def test_pass_leaves_other_norms_alone(case):
    """fp32 inputs, an fp32 copy read elsewhere, something between the mean and the rsqrt,
    and a split last dim (a distributed norm's mean is partial) stay."""
    torch.manual_seed(0)
    x = torch.randn(2, 8, 16).to(F32 if case == "fp32" else BF16)
    module = Norm(leak=case == "leak", between=case == "between")
    split = Layout(dims=((), (), ("tp",)), blocks=(1, 1, 1)) if case == "split" else None
    gm, _, _ = _fused(module, x, split)
    assert _calls(gm) == []
    assert any(n.target is torch.ops.aten.rsqrt.default for n in gm.graph.nodes)


# ------------------------------------------------------------ the pass in HF Llama's programs

_PROGS: dict = {}


def _llama_prog(dtype=BF16, enabled=True, compile=False):
    """HF Llama (zoo tiny: hidden 64, 2 layers) on Mesh(tp=2); ``enabled``: fuse_norms on."""
    key = (dtype, enabled, compile)
    if key not in _PROGS:
        model, args, kwargs, _ = zoo.build(zoo.family("llama"), "tiny")
        fuse.ENABLED = enabled
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                prog = autoparallelize(model, Mesh(tp=2), args, None, example_kwargs=kwargs,
                                       param_dtype=dtype, compile=compile)  # fmt: skip
        finally:
            fuse.ENABLED = True
        _PROGS[key] = (prog, args, kwargs)
    return _PROGS[key]


def _local_norm_elements(prog) -> list[int]:
    """Elements of each fused norm's input on rank 0."""
    return [n.args[0].meta["val"].numel() for n in prog.module(0).graph.nodes
            if n.target is rms_norm_16]  # fmt: skip


def test_every_rms_norm_of_a_bf16_llama_program_is_fused():
    prog, _, _ = _llama_prog()
    layers = zoo.dims(zoo.family("llama"), "tiny").layers
    code = prog.code(0)
    assert code.count("autopar_ops_norms_rms_norm_16(") == 2 * layers + 1
    assert "aten.rsqrt" not in code and "aten.pow" not in code
    # the first layer's input norm, printed: the weight multiply's name and value, the gathered x
    assert ('mul_4: "bf16[2, 16, 64]" = autopar_ops_norms_rms_norm_16(all_gather, '
            "model_layers_0_input_layernorm_weight, 1e-06, torch.bfloat16)") in code
    assert "fuse_norms" in [r.name for r in prog.history]


def test_an_fp32_program_is_left_exactly_as_it_was():
    prog, _, _ = _llama_prog(F32)
    off, _, _ = _llama_prog(F32, enabled=False)
    assert "rms_norm_16" not in prog.code(0)
    assert prog.code(0) == off.code(0) and str(prog.plan) == str(off.plan)


def test_the_measured_saved_bytes_fall_by_the_fp32_copies():
    """Measured with autograd's pack hooks on the worker pool, run as ``bind`` runs a bf16
    program: per rank, 4 bytes an element of every norm's input less (its fp32 copy; the
    16-bit normalized value the weight's gradient kept is now the 16-bit input)."""
    prog, args, kwargs = _llama_prog()
    off, _, _ = _llama_prog(enabled=False)
    fused = measure_saved(prog, args, kwargs, BF16)
    unfused = measure_saved(off, args, kwargs, BF16)
    drop = 4 * sum(_local_norm_elements(prog))
    assert drop > 0
    for a, b in zip(unfused, fused, strict=True):
        assert a - b == drop, (a, b, drop)


def _step(rank, groups, module, ids, labels):
    """One forward and backward of this rank's program as ``bind`` runs it (bf16 "cast"): the
    loss and every parameter's gradient."""
    from autopar.ops import collectives
    from autopar.runtime import cast_forward

    collectives.bind(groups)
    module = cast_forward(module, BF16)
    loss = module(ids, labels=labels)[0]
    loss.backward()
    return loss.item(), {n: p.grad for n, p in module.named_parameters()}


def _steps(prog, ids, labels):
    return get_pool(2).run(_step, prog.mesh.axes, [(prog.module(r), ids, labels)
                                                   for r in range(2)])  # fmt: skip


def _same_step(runs, ref_runs):
    """Equal losses and gradients within bf16 rounding, rank by rank."""
    for (loss, grads), (ref_loss, ref_grads) in zip(runs, ref_runs, strict=True):
        assert loss == pytest.approx(ref_loss, rel=2e-3)
        assert grads.keys() == ref_grads.keys()
        for name, g in grads.items():
            assert g.dtype == ref_grads[name].dtype == F32
            torch.testing.assert_close(g, ref_grads[name], rtol=1.6e-2, atol=1e-3, msg=name)


def test_bf16_training_step_equals_the_unfused_program():
    prog, (ids,), kwargs = _llama_prog()
    off, _, _ = _llama_prog(enabled=False)
    _same_step(_steps(prog, ids, kwargs["labels"]), _steps(off, ids, kwargs["labels"]))


def test_compiled_bf16_program_runs_the_fused_norms_without_graph_breaks():
    """compile="aot_eager": dynamo and AOTAutograd trace the op inside each compiled block
    (its forward and backward), without a graph break, to the eager program's step."""
    from autopar.ops.compiled import compile_stats

    prog, (ids,), kwargs = _llama_prog(compile="aot_eager")
    eager, _, _ = _llama_prog()
    inner = [m for _, m in prog.module(0).named_modules() if isinstance(m, torch.fx.GraphModule)]
    assert any(n.target is rms_norm_16 for m in inner for n in m.graph.nodes)
    before = get_pool(2).run(compile_stats, prog.mesh.axes, [()] * 2)
    runs = _steps(prog, ids, kwargs["labels"])
    after = get_pool(2).run(compile_stats, prog.mesh.axes, [()] * 2)
    for b, a in zip(before, after, strict=True):
        assert a["graph_breaks"] == b["graph_breaks"] and a["unique_graphs"] > b["unique_graphs"]
    _same_step(runs, _steps(eager, ids, kwargs["labels"]))


def per_layer_activations(prog, sixteen: bool = False) -> float:
    """Saved bytes per layer on rank 0 as the cost model counts them (benchmarks/bf16_bytes.py;
    ``sixteen``: every floating value at 2 bytes)."""
    from autopar.axes.data_parallel import local_parts
    from cost.config import ParallelConfig
    from cost.graph import GraphModel

    local, _ = local_parts(prog.stages[0])
    for n in local.graph.nodes if sixteen else ():
        v = n.meta.get("val")
        if n.op == "call_function" and isinstance(v, torch.Tensor) and v.is_floating_point():
            n.meta["run_dtype"] = BF16
    model = GraphModel.from_traced(local)
    work = model.workload(ParallelConfig(global_batch=model.batch), model.batch,
                          prog.mesh.cluster.gpu)  # fmt: skip
    return work.act_bytes["none"]


def test_the_cost_model_counts_the_fused_norms_16_bit():
    """HF Llama h 2048, s 2048, b 1 on Mesh(tp=4), bf16, on meta: the priced activations per
    layer fall by the two norms' fp32 copies (4 bytes an element of the [b, s/t, h] shard
    each) and every saved value is 16-bit or an fp32 row statistic."""
    entry = zoo.family("llama")
    model, args, kwargs, loss_fn = zoo.build(entry, "realistic", device="meta")
    d = zoo.dims(entry, "realistic")
    found = {}
    for enabled in (True, False):
        fuse.ENABLED = enabled
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                prog = autoparallelize(model, Mesh(tp=4), args, loss_fn, example_kwargs=kwargs,
                                       param_dtype=BF16)  # fmt: skip
        finally:
            fuse.ENABLED = True
        found[enabled] = (per_layer_activations(prog), per_layer_activations(prog, True))
    shard = d.batch * d.seq * d.hidden / 4
    assert found[False][0] - found[True][0] == pytest.approx(2 * 4 * shard)
    assert found[True][0] == pytest.approx(found[True][1])  # nothing fp32 but statistics


def _shifted_loss(out, labels: torch.Tensor) -> torch.Tensor:
    """HF's shifted cross-entropy with the labels shifted outside (the cp tests' loss)."""
    logits = out.logits.float()
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def _hf_batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids, labels = (torch.randint(0, 128, (2, 32), generator=g) for _ in range(2))
    return ids, torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], -100)], 1)


def _loss_step(rank, groups, module, x, y):
    """``_step`` for a program with its own loss function."""
    from autopar.ops import collectives
    from autopar.runtime import cast_forward

    collectives.bind(groups)
    module = cast_forward(module, BF16)
    loss = module(x, y)
    loss.backward()
    return loss.item(), {n: p.grad for n, p in module.named_parameters()}


def _hf_prog(axes, enabled=True, **options):
    from autopar.tools.testing import hf_tiny_llama

    fuse.ENABLED = enabled
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return autoparallelize(hf_tiny_llama(2), Mesh(**axes), _hf_batch(), _shifted_loss,
                                   param_dtype=BF16, **options)  # fmt: skip
    finally:
        fuse.ENABLED = True


def test_cp_splits_the_fused_norms_along_the_sequence():
    """Mesh(cp=2, tp=2): the cp pass runs each fused norm on this rank's sequence chunks (its
    sharding rule), and the step equals the unfused program's."""
    prog, off = _hf_prog({"cp": 2, "tp": 2}), _hf_prog({"cp": 2, "tp": 2}, enabled=False)
    seq = _hf_batch()[0].shape[1]
    shapes = {n.args[0].meta["val"].shape[1] for n in prog.module(0).graph.nodes
              if n.target is rms_norm_16}  # fmt: skip
    assert shapes == {seq // 2}
    x, y = _hf_batch()
    runs = [get_pool(4).run(_loss_step, p.mesh.axes, [(p.module(r), x, y) for r in range(4)])
            for p in (prog, off)]  # fmt: skip
    _same_step(*runs)


def test_a_norm_over_a_split_hidden_dim_stays_distributed():
    """A plan splitting the norms' hidden dim (the tiny model under a large memory weight)
    all-reduces their statistics between the mean and the rsqrt: none is fused."""
    prog = _hf_prog({"tp": 2}, memory_weight=1e-6)
    code = prog.code(0)
    assert "rms_norm_16" not in code and code.count("aten.rsqrt") == 5
