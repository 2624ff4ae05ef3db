from __future__ import annotations

import torch
from golden import assert_golden

from autopar import Mesh, autoparallelize
from autopar.tools.testing import Config, build, lm_loss, tokens


def test_printed_graph(mlp_prog):
    _, graphs = mlp_prog
    assert_golden("mlp_tp2_localize", graphs["localize"])


def test_view_arguments_are_local_shapes():
    c = Config(layers=1, hidden=32, heads=4, kv_heads=4, ffn=64, vocab=64, seq=8, batch=2)
    prog = autoparallelize(build("gpt", c), Mesh(tp=4), tokens(c), loss_fn=lm_loss)
    views = [n for n in prog.graph_module.graph.nodes
             if n.target in (torch.ops.aten.view.default, torch.ops.aten.reshape.default)]  # fmt: skip
    assert views
    for n in views:
        assert list(n.args[1]) == list(n.meta["val"].shape)
        assert -1 not in n.args[1]
    heads = [n for n in views if len(n.args[1]) == 4]
    assert heads and all(n.args[1][2] == 1 for n in heads)  # 4 heads over 4 ranks
