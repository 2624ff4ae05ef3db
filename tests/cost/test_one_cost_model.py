"""The search and the compiler price one configuration of one traced model alike (issue 19.5).

A small HF Llama on the meta device, 16 H100: the search's memory per rank (`cost.estimate`
on the traced graph) and the compiled plan's (its ZeRO row) agree within 2% for FSDP, FSDP
with full recompute and pp x dp, the runtime reserve left out of both (dp x cp is 4% apart
here: not yet one count), and the compiled plan's predicted step includes the data axis.
"""

from __future__ import annotations

import warnings

import pytest
import torch

pytest.importorskip("transformers")

from benchmarks.search_vs_compiled import _loss  # noqa: E402
from cost.config import ParallelConfig  # noqa: E402
from cost.estimate import estimate  # noqa: E402
from cost.graph import GraphModel  # noqa: E402
from cost.hardware import Cluster  # noqa: E402

BATCH, SEQ, VOCAB = 16, 2048, 8192
CONFIGS = [({"dp": 16}, 3, "none"), ({"dp": 16}, 3, "full"), ({"dp": 8, "pp": 2}, 1, "none")]


@pytest.fixture(scope="module")
def setup():
    from transformers import LlamaConfig, LlamaForCausalLM

    from autopar.frontend.precision import annotate_autocast, mark_run_dtypes
    from autopar.frontend.trace import trace

    cfg = LlamaConfig(num_hidden_layers=2, hidden_size=1024, num_attention_heads=8,
                      num_key_value_heads=4, intermediate_size=2816, vocab_size=VOCAB,
                      max_position_embeddings=SEQ, use_cache=False)  # fmt: skip
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    x = torch.randint(0, VOCAB, (BATCH, SEQ), device="meta")
    gm = trace(model, (x, x), None, _loss).gm
    annotate_autocast(gm, torch.bfloat16)
    return model, x, GraphModel.from_traced(mark_run_dtypes(gm)), Cluster.preset("dgx-h100",
                                                                                 nodes=2)


@pytest.mark.parametrize("degrees,zero,recompute", CONFIGS,
                         ids=["fsdp", "fsdp-full", "pp-dp"])  # fmt: skip
def test_search_memory_equals_compiled(setup, degrees, zero, recompute):
    from autopar import Mesh, autoparallelize

    model, x, priced, cluster = setup
    dp, pp = degrees.get("dp", 1), degrees.get("pp", 1)
    cfg = ParallelConfig(tp=degrees.get("tp", 1), pp=pp, dp=dp, cp=degrees.get("cp", 1),
                         zero=zero, global_batch=BATCH,
                         micro_batch=1 if pp > 1 else BATCH // dp, schedule="1f1b",
                         virtual_stages=1, recompute=recompute,
                         sequence_parallel=False)  # fmt: skip
    est = estimate(priced, cluster, cfg)
    options = {"n_microbatches": BATCH // dp} if pp > 1 else {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prog = autoparallelize(model, Mesh(cluster, **degrees), (x, x), loss_fn=_loss,
                               zero=zero, recompute=recompute, param_dtype=torch.bfloat16,
                               **options)  # fmt: skip
    compiled = prog.plan.dp.memory[prog.plan.dp.zero].total
    searched = est.memory.total - est.memory.reserved
    assert compiled == pytest.approx(searched, rel=0.02)
    assert prog.plan.dp.step is not None and prog.plan.dp.step.total > prog.plan.dp.step.sub_mesh
