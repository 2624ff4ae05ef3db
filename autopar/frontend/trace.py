"""Capture a model (and its loss) as an ATen-level fx graph with torch.export.

Algorithm:
1. If ``loss_fn`` is given, wrap the model so the traced function is
   ``loss_fn(model(*inputs[:-1], **kwargs), inputs[-1])``; parameter names keep the model's.
2. If any parameter lives on the meta device, move the example inputs there too, so that
   planning never materialises a weight.
3. ``torch.export.export(..., strict=False)`` (training IR: linear, layer_norm, sdpa and
   cross_entropy stay whole ops).  On failure, run the model eagerly to tell "the inputs do not
   fit the model" from "torch.export cannot trace it", and raise one error quoting the reason and
   the user's source line.  Export runs with lazy graph modules: its own passes (set_grad and
   autocast regions as higher-order ops, placeholder naming ...) call ``recompile()`` on the
   whole graph a dozen times, and only the last code is ever read; without automatic garbage
   collection (its objects mostly outlive it: collecting would only rescan them); with each
   node's stack trace read off just the frames fx keeps (``autopar.frontend.stack``); and
   without two pieces of work whose results autopar never reads: re-scanning every value for
   unbacked sizes when the trace made none, and the exported program's eagerly compiled
   Python code (``autopar.frontend.lean_export``).  While tracing, ``x[..., [i, i+1, ...], :]``
   (a list of consecutive ints, the only advanced index) is recorded as ``x[..., i:i+n, :]``
   copied: the same fresh tensor, but a range the planner can read (a list index becomes a
   constant tensor whose values are lost on the meta device; Falcon's fused QKV reads K and V
   that way).
   ``cast`` (a 16-bit dtype; ``param_dtype`` under ``mixed_precision="cast"``): the export sees
   the model as FSDP2's ``MixedPrecisionPolicy(param_dtype=...)`` runs it, every floating
   parameter a ``cast`` copy and every floating model input cast (the loss's target and the
   buffers keep their dtype, as FSDP2 leaves them): the graph's values then carry the dtypes
   the model's own code gives them (HF RMSNorm's ``.to(float32)`` statistics, an fp32
   softmax, the loss's upcast stay fp32; the residual stream is ``cast``).  The copies exist
   only during the export; ``Traced.tensors`` keeps the model's own (fp32 master) tensors.
4. Drop unused parameter placeholders (the second name of a tied weight), drop
   ``_assert_tensor_metadata`` checks (they assert global metadata) and split each
   biased ``linear`` (and convolution) into ``linear`` + ``add``: a row-split linear must add
   its bias once, after the reduction, and as separate nodes the planner prices exactly that.  Per-expert loops
   become stacked experts (``autopar.frontend.moe_loop``).  Then ``autopar.frontend.canonical``: inference-mode dropout goes, and a sum of several matmul outputs
   adds them first (parallel attention + MLP blocks reduce once).
5. Record, per placeholder, which parameter, buffer or user input it is.
6. Refuse a graph with a data-dependent shape (a size torch.export could not make a number,
   read from values by ``.tolist()``, ``.item()``, ``nonzero`` ...): plans are made for fixed
   shapes, so the error names the op and the user's source line that reads the size.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import operator
import re
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn
from torch.fx._lazy_graph_module import _use_lazy_graph_module
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

from autopar.errors import InputError, TraceError
from autopar.frontend.canonical import canonicalize
from autopar.frontend.lean_export import lean_export
from autopar.frontend.moe_loop import LoopProblem, stack_expert_loops
from autopar.frontend.stack import shown_frames
from autopar.ir.meta import source
from autopar.ir.meta import update as meta_update
from autopar.ir.printing import lazy_module

_ASSERT_OPS = (torch.ops.aten._assert_tensor_metadata.default,)
_CONVS = (torch.ops.aten.conv1d.default, torch.ops.aten.conv2d.default,
          torch.ops.aten.conv3d.default, torch.ops.aten.conv1d.padding,
          torch.ops.aten.conv2d.padding, torch.ops.aten.conv3d.padding)  # fmt: skip


@dataclass(frozen=True)
class Piece:
    """Entries ``start:stop`` of dim ``dim`` of the user's parameter ``fqn``: one block of a
    fused projection that holds its own layout (autopar/frontend/fused.py).  With ``groups``
    > 1 the dim is viewed as ``[groups, n / groups]`` and the piece is entries ``start:stop``
    of every group, in group order (a fused QKV laid out per K/V head: Falcon's
    ``new_decoder_architecture``)."""

    fqn: str
    dim: int
    start: int
    stop: int
    groups: int = 1

    def of(self, whole: torch.Tensor) -> torch.Tensor:
        """This piece of the user's tensor ``whole`` (a view when ``groups`` is 1)."""
        if self.groups == 1:
            return whole.narrow(self.dim, self.start, self.stop - self.start)
        t = whole.movedim(self.dim, 0)
        t = t.reshape(self.groups, t.shape[0] // self.groups, *t.shape[1:])
        t = t.narrow(1, self.start, self.stop - self.start)
        return t.reshape(-1, *t.shape[2:]).movedim(0, self.dim)


def join_pieces(parts: Sequence[torch.Tensor], pieces: Sequence[Piece]) -> torch.Tensor:
    """The user's tensor from all of its ``pieces`` (in ``start`` order), held as ``parts``."""
    dim, groups = pieces[0].dim, pieces[0].groups
    if groups == 1:
        return torch.cat(list(parts), dim)
    per = [p.movedim(dim, 0) for p in parts]
    per = [p.reshape(groups, p.shape[0] // groups, *p.shape[1:]) for p in per]
    t = torch.cat(per, 1)
    return t.reshape(-1, *t.shape[2:]).movedim(0, dim)


@dataclass(frozen=True, kw_only=True)
class Traced:
    """A captured model: the graph plus what each placeholder stands for."""

    gm: fx.GraphModule
    params: dict[str, str]  # placeholder name -> parameter FQN
    buffers: dict[str, str]  # placeholder name -> buffer FQN (and lifted constants)
    user_inputs: tuple[str, ...]  # placeholder names of user inputs, in call order
    tensors: dict[str, torch.Tensor]  # FQN -> the model's parameter / buffer tensor
    trainable: frozenset[str]  # FQNs of parameters that require grad
    in_spec: pytree.TreeSpec
    out_spec: pytree.TreeSpec
    model_name: str
    grad_inputs: frozenset[str] = frozenset()  # inputs that carry a gradient (stage boundaries)
    padded: dict[str, int] = field(default_factory=dict)  # FQN -> dim-0 size before padding
    persistent: frozenset[str] = frozenset()  # buffer FQNs in the model's state_dict
    pieces: dict[str, Piece] = field(default_factory=dict)  # piece FQN -> part of a parameter


class _WithLoss(nn.Module):
    def __init__(self, model: nn.Module, loss_fn: Callable[..., torch.Tensor]) -> None:
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self.loss_fn(self.model(*args[:-1], **kwargs), args[-1])


def trace(
    model: nn.Module,
    example_inputs: Sequence[Any],
    example_kwargs: dict[str, Any] | None = None,
    loss_fn: Callable[..., torch.Tensor] | None = None,
    cast: torch.dtype | None = None,
) -> Traced:
    """Export ``model`` (plus ``loss_fn``) into a :class:`Traced` graph (``cast``: step 3)."""
    args, kwargs = tuple(example_inputs), dict(example_kwargs or {})
    if loss_fn is not None and not args:
        raise InputError(
            "loss_fn was given but example_inputs is empty: pass (model inputs..., target) "
            "so the loss is loss_fn(model(*inputs[:-1]), inputs[-1])."
        )
    root = _WithLoss(model, loss_fn) if loss_fn is not None else model
    if any(p.is_meta for p in model.parameters()):
        args, kwargs = pytree.tree_map_only(torch.Tensor, _to_meta, (args, kwargs))
    if cast is not None:
        args, kwargs = _cast_inputs(args, kwargs, cast, loss_fn is not None)
    try:
        with (
            _cast_parameters(model, cast),
            _quiet_fake_tensor_log(),
            _RunIndexAsSlice(),
            _use_lazy_graph_module(True),
            gc_paused(),
            shown_frames(),
            lean_export(),
        ):
            ep = torch.export.export(root, args, kwargs, strict=False)
    except Exception as exc:  # noqa: BLE001 - re-raised as a clear error below
        raise _explain_failure(model, root, args, kwargs, exc) from None
    prefix = "model." if loss_fn is not None else ""
    loops: list[LoopProblem] = []  # per-expert loops that could not be stacked
    traced = _collect(ep, model, prefix, loops)
    _require_static_shapes(traced.gm, type(model).__name__, loops)
    return traced


@contextlib.contextmanager
def _quiet_fake_tensor_log() -> Iterator[None]:
    """torch logs a traceback at ERROR level before raising; our error replaces both."""
    log = logging.getLogger("torch._subclasses.fake_tensor")
    level = log.level
    log.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        log.setLevel(level)


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """No automatic garbage collection inside: export (and the compile around it) allocates a
    few hundred thousand objects that mostly outlive it, and each collection would only scan
    them again, a full one the ~400K objects torch and transformers hold as well (~0.2 s).
    Collection resumes, with its own thresholds, afterwards."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


class _RunIndexAsSlice(TorchFunctionMode):
    """Step 3: ``x[..., [i, ..., i+n-1], ...]`` -> ``x[..., i:i+n, ...]`` copied to a fresh
    contiguous tensor (what advanced indexing returns)."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:  # fmt: skip
        kwargs = kwargs or {}
        if func is torch.Tensor.__getitem__ and len(args) == 2:
            index = _run_as_slice(args[0], args[1])
            if index is not None:
                return func(args[0], index).clone(memory_format=torch.contiguous_format)
        return func(*args, **kwargs)


def _run_as_slice(x: Any, index: Any) -> tuple | None:
    """The index with its one list of consecutive ints made a slice (None: not that case)."""
    items = index if isinstance(index, tuple) else (index,)
    lists = [i for i, it in enumerate(items) if isinstance(it, list)]
    basic = all(it is Ellipsis or isinstance(it, slice)
                or (isinstance(it, int) and not isinstance(it, bool)) for j, it in enumerate(items)
                if j not in lists)  # fmt: skip
    if len(lists) != 1 or not basic or items.count(Ellipsis) > 1 or not isinstance(x, torch.Tensor):
        return None
    at, run = lists[0], items[lists[0]]
    if not run or not all(isinstance(v, int) and not isinstance(v, bool) for v in run):
        return None
    dim = at if Ellipsis not in items[:at] else x.dim() - (len(items) - at)
    if not 0 <= dim < x.dim() or not all(-x.shape[dim] <= v < x.shape[dim] for v in run):
        return None
    vals = [v % x.shape[dim] for v in run]
    if vals != list(range(vals[0], vals[0] + len(vals))):
        return None
    return (*items[:at], slice(vals[0], vals[0] + len(vals)), *items[at + 1 :])


def _cast_inputs(args: tuple, kwargs: dict, dtype: torch.dtype,
                 has_target: bool) -> tuple[tuple, dict]:  # fmt: skip
    """Step 3, ``cast``: the model's floating inputs in ``dtype`` (a loss target keeps its own)."""
    low = lambda t: t.to(dtype) if t.is_floating_point() else t  # noqa: E731
    model_args = args[:-1] if has_target else args
    cast_args = pytree.tree_map_only(torch.Tensor, low, model_args)
    return (*cast_args, *args[len(model_args):]), pytree.tree_map_only(torch.Tensor, low, kwargs)


@contextlib.contextmanager
def _cast_parameters(model: nn.Module, dtype: torch.dtype | None) -> Iterator[None]:
    """Step 3, ``cast``: every floating parameter of ``model`` a ``dtype`` copy (tied weights one
    copy) while the context is open; the model's own parameters are back afterwards."""
    if dtype is None:
        yield
        return
    from torch.nn.utils.stateless import _reparametrize_module

    copies: dict[int, nn.Parameter] = {}
    swapped = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if p.is_floating_point() and p.dtype != dtype:
            if id(p) not in copies:
                copies[id(p)] = nn.Parameter(p.detach().to(dtype), requires_grad=p.requires_grad)
            swapped[name] = copies[id(p)]
    with _reparametrize_module(model, swapped, tie_weights=True):
        yield


def _to_meta(t: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(t, device="meta") if not t.is_meta else t


def _collect(ep: torch.export.ExportedProgram, model: nn.Module, prefix: str,
             loops: list[LoopProblem] | None = None) -> Traced:  # fmt: skip
    gm = lazy_module(ep.graph_module)  # the rewrites below recompile it: code made on demand
    lifted = {**ep.graph_signature.inputs_to_parameters, **ep.graph_signature.inputs_to_buffers}
    for node in list(gm.graph.nodes):
        if node.op == "placeholder" and node.name in lifted and not node.users:
            gm.graph.erase_node(node)  # a tied weight's second name: the graph reads the first
        elif node.op == "call_function" and node.target in _ASSERT_OPS:
            gm.graph.erase_node(node)
        elif node.target is torch.ops.aten.linear.default and _arg(node, 2, "bias") is not None:
            _split_bias(gm.graph, node)
        elif node.target is torch.ops.aten.addmm.default and _plain_addmm(node):
            _split_addmm(gm.graph, node)
        elif node.target in _CONVS and _arg(node, 2, "bias") is not None:
            _split_conv_bias(gm.graph, node)
    for node in gm.graph.nodes:  # after the splits: their new nodes copied unstripped paths
        if prefix and "nn_module_stack" in node.meta:
            node.meta["nn_module_stack"] = {
                k: (path.removeprefix(prefix), cls)
                for k, (path, cls) in node.meta["nn_module_stack"].items()
            }
    problems = stack_expert_loops(gm)  # per-expert loops -> stacked experts (static shapes)
    if loops is not None:
        loops += problems
    canonicalize(gm.graph)
    gm.graph.lint()
    gm.recompile()
    sig = ep.graph_signature
    strip = lambda fqn: fqn[len(prefix) :] if fqn.startswith(prefix) else fqn  # noqa: E731
    live = {n.name for n in gm.graph.nodes if n.op == "placeholder"}
    params = {k: strip(v) for k, v in sig.inputs_to_parameters.items() if k in live}
    buffers = {k: strip(v) for k, v in sig.inputs_to_buffers.items() if k in live}
    buffers.update({k: strip(v) for k, v in sig.inputs_to_lifted_tensor_constants.items()})
    named = dict(model.named_parameters(remove_duplicate=False))
    named.update(model.named_buffers(remove_duplicate=False))
    tensors = {fqn: named[fqn] for fqn in (*params.values(), *buffers.values()) if fqn in named}
    for fqn in sig.inputs_to_lifted_tensor_constants.values():
        tensors.setdefault(strip(fqn), ep.constants[fqn])
    trainable = frozenset(f for f in params.values() if named[f].requires_grad)
    for n in gm.graph.nodes:  # step 3, cast: the fp32 master behind each cast placeholder
        if n.name in params and n.meta["val"].dtype != named[params[n.name]].dtype:
            meta_update(n, master=named[params[n.name]].dtype)
    return Traced(
        gm=gm,
        params=params,
        buffers=buffers,
        user_inputs=tuple(sig.user_inputs),
        tensors=tensors,
        trainable=trainable,
        persistent=frozenset(buffers.values()) & frozenset(model.state_dict()),
        in_spec=ep.call_spec.in_spec,
        out_spec=ep.call_spec.out_spec,
        model_name=type(model).__name__,
    )


def _require_static_shapes(gm: fx.GraphModule, model_name: str,
                           loops: Sequence[LoopProblem] = ()) -> None:  # fmt: skip
    """Raise if a tensor's shape holds a symbol rather than a number (step 6), naming the op
    that read the symbol from tensor values (and why a per-expert loop was not stacked)."""
    nodes = list(gm.graph.nodes)
    shaped = next((n for n in nodes if _symbolic_dims(n)), None)
    if shaped is None:
        return
    dim = _symbolic_dims(shaped)[0]
    names = {str(s) for s in dim.node.expr.free_symbols}
    origin = next((n for n in nodes if isinstance(n.meta.get("val"), torch.SymInt)
                   and str(n.meta["val"]) in names), shaped)  # fmt: skip
    shape = list(shaped.meta["val"].shape)
    raise TraceError(
        f"{model_name} has a data-dependent shape: {_op(shaped)} makes a tensor of shape "
        f"{shape}, and {dim} is a number {_op(origin)} reads from tensor values at run time\n"
        f"  at {source(origin)}\n"
        "  autopar plans fixed shapes: every size must follow from the example inputs' shapes.\n"
        "  what to do: compute that size from shapes alone (for a mixture of experts, a fixed "
        "expert capacity instead of per-expert token counts)."
        + "".join(f"\n  a per-expert loop autopar could not stack: {p}" for p in loops)
    )


def _op(node: fx.Node) -> str:
    if node.target is operator.getitem and isinstance(node.args[0], fx.Node):
        return f"{_op(node.args[0])}[{node.args[1]}]"
    return str(node.target)


def _symbolic_dims(node: fx.Node) -> list[torch.SymInt]:
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        return []
    return [d for d in val.shape if isinstance(d, torch.SymInt)]


def _arg(node: fx.Node, index: int, name: str) -> Any:
    return node.args[index] if len(node.args) > index else node.kwargs.get(name)


def _split_bias(graph: fx.Graph, node: fx.Node) -> None:
    """linear(x, w, b) -> add(linear(x, w), b), keeping shapes and source metadata."""
    _bias_after(graph, node, torch.ops.aten.linear.default, node.args[:2], _arg(node, 2, "bias"))


def _plain_addmm(node: fx.Node) -> bool:
    """addmm(b, x, w) with beta = alpha = 1 (Conv1D projections: GPT-2, GPTBigCode)."""
    return _arg(node, 3, "beta") in (None, 1) and _arg(node, 4, "alpha") in (None, 1)


def _split_addmm(graph: fx.Graph, node: fx.Node) -> None:
    """addmm(b, x, w) -> add(mm(x, w), b): like a linear's bias, added once after a row split."""
    _bias_after(graph, node, torch.ops.aten.mm.default, node.args[1:3], node.args[0])


def _split_conv_bias(graph: fx.Graph, node: fx.Node) -> None:
    """conv(x, w, b, ...) -> add(conv(x, w, None, ...), b.view(c, 1, ...)): a conv split over
    its input channels adds the bias once, after the reduction, as a split linear does."""
    bias = _arg(node, 2, "bias")
    spatial = node.meta["val"].dim() - 2
    with graph.inserting_before(node):
        view = graph.call_function(torch.ops.aten.view.default, (bias, [-1] + [1] * spatial))
    view.meta.update({k: v for k, v in node.meta.items() if k != "autopar"})
    view.meta["val"] = bias.meta["val"].view(-1, *[1] * spatial)
    args = (*node.args[:2], None, *node.args[3:])
    kwargs = {k: v for k, v in node.kwargs.items() if k != "bias"}
    _bias_after(graph, node, node.target, args, view, kwargs)


def _bias_after(graph: fx.Graph, node: fx.Node, matmul: object, operands: tuple,
                bias: fx.Node, kwargs: dict | None = None) -> None:  # fmt: skip
    """Replace ``node`` by ``add(matmul(*operands, **kwargs), bias)``; the matmul (or conv)
    keeps the user's name."""
    with graph.inserting_after(node):
        mm = graph.call_function(matmul, tuple(operands), kwargs or {})
    with graph.inserting_after(mm):
        add = graph.call_function(torch.ops.aten.add.Tensor, (mm, bias))
    for new in (mm, add):
        new.meta.update({k: v for k, v in node.meta.items() if k != "autopar"})
    node.replace_all_uses_with(add)
    graph.erase_node(node)
    mm.name = node.name


def _explain_failure(
    model: nn.Module, root: nn.Module, args: tuple, kwargs: dict, exc: Exception
) -> Exception:
    """Turn an export failure into one clear error naming the reason and the source line."""
    try:
        with torch.no_grad(), _quiet_fake_tensor_log():
            root(*args, **kwargs)
    except Exception as eager_exc:  # noqa: BLE001 - classified and re-raised
        where = _user_frame(eager_exc, model)
        return InputError(
            f"example_inputs do not fit {type(model).__name__}: {_first_line(eager_exc)}\n"
            f"  at {where}\n"
            "  what to do: pass inputs with the shapes and dtypes the model's forward expects "
            "(with loss_fn, the last input is the loss target)."
        )
    where = _user_frame(exc, model)
    return TraceError(
        f"torch.export could not trace {type(model).__name__}: {_first_line(exc)}\n"
        f"  at {where}\n"
        f"  what to do: {_remedy(exc)}"
    )


# torch.export's refusal of a returned object it cannot flatten into tensors
_UNKNOWN_OUTPUT = re.compile(r"Found <class '([\w.]+)'> in output, which is not a known type")


def _remedy(exc: Exception) -> str:
    """What the user can change for an export failure: an output that is not tensors (a
    Hugging Face model's KV cache among them), or code export cannot trace."""
    found = _UNKNOWN_OUTPUT.search(str(exc))
    if found is None:
        return ("make that code traceable (no data-dependent Python control flow, no "
                ".item()/.tolist() steering shapes), or wrap it in a torch.cond.")
    name = found.group(1).rsplit(".", 1)[-1]
    cache = ("; a Hugging Face model returns its KV cache unless use_cache=False (set "
             "config.use_cache = False, or pass example_kwargs={'use_cache': False})"
             if "cache" in found.group(1).lower() else "")  # fmt: skip
    return (f"the forward returns a {name}, which torch.export cannot return: return tensors "
            f"(or register {name} as a pytree){cache}.")


def _first_line(exc: Exception) -> str:
    text = str(exc).strip()
    for line in text.splitlines():
        if line.strip():
            return f"{type(exc).__name__}: {line.strip()}"
    return type(exc).__name__


def _user_frame(exc: BaseException, model: nn.Module) -> str:
    """The innermost frame of the user's code in ``exc``'s traceback, with the module path."""
    names = {id(m): n or "<root>" for n, m in model.named_modules()}
    best, module = "an unknown location", ""
    for frame, lineno in traceback.walk_tb(exc.__traceback__):
        code = frame.f_code
        owner = frame.f_locals.get("self")
        if isinstance(owner, nn.Module) and id(owner) in names:
            module = f" (module '{names[id(owner)]}', {type(owner).__name__})"
        if _is_user_file(code.co_filename):
            line = _source_line(code.co_filename, lineno)
            best = f"{code.co_filename}:{lineno} in {code.co_name}: {line}"
    return best + module


def _is_user_file(path: str) -> bool:
    internal = ("/torch/", "/autopar/", "/passes/", "/cost/", "/transformers/utils/")
    return not any(p in path for p in internal) and not path.startswith("<")


def _source_line(path: str, lineno: int) -> str:
    import linecache

    return linecache.getline(path, lineno).strip()


def tensor_args(node: fx.Node) -> list[fx.Node]:
    """The node's tensor-valued inputs, in argument order, duplicates kept."""
    found: list[fx.Node] = []
    _tensor_leaves((node.args, node.kwargs), found)
    return found


def _tensor_leaves(a: object, found: list[fx.Node]) -> None:
    """``pytree.tree_leaves`` order over fx arguments, whose containers are only tuples
    (named or not), lists and dicts (fx stores them so; a slice is a leaf), without pytree's
    per-leaf type dispatch: the planner and the passes ask this for every node."""
    if isinstance(a, (tuple, list)):
        for x in a:
            _tensor_leaves(x, found)
    elif isinstance(a, dict):
        for x in a.values():
            _tensor_leaves(x, found)
    elif isinstance(a, fx.Node) and is_tensor(a):
        found.append(a)


def is_tensor(node: fx.Node) -> bool:
    return isinstance(node.meta.get("val"), torch.Tensor)


def is_getitem(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target is operator.getitem
