"""Two pieces of torch.export's work that an autopar trace never uses, skipped.

1. **The unbacked-size re-scan.**  After tracing, export recomputes every node's
   ``unbacked_bindings`` (``torch.export._trace._replace_unbacked_bindings``): it drops the
   key from each node's metadata, then walks each node's value (every size, stride and storage
   offset of every tensor) looking for the shape environment's unbacked symbols -- sizes read
   from tensor values (``.item()``, ``nonzero`` ...) -- to record where each is bound.  A
   model whose sizes all follow from the example inputs' shapes has none, so the walk finds
   nothing on any node (~0.2 s at the 80-layer Llama shape).  Inside :func:`lean_export`
   export reads that pass as :func:`_rescanner`'s: it collects the symbols torch's pass would
   look for (the shape environment's unbacked symbols that were not renamed, torch's own
   test); none: it drops ``unbacked_bindings`` from every node, which is all torch's pass does
   then; some (or no shape environment): it runs torch's pass.
2. **The exported program's Python code.**  ``ExportedProgram.__init__`` wraps its graph in
   ``torch.fx.GraphModule(root, graph)``, which generates and compiles the Python code of the
   whole graph (~0.12 s at 80 layers), while autopar only reads the graph and rewrites it
   (``trace._collect`` makes it a lazy module).  Inside :func:`lean_export` that module is a
   ``_LazyGraphModule``: the same graph, its code generated when first called or read.

Each replaced function is restored on exit; a torch without one of them is left alone.  The
graph, every node's metadata, the program's signature and its code are the same
(``tests/test_lean_export.py``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch.fx as fx
from torch.fx._lazy_graph_module import _LazyGraphModule

try:  # private torch helpers the replaced passes use themselves; without them nothing changes
    import torch.export._trace as _export_trace
    import torch.export.exported_program as _exported_program
    from torch._export.utils import _get_shape_env_from_gm
    from torch.utils._sympy.symbol import SymT, symbol_is_type

    _UNBACKED = (SymT.UNBACKED_INT, SymT.UNBACKED_FLOAT)
except ImportError:  # pragma: no cover - another torch
    _export_trace = _exported_program = None


@contextlib.contextmanager
def lean_export() -> Iterator[None]:
    """torch.export inside skips the work of steps 1 and 2."""
    with contextlib.ExitStack() as stack:
        original = getattr(_export_trace, "_replace_unbacked_bindings", None)
        if original is not None:
            stack.enter_context(_replaced(_export_trace, "_replace_unbacked_bindings",
                                          _rescanner(original)))  # fmt: skip
        if hasattr(_exported_program, "_create_graph_module_for_export"):
            stack.enter_context(_replaced(_exported_program, "_create_graph_module_for_export",
                                          _lazy_graph_module))  # fmt: skip
        yield


@contextlib.contextmanager
def _replaced(module: object, name: str, stand_in: Callable) -> Iterator[None]:
    original = getattr(module, name)
    setattr(module, name, stand_in)
    try:
        yield
    finally:
        setattr(module, name, original)


def _rescanner(original: Callable[[fx.GraphModule], None]) -> Callable[[fx.GraphModule], None]:
    """Step 1: torch's pass, run only when some unbacked symbol could be found."""

    def _rescan(gm: fx.GraphModule) -> None:
        shape_env = _get_shape_env_from_gm(gm)
        if shape_env is None or any(
            symbol_is_type(s, _UNBACKED) and s not in shape_env.unbacked_renamings
            for s in shape_env.var_to_range
        ):
            original(gm)  # (without a shape environment torch's pass returns at once)
            return
        for node in gm.graph.nodes:
            node.meta.pop("unbacked_bindings", None)

    return _rescan


def _lazy_graph_module(root: object, graph: fx.Graph) -> fx.GraphModule:
    """Step 2: the exported program's graph module, its code generated on demand."""
    return _LazyGraphModule(root, graph)
