"""Mesh.auto compiles exactly the configuration it reports, every axis of it, on every GPU of
the cluster, the compiled plan fits by the compiler's own memory count (issue 18.2), and the
configurations it walks are ordered by the compiler's own count (issue 19.5)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from autopar import Mesh, autoparallelize
from autopar.errors import PlanError
from autopar.tools.testing import Config, build, lm_loss, tokens
from cost.hardware import Cluster


def _degrees(mesh: Mesh) -> dict[str, int]:
    return {a: mesh.sizes.get(a, 1) for a in ("dp", "pp", "cp", "ep", "tp")}


def _chosen(config) -> dict[str, int]:
    """autopar's mesh degrees of a search configuration (ep is the inner part of dp)."""
    return {"dp": config.dp // config.ep, "pp": config.pp, "cp": config.cp, "ep": config.ep,
            "tp": config.tp}  # fmt: skip


def _check_compiled(prog, cluster: Cluster) -> None:
    """The compiled mesh is the reported choice's, on every GPU, and its ZeRO stage fits."""
    search = prog.search
    assert _degrees(prog.mesh) == _chosen(search.compiled.config)
    assert prog.mesh.world_size == cluster.world_size
    assert (search.compiled is search.best) == (not search.refused)
    plan = prog.plan.dp
    assert plan.zero == search.compiled.config.zero
    assert plan.memory[plan.zero].total <= cluster.gpu.hbm_bytes
    text = str(search)
    assert f"compiled on {prog.mesh} ({cluster.world_size} of {cluster.world_size} GPUs)" in text
    # the walk's candidates are ordered by the compiler's own count, and the compiled plan's
    # predicted step is the one its candidate was ordered by (one cost model)
    order = [(not c.memory.fits, c.step_time_s if c.memory.fits else c.memory.total)
             for _, c in search.candidates]  # fmt: skip
    assert order == sorted(order) and search.best is search.candidates[0][1]
    assert search.compiled in [c for _, c in search.candidates]
    assert plan.step.total == pytest.approx(search.compiled.step_time_s, rel=0.02)


def _llama_8b(batch: int, seq: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(num_hidden_layers=32, hidden_size=4096, num_attention_heads=32,
                      num_key_value_heads=8, intermediate_size=14336, vocab_size=128256,
                      max_position_embeddings=seq, use_cache=False)  # fmt: skip
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    return model, torch.randint(0, 128256, (batch, seq), device="meta")


@pytest.mark.parametrize("param_dtype", [torch.float32, torch.bfloat16])
def test_mesh_auto_compiles_its_choice_for_llama3_8b_on_64_gpus(param_dtype):
    """The issue's case: 8B shape, 8 DGX-H100 nodes, global batch 64 x 8192, on meta."""
    cluster = Cluster.preset("dgx-h100", nodes=8)
    model, x = _llama_8b(64, 8192)
    prog = autoparallelize(model, Mesh.auto(cluster), (x,), example_kwargs={"labels": x},
                           param_dtype=param_dtype)  # fmt: skip
    _check_compiled(prog, cluster)


def test_mesh_auto_compiles_context_parallelism_when_the_best_needs_it():
    """Long sequences on GPUs too small for one sequence's activations: the best plan splits
    the sequence, and the compiled mesh has the cp axis the search chose."""
    c = Config(layers=2, hidden=256, heads=4, kv_heads=4, ffn=512, vocab=512, seq=8192, batch=2)
    with torch.device("meta"):
        model = build("llama", c)
    x, y = (t.to("meta") for t in tokens(c))
    node = dataclasses.replace(Cluster.preset("dgx-h100", nodes=1), gpus_per_node=4)
    node = dataclasses.replace(node, gpu=dataclasses.replace(node.gpu, hbm_bytes=4e9))
    prog = autoparallelize(model, Mesh.auto(node), (x, y), lm_loss)
    assert prog.search.best.config.cp > 1
    assert prog.mesh.size("cp") == prog.search.best.config.cp
    _check_compiled(prog, node)


def test_mesh_auto_refuses_options_that_fix_what_it_chooses():
    c = Config(batch=8)
    model, (x, y) = build("llama", c), tokens(c)
    mesh = Mesh.auto(Cluster.preset("dgx-h100", nodes=1))
    for options in ({"n_microbatches": 4}, {"split_points": ["layers.1"]}, {"virtual_stages": 2}):
        with pytest.raises(PlanError, match=f"{next(iter(options))} was given"):
            autoparallelize(model, mesh, (x, y), lm_loss, **options)
