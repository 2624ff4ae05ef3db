"""Input guards: a program runs only on inputs like the ones it was compiled for.

torch.export specialises a program to its example inputs: every tensor's shape and dtype is a
number in the graph (autopar refuses symbolic shapes), and a non-tensor input -- a flag such
as HF's ``use_cache=False``, a float scale -- is folded into the ops as the value it had.
Called with another value, such a program would compute with the traced one and return a
silently wrong answer; called with another shape or dtype, it fails deep inside an op (or,
where a size was folded into arithmetic, returns a wrong answer).  So every generated program
checks its inputs first, in lines the printed program shows:

    expect_tensor('x', x, 'f32[4, 8]')      # this rank's part of the batch under dp / pp
    expect_constant('scale', scale, '0.5')  # the traced value, as repr() wrote it

Algorithm (:class:`GuardedCodeGen`, the pytree code generator of every autopar program):
1. When the program's code is generated, each placeholder's traced value (its ``val``
   metadata: a tensor, or the constant export kept) becomes an expectation: ``dtype[shape]``
   of a tensor, ``repr`` of a constant.  A graph rebuilt without metadata (a program sent to a
   worker process) keeps the expectations it was sent with.
2. The generated ``forward`` binds its inputs, then calls :func:`expect_tensor` /
   :func:`expect_constant` per input, which raise :class:`autopar.errors.InputError` naming
   the input, what it is, what the program was compiled for, and what to do.
3. A pipeline step (:class:`StepInputs`, checked by ``PipelineRunner.step`` on every rank
   before the schedule runs, so no rank waits on one that failed) checks the whole call the
   same way: the example call's structure, its constants, and each tensor with dim 0 times
   the micro-batch count (torch's schedules split dim 0).
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from typing import Any

import torch
from torch.fx.graph import _PyTreeCodeGen, _register_custom_builtin, dtype_abbrs
from torch.utils import _pytree as pytree

from autopar.errors import InputError

Expectation = tuple[str, str]  # ("tensor", "f32[4, 8]") or ("constant", repr of the value)

_REDO = ("autopar programs are specialised to their example inputs (torch.export): call it "
         "with inputs like those, or compile again with example inputs of the new kind")  # fmt: skip


def describe(value: Any) -> str:
    """``dtype[shape]`` of a tensor (``f32[4, 8]``), else the value's type and repr."""
    if isinstance(value, torch.Tensor):
        return f"{dtype_abbrs.get(value.dtype, str(value.dtype))}[{', '.join(map(str, value.shape))}]"
    return f"{type(value).__name__} {value!r:.60}"


def expectation(value: Any) -> Expectation:
    """Step 1: what an input traced as ``value`` must be at run time."""
    if isinstance(value, torch.Tensor):
        return ("tensor", describe(value))
    return ("constant", repr(value))


def label(name: str) -> str:
    """The user's name of an input placeholder: export names ``*args`` (a ``loss_fn`` call's
    model inputs and target) ``args_<i>``, which is ``example_inputs[i]``."""
    found = re.fullmatch(r"args_(\d+)", name)
    return f"example_inputs[{found.group(1)}]" if found else name


def _shown(name: str) -> str:
    shown = label(name)
    return shown if shown.startswith("example_inputs[") else f"input '{shown}'"


_SHARE = ("this rank's share of the example input: under dp each rank passes its slice of "
          "the batch, under pp the schedule passes micro-batches")  # fmt: skip


def expect_tensor(name: str, value: Any, spec: str, what: str = _SHARE,
                  where: str = "this rank's program") -> None:  # fmt: skip
    """Step 2: ``value`` is a tensor of dtype and shape ``spec`` (``f32[4, 8]``)."""
    got = describe(value)
    if not isinstance(value, torch.Tensor):
        raise InputError(f"{_shown(name)} is {got}, but {where} was compiled for a tensor "
                         f"{spec}; {_REDO}")  # fmt: skip
    if got != spec:
        raise InputError(f"{_shown(name)} is {got} on this rank, but {where} was compiled for "
                         f"{spec} ({what}); {_REDO}")  # fmt: skip


def expect_constant(name: str, value: Any, traced: str) -> None:
    """Step 2: ``value`` is the constant the program was traced with (``traced``, its repr):
    the same repr, or a value equal to it of the same kind (``1.0`` for ``1``, never ``True``
    for ``1``)."""
    if isinstance(value, torch.Tensor) or not _same(value, traced):
        kind = "a tensor " if isinstance(value, torch.Tensor) else ""
        raise InputError(
            f"{_shown(name)} is {kind}{describe(value)}, but the model was traced with {traced} and "
            f"the program computes with that value (torch.export folds a non-tensor input into "
            f"the graph): pass {traced}, or compile again with the value you want (pass it as "
            f"a tensor to keep it an input)")  # fmt: skip


def _same(value: Any, traced: str) -> bool:
    if repr(value) == traced:
        return True
    try:
        old = ast.literal_eval(traced)
    except (ValueError, SyntaxError):
        return False
    kinds = (isinstance(value, bool), isinstance(old, bool))
    try:
        return kinds[0] == kinds[1] and bool(value == old)
    except Exception:  # noqa: BLE001 - a value that cannot be compared is not the same
        return False


_register_custom_builtin("expect_tensor", "from autopar.runtime.guards import expect_tensor",
                         expect_tensor)  # fmt: skip
_register_custom_builtin("expect_constant", "from autopar.runtime.guards import expect_constant",
                         expect_constant)  # fmt: skip


@dataclass(frozen=True)
class StepInputs:
    """Step 3: what a pipeline step's call must look like (on one rank: its dp slice)."""

    in_spec: pytree.TreeSpec  # the example call's (args, kwargs) structure
    names: tuple[str, ...]  # each leaf's placeholder name
    expected: tuple[Expectation, ...]  # each leaf's, tensors with the whole step's dim 0
    n_microbatches: int

    @classmethod
    def of(cls, traced: Any, n_microbatches: int) -> StepInputs:
        """From a micro-batch trace (an :class:`autopar.frontend.trace.Traced`)."""
        held = {**traced.params, **traced.buffers}
        vals = [(n.name, n.meta["val"]) for n in traced.gm.graph.nodes
                if n.op == "placeholder" and n.name not in held]  # fmt: skip
        return cls(traced.in_spec, tuple(name for name, _ in vals),
                   tuple(expectation(_whole(v, n_microbatches)) for _, v in vals),
                   n_microbatches)  # fmt: skip

    def check(self, args: tuple, kwargs: dict[str, Any]) -> None:
        """Raise :class:`InputError` unless ``step(*args, **kwargs)`` is a call like the
        example one (kwargs in any order)."""
        kwargs = _ordered(kwargs, self.in_spec)
        leaves, spec = pytree.tree_flatten((tuple(args), kwargs))
        if spec != self.in_spec or len(leaves) != len(self.names):
            raise InputError(f"the pipeline step was called with inputs shaped "
                             f"{_structure(spec)}, but was compiled for "
                             f"{_structure(self.in_spec)}; {_REDO}")  # fmt: skip
        what = (f"this rank's batch, split into {self.n_microbatches} micro-batches along dim 0 "
                "by the schedule; under dp each rank passes its slice")  # fmt: skip
        for name, value, (kind, spec_) in zip(self.names, leaves, self.expected, strict=True):
            if kind == "tensor":
                expect_tensor(name, value, spec_, what, "the pipeline step")
            else:
                expect_constant(name, value, spec_)


def _whole(value: Any, n: int) -> Any:
    if isinstance(value, torch.Tensor) and value.dim():
        return value.new_empty((value.shape[0] * n, *value.shape[1:]), device="meta")
    return value


def _ordered(kwargs: dict[str, Any], in_spec: pytree.TreeSpec) -> dict[str, Any]:
    """``kwargs`` in the example call's keyword order (unknown ones last)."""
    if in_spec.num_children != 2 or in_spec.child(1).type is not dict:
        return kwargs
    order = list(in_spec.child(1).context)
    return {**{k: kwargs[k] for k in order if k in kwargs}, **kwargs}


def _structure(spec: pytree.TreeSpec) -> str:
    """``(2 positional, keywords [labels, use_cache])``: a call's shape in words."""
    if spec.num_children == 2 and spec.child(1).type is dict:
        return (f"({spec.child(0).num_children} positional, keywords "
                f"[{', '.join(map(str, spec.child(1).context))}])")  # fmt: skip
    return str(spec)


class GuardedCodeGen(_PyTreeCodeGen):
    """torch.fx's pytree code generator with the input checks of the module docstring."""

    def __init__(self, pytree_info: Any, expected: tuple[Expectation | None, ...] = ()) -> None:
        super().__init__(pytree_info)
        self.expected = tuple(expected)

    def _gen_python_code(self, nodes: Any, root_module: str, namespace: Any, **kwargs: Any) -> Any:
        vals = [n.meta.get("val", _MISSING) for n in nodes if n.op == "placeholder"]
        if vals and all(v is not _MISSING for v in vals):  # step 1 (else keep what was sent)
            self.expected = tuple(expectation(v) for v in vals)
        return super()._gen_python_code(nodes, root_module, namespace, **kwargs)

    def gen_fn_def(self, free_vars: list[str], maybe_return_annotation: str, *,
                   expanded_def: bool = False) -> str:  # fmt: skip
        names = [v.split(":")[0].split("#")[0].strip() for v in free_vars if v != "self"]
        code = super().gen_fn_def(free_vars, maybe_return_annotation, expanded_def=expanded_def)
        shown = self.pytree_info.orig_args if self.pytree_info else names
        if len(self.expected) != len(names) or len(shown) != len(names):
            return code
        checks = [f"expect_{kind}({label(name)!r}, {var}, {spec!r})"
                  for var, name, (kind, spec) in zip(names, shown, self.expected, strict=True)]  # fmt: skip
        return code + "".join(f"\n    {line}" for line in checks)


_MISSING = object()
