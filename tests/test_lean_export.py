from __future__ import annotations

import torch
import torch.export._trace as export_trace
import torch.export.exported_program as exported_program

from autopar.frontend.lean_export import lean_export
from autopar.tools.testing import hf_tiny_llama


def _export(model: torch.nn.Module, *args: torch.Tensor) -> torch.export.ExportedProgram:
    return torch.export.export(model, args, strict=False)


def _meta(ep: torch.export.ExportedProgram) -> dict[str, dict[str, str]]:
    """Every node's metadata, printed (values hold fake tensors)."""
    return {n.name: {k: str(v) for k, v in n.meta.items()} for n in ep.graph.nodes}


def _same(got: torch.export.ExportedProgram, want: torch.export.ExportedProgram) -> None:
    assert str(got.graph) == str(want.graph)
    assert _meta(got) == _meta(want)
    assert str(got.graph_signature) == str(want.graph_signature)
    assert got.graph_module.code == want.graph_module.code  # made on demand, the same


def test_a_static_model_exports_the_same_program():
    model, ids = hf_tiny_llama(1), torch.zeros(1, 8, dtype=torch.long)
    want = _export(model, ids)
    with lean_export():
        got = _export(model, ids)
    _same(got, want)
    assert not any("unbacked_bindings" in m for m in _meta(got).values())
    assert torch.equal(got.module()(ids).logits, want.module()(ids).logits)


class _Nonzero(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.nonzero() * 2


def test_unbacked_sizes_are_still_bound():
    x = torch.tensor([0.0, 1.0, 2.0, 0.0])
    want = _export(_Nonzero(), x)
    with lean_export():
        got = _export(_Nonzero(), x)
    _same(got, want)
    assert any("unbacked_bindings" in m for m in _meta(got).values())  # nonzero's row count


def test_torch_functions_are_back_afterwards():
    before = (export_trace._replace_unbacked_bindings,
              exported_program._create_graph_module_for_export)  # fmt: skip
    with lean_export():
        assert export_trace._replace_unbacked_bindings is not before[0]
        assert exported_program._create_graph_module_for_export is not before[1]
    assert (export_trace._replace_unbacked_bindings,
            exported_program._create_graph_module_for_export) == before  # fmt: skip
