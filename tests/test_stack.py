from __future__ import annotations

import torch
import torch.fx as fx
import torch.fx.proxy as fx_proxy

from autopar.frontend.stack import shown_frames
from autopar.tools.testing import hf_tiny_llama


def _stack_traces(gm: fx.GraphModule) -> dict[str, str | None]:
    return {n.name: n.meta.get("stack_trace") for n in gm.graph.nodes}


def test_export_records_the_same_stack_traces_as_torch():
    model, ids = hf_tiny_llama(1), torch.zeros(1, 8, dtype=torch.long)
    want = torch.export.export(model, (ids,), strict=False)
    with shown_frames():
        got = torch.export.export(model, (ids,), strict=False)
    traces = _stack_traces(want.graph_module)
    assert _stack_traces(got.graph_module) == traces
    assert sum("modeling_llama.py" in (s or "") for s in traces.values()) > 20


def test_a_tracer_showing_every_frame_gets_every_frame():
    class Tracer(fx.Tracer):
        record_stack_traces = True

    def trace() -> dict[str, str | None]:
        return _stack_traces(fx.GraphModule(model, Tracer().trace(model)))

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
    want = trace()
    with shown_frames():
        got = trace()
    assert got == want
    assert "in create_node" in (got["_0"] or "")  # fx's own frames: kept, not just forward


def test_torch_recorder_is_back_afterwards():
    before = fx_proxy.CapturedTraceback
    with shown_frames():
        assert fx_proxy.CapturedTraceback is not before
    assert fx_proxy.CapturedTraceback is before
