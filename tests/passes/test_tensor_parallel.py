from __future__ import annotations

import torch

from autopar import Mesh, autoparallelize
from autopar.ops import collectives, parallel_ops
from autopar.tools.testing import Config, build, lm_loss, tokens


def lowered_targets(kind: str, memory_weight: float = 0.0, **cfg) -> set:
    c = Config(**{"layers": 1, "hidden": 1024, "heads": 16, "kv_heads": 16, "ffn": 4096,
                  "vocab": 32000, "seq": 512, "batch": 2, "bias": False, **cfg})  # fmt: skip
    with torch.device("meta"):
        model = build(kind, c)
    prog = autoparallelize(
        model, Mesh(tp=4), tokens(c), loss_fn=lm_loss, memory_weight=memory_weight
    )
    return {n.target for n in prog.graph_module.graph.nodes}


def test_vocab_parallel_embedding_and_cross_entropy():
    # a 32000 x 1024 table is worth splitting once memory has a price (1 ms per GB); tied to
    # the vocab-split LM head, it is split by vocab rows (untied, splitting the hidden dim and
    # all-gathering costs half an all-reduce, and the solver rightly prefers that)
    targets = lowered_targets("gpt", memory_weight=1e-12, tied=True)
    assert parallel_ops.vocab_parallel_embedding in targets
    assert parallel_ops.vocab_parallel_cross_entropy in targets
    assert torch.ops.aten.cross_entropy_loss.default not in targets


def test_shared_kv_heads_need_no_lowering():
    """Fewer K/V heads than ranks: K/V split in shared pieces (each rank's own head), so no
    ``local_kv_heads`` slice; the shared weights' gradients are summed over their ranks."""
    targets = lowered_targets("llama", kv_heads=2)
    assert parallel_ops.local_kv_heads not in targets
    assert collectives.grad_sum_shared in targets
