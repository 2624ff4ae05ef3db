"""``autoparallelize(..., compile=...)``: every rank program's repeated blocks run under
torch.compile (one compile per distinct block), still equal the single-device model on every
mesh kind, without graph breaks, and the plan is the eager one.  The programs run are of HF
transformers' tiny LlamaForCausalLM and MixtralForCausalLM (the reference Llama where a test is
about its sequence-parallel plan).  Inductor (the default backend) compiles C++ on this CPU
slowly, so it runs on tp=2 only; the other meshes use "aot_eager" (dynamo and AOTAutograd, the
same capture, no code generation)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from autopar import Mesh, autoparallelize
from autopar.errors import InputError
from autopar.ops.compiled import compile_stats
from autopar.runtime.pool import get_pool
from autopar.tools import zoo
from autopar.tools.testing import Config, MoEConfig, build, build_moe, lm_loss, tokens
from autopar.verify import verify

LLAMA = Config(layers=2, batch=4, seq=16, kv_heads=2)
SP = 1e-6  # memory weight (s/byte) that makes the tiny models sequence-parallel


def _llama() -> tuple[torch.nn.Module, tuple]:
    return build("llama", LLAMA), tokens(LLAMA)


def _stats(world: int) -> dict[str, int]:
    """Dynamo's counts summed over the pool's first ``world`` workers (they persist)."""
    per_rank = get_pool(world).run(compile_stats, Mesh(tp=world).axes, [()] * world)
    return {k: sum(s[k] for s in per_rank) for k in per_rank[0]}


def test_compiled_program_calls_each_block_compiled_and_keeps_the_plan():
    model, (x, y) = _llama()
    eager = autoparallelize(model, Mesh(tp=2), (x, y), lm_loss)
    prog = autoparallelize(model, Mesh(tp=2), (x, y), lm_loss, compile=True)
    assert str(prog.plan) == str(eager.plan)
    code = prog.code(1)
    assert code.count("autopar_ops_compiled_compiled(") == LLAMA.layers
    assert "backend = 'inductor'" in code
    # compiled programs decompose tp pairs as eager ones do (no micro-pipelined TP on CPU)
    fused = {c: autoparallelize(model, Mesh(tp=2), (x, y), lm_loss, compile=c, tp_overlap="all",
                                memory_weight=SP).plan for c in (False, True)}  # fmt: skip
    assert fused[True].overlap == fused[False].overlap != ()
    assert str(fused[True]) == str(fused[False])
    with pytest.raises(InputError, match="compile="):
        autoparallelize(model, Mesh(tp=2), (x, y), lm_loss, compile=3)


def _hf_llama() -> tuple[torch.nn.Module, tuple]:
    """HF LlamaForCausalLM, tiny, labels shifted outside the model (the cp tests' loss)."""
    transformers = pytest.importorskip("transformers")
    kw = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
              use_cache=False)  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**kw))
    g = torch.Generator().manual_seed(1)
    ids, labels = (torch.randint(0, 128, (2, 32), generator=g) for _ in range(2))
    return model, (ids, torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], -100)], 1))


def _shifted_loss(out, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.logits.reshape(-1, out.logits.shape[-1]), labels.reshape(-1))


def test_inductor_tp2_equals_single_device_without_graph_breaks():
    model, batch = _hf_llama()
    before = _stats(2)
    report = verify(model, Mesh(tp=2), batch, _shifted_loss, rtol=1e-4, compile=True)
    assert report.ok, report
    after = _stats(2)
    assert after["graph_breaks"] == before["graph_breaks"]
    # two identical blocks share one compile per rank (the forward graph; a run compiles anew
    # for each of verify's two runs only if the blocks' signature changed: it does not)
    assert after["unique_graphs"] - before["unique_graphs"] == 2


ROUTES = [
    ("hf_llama", {"dp": 2, "tp": 2}, {"zero": 3}),
    ("hf_llama", {"pp": 2, "tp": 2}, {"n_microbatches": 2}),
    ("hf_llama", {"tp": 2}, {"recompute": "full"}),
    ("llama", {"tp": 2}, {"tp_overlap": "all", "memory_weight": SP}),  # collective matmuls
    ("llama", {"tp": 2}, {"memory_weight": SP}),  # whole gathers, shards re-gathered (ring=False)
    ("mixtral", {"ep": 2}, {}),  # the expert all-to-alls as custom ops
    ("moe", {"pp": 2, "ep": 2}, {"n_microbatches": 2}),  # + the pending bucket sums
]


@pytest.mark.parametrize(("kind", "axes", "options"), ROUTES)
def test_aot_eager_programs_equal_single_device(kind, axes, options):
    kwargs = {}
    if kind == "mixtral":
        pytest.importorskip("transformers")
        model, args, kwargs, _ = zoo.build(zoo.family("mixtral"))  # the model's own loss
        loss = None
    elif kind == "moe":
        c = MoEConfig(batch=8)
        (model, args), loss = (build_moe(c), tokens(c)), lm_loss
    elif kind == "hf_llama":
        (model, args), loss = _hf_llama(), _shifted_loss
    else:
        (model, args), loss = _llama(), lm_loss
    world = Mesh(**axes).world_size
    before = _stats(world)
    report = verify(model, Mesh(**axes), args, loss, example_kwargs=kwargs, rtol=1e-5,
                    compile="aot_eager", **options)  # fmt: skip
    assert report.ok, f"{kind} {axes}\n{report}"
    after = _stats(world)
    assert after["graph_breaks"] == before["graph_breaks"], (before, after)
    assert after["unique_graphs"] > before["unique_graphs"]


# ---------------------------------------------------------------- ring steps (cp, tp overlap)


def test_hf_llama_cp_ring_compiles_without_graph_breaks():
    """cp ring attention under compile: its ring steps trace as functional all-to-alls (no
    graph break per block), one graph per rank, equal to one device in the loss and every
    gradient."""
    model, batch = _hf_llama()
    before = _stats(2)
    report = verify(model, Mesh(cp=2), batch, _shifted_loss, rtol=1e-5, compile="aot_eager",
                    cp_attention="ring")  # fmt: skip
    assert report.ok, report
    after = _stats(2)
    assert after["graph_breaks"] == before["graph_breaks"], (before, after)
    assert after["unique_graphs"] > before["unique_graphs"]


def _ring_graphs(rank: int, groups: dict) -> tuple[list[str], list[str], float]:
    """A collective matmul and a ring attention over the tp=2 ring, each compiled whole
    (``fullgraph``: a graph break raises): the forward ops of each, in order, and the worst
    relative difference from the same ops run eagerly over ``batch_isend_irecv``."""
    from torch._dynamo.backends.common import aot_autograd

    from autopar.ops import collectives, cp_ops
    from autopar.ops.overlap import gather_linear

    collectives.bind(groups)
    g = torch.Generator().manual_seed(rank)
    x, w = torch.randn(4, 8, generator=g), torch.randn(6, 8, generator=g)
    q, k, v = (torch.randn(1, 2, 4, 8, generator=g) for _ in "qkv")
    fns = [lambda x, w: gather_linear(x, [w], [None], "tp", 0)[0],
           lambda q, k, v: cp_ops.ring_attention(q, k, v, None, "tp", True, 0.3, 8, True)]  # fmt: skip
    forwards, worst, graphs = [], 0.0, []

    def keep(gm, _):  # noqa: ANN001, ANN202
        graphs.append(gm)
        return gm

    for fn, inputs in zip(fns, [(x, w), (q, k, v)], strict=True):
        first = len(graphs)  # this function's forward, backward, then its no-grad graph
        compiled = torch.compile(fn, backend=aot_autograd(fw_compiler=keep, bw_compiler=keep),
                                 fullgraph=True)  # fmt: skip
        outs = []
        for run in (compiled, fn):
            leaves = [t.clone().requires_grad_() for t in inputs]
            run(*leaves).sin().sum().backward()
            outs.append([t.grad for t in leaves] + [run(*inputs)])
        worst = max(worst, *(float((a - b).abs().max() / b.abs().max())
                             for a, b in zip(*outs, strict=True)))  # fmt: skip
        ops = [str(n.target) for n in graphs[first].graph.nodes if n.op == "call_function"]
        forwards.append(ops)
    return forwards[0], forwards[1], worst


def test_ring_steps_trace_with_compute_between_send_and_wait():
    """Each ring step is an all-to-all whose wait the traced graph keeps after the step's
    compute (the overlap eager has), and compiled equals eager (aot_autograd capture)."""
    for gather, ring, worst in get_pool(2).run(_ring_graphs, Mesh(tp=2).axes, [()] * 2):
        assert worst < 1e-6
        for ops, compute in ((gather, "aten.mm.default"), (ring, "aten.bmm.default")):
            send = ops.index("_c10d_functional.all_to_all_single.default")
            wait = ops.index("_c10d_functional.wait_tensor.default")
            assert send < ops.index(compute) < wait, ops


def test_micro_pipelined_tp_is_chosen_only_where_the_platform_has_it():
    """Inductor's micro-pipelined TP needs inductor on CUDA with NCCL: this CPU says why not,
    and compile then keeps autopar's own decomposition; where it is supported the pairs are
    left whole for it."""
    from autopar.ops.compiled import micro_pipeline_tp
    from autopar.options import make_options

    ok, why = micro_pipeline_tp("aot_eager")
    assert not ok and "inductor pass" in why
    if torch.cuda.is_available() and torch.distributed.is_nccl_available():
        assert micro_pipeline_tp("inductor")[0]
        assert make_options(compile=True, tp_overlap="all").overlap_mode == "none"
    else:
        ok, why = micro_pipeline_tp("inductor")
        assert not ok and ("no CUDA device" in why or "no NCCL" in why)
        assert make_options(compile=True, tp_overlap="all").overlap_mode == "all"
    assert make_options(compile="aot_eager", tp_overlap="all").overlap_mode == "all"


def _pipelined_tp_fusions(rank: int, groups: dict, module, x, y) -> list[int]:
    """Inductor's micro-pipelined TP pass run on a compiled rank program's forward and
    backward graphs (after inductor's decompositions and view_to_reshape, as inductor runs
    it): the fused symm_mem ops it inserts per graph.  The pass bails on builds without NCCL
    and its fused kernels are CUDA's, so NCCL is faked and the unfused graphs run."""
    import copy

    from torch._dynamo.backends.common import aot_autograd
    from torch._inductor.decomposition import select_decomp_table
    from torch._inductor.fx_passes.micro_pipeline_tp import micro_pipeline_tp_pass
    from torch._inductor.fx_passes.post_grad import view_to_reshape
    from torch.distributed import _symmetric_memory

    from autopar.ops import collectives

    collectives.bind(groups)
    fused, nccl = [], torch.distributed.is_nccl_available

    def count(gm, _):  # noqa: ANN001, ANN202
        probe = copy.deepcopy(gm)
        view_to_reshape(probe)
        torch.distributed.is_nccl_available = lambda: True
        try:
            with _symmetric_memory._test_mode():
                micro_pipeline_tp_pass(probe.graph)
        finally:
            torch.distributed.is_nccl_available = nccl
        fused.append(sum("symm_mem.fused" in str(n.target) for n in probe.graph.nodes))
        return gm

    backend = aot_autograd(fw_compiler=count, bw_compiler=count,
                           decompositions=select_decomp_table())  # fmt: skip
    torch.compile(module, backend=backend)(x, y).backward()
    return fused


def test_inductor_micro_pipelined_tp_matches_the_tp_pairs():
    """Under compile the tp all-gather / reduce-scatter trace in functional collectives' own
    forms, which inductor's micro-pipelined TP pattern matcher recognises (the movedim form
    eager uses matched nothing): the matmul + reduce-scatter pairs fuse (the tiny model's
    gathers are of its 64-wide hidden dim, which inductor leaves whole below 1024)."""
    c = Config(layers=1, batch=4, seq=16, kv_heads=2)
    torch.manual_seed(0)
    model, (x, y) = build("llama", c), tokens(c)
    prog = autoparallelize(model, Mesh(tp=2), (x, y), lm_loss, memory_weight=SP,
                           tp_overlap="none")  # fmt: skip
    jobs = [(prog.module(r), x, y) for r in range(2)]
    for fused in get_pool(2).run(_pipelined_tp_fusions, prog.mesh.axes, jobs):
        assert sum(fused) >= 3, fused  # wo and w2 forward, a backward one
