"""DeepSeek-V3's multi-head latent attention under tp (issue 20.4, in part): its key is a
``new_empty`` buffer made from the head-split ``kv_b`` output and filled with ``copy_``; the
buffer is made split by heads where that output lies (``rules.pointwise.new_like``), so
nothing is gathered to build it, and outputs and every gradient equal one device's."""

from __future__ import annotations

import logging

import pytest
import torch

from autopar import Mesh, autoparallelize
from autopar.verify import verify

transformers = pytest.importorskip("transformers")

TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
            n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, kv_lora_rank=16,
            q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
            first_k_dense_replace=1, n_group=1, topk_group=1, max_position_embeddings=64,
            use_cache=False)  # fmt: skip


def test_mla_key_buffer_is_made_split_by_heads_and_matches_single_device():
    logging.getLogger("transformers").setLevel(logging.ERROR)
    torch.manual_seed(0)
    model = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**TINY))
    ids = torch.randint(3, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    prog = autoparallelize(model, Mesh(tp=2), (ids,), example_kwargs={"labels": ids})
    buffers = [n for n in prog.graph_module.graph.nodes
               if n.target is torch.ops.aten.new_empty.default]  # fmt: skip
    assert len(buffers) == 2  # one key buffer per layer
    assert all(str(n.meta["autopar"].layout) == "P(None, 'tp', None, None)" for n in buffers)
    assert all(tuple(n.meta["val"].shape) == (2, 2, 16, 16) for n in buffers)  # local: 2 heads
    report = verify(model, Mesh(tp=2), (ids,), example_kwargs={"labels": ids})
    assert report.ok, str(report)
