"""``autoparallelize(..., compile=...)``: every rank program's repeated blocks run under
torch.compile (one compile per distinct block), still equal the single-device model on every
mesh kind, without graph breaks, and the plan is the eager one.  The models are HF
transformers' (tiny LlamaForCausalLM, MixtralForCausalLM; the reference Llama for cp ring
attention).  Inductor (the default backend) compiles C++ on this CPU slowly, so it runs on
tp=2 only; the other meshes use "aot_eager" (dynamo and AOTAutograd, the same capture, no code
generation)."""

from __future__ import annotations

import pytest
import torch

from autopar import Mesh, autoparallelize
from autopar.errors import InputError
from autopar.ops.compiled import compile_stats
from autopar.runtime.pool import get_pool
from autopar.tools import zoo
from autopar.tools.testing import Config, build, hf_tiny_llama, lm_loss, token_batch, tokens
from autopar.verify import verify

pytest.importorskip("transformers")
LLAMA = Config(layers=2, batch=4, seq=16, kv_heads=2)  # the reference Llama (cp ring)


def _hf(kind: str) -> tuple[torch.nn.Module, tuple, dict]:
    """A tiny HF model of 2 layers, its input ids and ``labels`` (the model's own loss)."""
    if kind == "mixtral":
        model, args, kwargs, _ = zoo.build(zoo.family("mixtral"))
        return model, args, kwargs
    ids, labels = token_batch(4, 16, 128)
    return hf_tiny_llama(2), (ids,), {"labels": labels}


def _stats(world: int) -> dict[str, int]:
    """Dynamo's counts summed over the pool's first ``world`` workers (they persist)."""
    per_rank = get_pool(world).run(compile_stats, Mesh(tp=world).axes, [()] * world)
    return {k: sum(s[k] for s in per_rank) for k in per_rank[0]}


def test_compiled_program_calls_each_block_compiled_and_keeps_the_plan():
    model, args, kwargs = _hf("llama")
    eager = autoparallelize(model, Mesh(tp=2), args, example_kwargs=kwargs)
    prog = autoparallelize(model, Mesh(tp=2), args, example_kwargs=kwargs, compile=True)
    assert str(prog.plan) == str(eager.plan)
    code = prog.code(1)
    assert code.count("autopar_ops_compiled_compiled(") == 2
    assert "backend = 'inductor'" in code
    with pytest.raises(InputError, match="compile="):
        autoparallelize(model, Mesh(tp=2), args, example_kwargs=kwargs, compile=3)


def test_inductor_tp2_equals_single_device_without_graph_breaks():
    model, args, kwargs = _hf("llama")
    before = _stats(2)
    report = verify(model, Mesh(tp=2), args, example_kwargs=kwargs, rtol=1e-4, compile=True)
    assert report.ok, report
    after = _stats(2)
    assert after["graph_breaks"] == before["graph_breaks"]
    # two identical blocks share one compile per rank (the forward graph; a run compiles anew
    # for each of verify's two runs only if the blocks' signature changed: it does not)
    assert after["unique_graphs"] - before["unique_graphs"] == 2


ROUTES = [
    ("llama", {"dp": 2, "tp": 2}, {"zero": 3}),
    ("llama", {"pp": 2, "tp": 2}, {"n_microbatches": 2}),
    ("reference", {"cp": 2}, {"cp_attention": "ring"}),
    ("llama", {"tp": 2}, {"recompute": "full"}),
    ("mixtral", {"ep": 2}, {}),
]


@pytest.mark.parametrize(("kind", "axes", "options"), ROUTES)
def test_aot_eager_programs_equal_single_device(kind, axes, options):
    if kind == "reference":
        model, args, kwargs, loss = build("llama", LLAMA), tokens(LLAMA), {}, lm_loss
    else:
        (model, args, kwargs), loss = _hf(kind), None
    world = Mesh(**axes).world_size
    wide = torch.float64 if options.get("cp_attention") == "ring" else None
    before = _stats(world)
    report = verify(model, Mesh(**axes), args, loss, example_kwargs=kwargs, rtol=1e-5,
                    compile="aot_eager", reference_dtype=wide, **options)  # fmt: skip
    assert report.ok, f"{kind} {axes}\n{report}"
    after = _stats(world)
    # ring attention's batch_isend_irecv is not traceable: dynamo breaks the graph there
    # (known); ep's all-to-alls are custom ops (autopar.ops.collectives), no break
    if "cp" not in axes:
        assert after["graph_breaks"] == before["graph_breaks"], (before, after)
    assert after["unique_graphs"] > before["unique_graphs"]
