"""What a program compiled with ``autoparallelize(..., compile=True)`` calls: one repeated block
under ``torch.compile``, as torchtitan compiles a model (per block, so a 32-layer model compiles
one block).

Algorithm (:func:`compiled`, on a block's first call in a process):
1. The block's structural signature: each node's op, target and arguments (other nodes by
   position), its parameter reads by their names relative to the block, and the same of each
   graph module it calls (its submodules, or one passed as an argument).  Blocks with equal
   signatures compute the same function of their own parameters.
2. The first block of a signature gets its class's ``forward`` replaced by
   ``torch.compile(forward, backend=...)``; every later block of that signature takes the
   first one's class (and the graph modules it calls take theirs, e.g. a higher-order op's
   body), so dynamo's guards (the type of ``self`` and of those modules) hold and the
   compiled code is reused: one compile per distinct block, also across programs.
3. The block is then called as a module (``region(*args)``), so module hooks (FSDP2's
   per-block gathers) run eagerly around the compiled forward.  ``recompute=True`` compiles
   the forward wrapped in non-reentrant ``torch.utils.checkpoint`` (dynamo traces the
   checkpoint as one region; a compiled frame entered under checkpoint's saved-tensor hooks
   would run eagerly), as torchtitan compiles an activation-checkpointed block.
The collectives inside a block (autograd Functions over c10d, autopar.ops.collectives) are
traced by dynamo without graph breaks (tests/test_compile.py counts them); the ring steps of cp
attention and of autopar's collective matmuls trace as functional all-to-alls
(autopar.ops.cp_ops._Exchange).  The expert all-to-alls are custom ops whose received row
count is data-dependent, so a block is traced with ``capture_dynamic_output_shape_ops`` (an
unbacked size instead of a graph break; the rest of a block is the static-shape ATen graph
autopar planned, which has no such op).

Where the platform has it (:func:`micro_pipeline_tp`: inductor on CUDA with NCCL and symmetric
memory), ``micro_pipeline_tp=True`` also turns on inductor's micro-pipelined TP
(``torch._inductor.config._micro_pipeline_tp``, symmetric memory for the tp group) before the
first compile: inductor's pattern matcher fuses the tp all-gather + matmul and matmul +
reduce-scatter pairs, which autopar then leaves whole (Options.overlap_mode).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx
import torch.utils.checkpoint
from torch.fx._lazy_graph_module import _LazyGraphModule

# (backend, recompute, signature) -> the compiled class and its nested graph modules' classes
_CLASSES: dict[tuple[str, bool, tuple], tuple[type, dict[str, type]]] = {}


def compiled(region: torch.nn.Module, *args: Any, backend: str = "inductor",
             recompute: bool = False, micro_pipeline_tp: bool = False) -> Any:  # fmt: skip
    """``region(*args)`` with ``region``'s forward compiled (steps 1-3)."""
    _prepare(region, args, backend, recompute, micro_pipeline_tp)
    return region(*args)


def micro_pipeline_tp(backend: str) -> tuple[bool, str]:
    """Whether inductor's micro-pipelined TP can fuse the tp pairs of a program compiled with
    ``backend`` on this platform, and why (not).  Its fused kernels
    (``torch.ops.symm_mem.fused_all_gather_matmul`` / ``fused_matmul_reduce_scatter``) copy
    chunks through CUDA symmetric memory between the GPUs of one node, over NCCL groups."""
    if backend != "inductor":
        return False, (f"compile backend {backend!r}: micro-pipelined TP is an inductor pass; "
                       "autopar's own ring steps run the pairs")  # fmt: skip
    if not torch.cuda.is_available():
        return False, ("no CUDA device: micro-pipelined TP needs CUDA symmetric memory; "
                       "autopar's own ring steps run the pairs")  # fmt: skip
    if not torch.distributed.is_nccl_available():
        return False, "this torch has no NCCL; autopar's own ring steps run the pairs"
    return True, ("inductor's micro-pipelined TP (torch._inductor.config._micro_pipeline_tp, "
                  "symmetric memory on the tp group) fuses the all-gather + matmul and "
                  "matmul + reduce-scatter pairs; autopar leaves them whole for it")  # fmt: skip


def _enable_micro_pipeline_tp() -> None:
    """Inductor's micro-pipelined TP on, symmetric memory for the tp group (before a block's
    first compile)."""
    import warnings

    import torch._inductor.config
    from torch.distributed import _symmetric_memory

    from autopar.ops.collectives import group

    torch._inductor.config._micro_pipeline_tp = True
    with warnings.catch_warnings():  # deprecated in torch 2.13, yet the pass still checks it
        warnings.simplefilter("ignore", FutureWarning)
        _symmetric_memory.enable_symm_mem_for_group(group("tp").group_name)


def _prepare(region: torch.nn.Module, args: tuple, backend: str, recompute: bool,
             pipelined: bool) -> None:  # fmt: skip
    """Steps 1-2, once per block object."""
    if getattr(region, "_autopar_compiled", False):
        return
    if pipelined:
        _enable_micro_pipeline_tp()
    nested = _nested(region, args)
    key = (backend, recompute, signature(region), tuple((k, signature(m)) for k, m in nested))
    if key not in _CLASSES:
        for m in (region, *(m for _, m in nested)):
            if isinstance(m, _LazyGraphModule):  # its code, before dynamo reads ``forward``
                m.real_recompile()
        cls = type(region)
        forward = torch.compile(_checkpointed(cls.forward) if recompute else cls.forward,
                                backend=backend)  # fmt: skip
        cls.forward = torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True)(forward)
        _CLASSES[key] = cls, {k: type(m) for k, m in nested}
    else:
        cls, classes = _CLASSES[key]
        region.__class__ = cls
        for k, m in nested:  # e.g. a higher-order op's body: dynamo guards on its type too
            m.__class__ = classes[k]
    region._autopar_compiled = True


def _nested(region: torch.nn.Module, args: tuple) -> list[tuple[str, fx.GraphModule]]:
    """The graph modules a block calls besides itself: its own submodules, and those passed
    as arguments (a higher-order op's body read outside the block), by name or position."""
    inner = [(k, m) for k, m in region.named_modules() if k and isinstance(m, fx.GraphModule)]
    return inner + [(f"arg{i}", a) for i, a in enumerate(args) if isinstance(a, fx.GraphModule)]


def _checkpointed(forward: Any) -> Any:
    def run(self: torch.nn.Module, *args: Any) -> Any:
        return torch.utils.checkpoint.checkpoint(forward, self, *args, use_reentrant=False)

    return run


def signature(region: torch.nn.Module) -> tuple:
    """Step 1: what makes two blocks the same function (names of values aside)."""
    if not isinstance(region, fx.GraphModule):
        return (id(region),)
    index = {n: i for i, n in enumerate(region.graph.nodes)}

    def norm(a: Any) -> str:
        return repr(fx.node.map_arg(a, lambda n: f"%{index[n]}"))

    return tuple((n.op, "" if n.op == "placeholder" else str(n.target), norm(n.args),
                  norm(n.kwargs)) for n in region.graph.nodes)  # fmt: skip


def compile_stats(*_: Any) -> dict[str, int]:
    """What dynamo counted in this process so far: graph breaks, distinct graphs compiled
    (arguments ignored, so a worker pool can run it as a job)."""
    from torch._dynamo.utils import counters

    return {"graph_breaks": sum(counters["graph_break"].values()),
            "unique_graphs": counters["stats"]["unique_graphs"]}  # fmt: skip
