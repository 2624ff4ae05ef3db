"""A program checks its inputs: a traced-in constant passed with another value, or a tensor of
another shape or dtype, is an InputError naming the input -- never a silently wrong answer
(torch.export folds non-tensor inputs into the graph) nor an error deep inside an op."""

from __future__ import annotations

import pickle

import pytest
import torch
import torch.nn as nn

from autopar import InputError, Mesh, autoparallelize
from autopar.runtime.pool import get_pool
from autopar.tools.testing import Config, build, lm_loss, tokens


class Scaled(nn.Module):
    """Its output depends on a float and a bool input, which export folds into the graph."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x: torch.Tensor, scale: float = 1.0, double: bool = False) -> torch.Tensor:
        y = self.b(torch.relu(self.a(x))) * scale
        return y * 2 if double else y


X = torch.randn(8, 8)


@pytest.fixture(scope="module")
def prog():
    return autoparallelize(Scaled(), Mesh(tp=2), (X, 0.5), example_kwargs={"double": True})


def _unbound(prog, *args, **kwargs):
    """Rank 0's program called outside a job: inputs that pass the checks reach the first
    collective, which says the mesh is not bound (or none, and it returns None); inputs that
    do not, raise InputError (returned)."""
    return _called(prog.module(0), *args, **kwargs)


def _called(module, *args, **kwargs):
    try:
        module(*args, **kwargs)
    except (InputError, RuntimeError) as e:
        return e
    return None


def test_the_printed_program_shows_what_it_checks(prog):
    code = prog.code(rank=0)
    assert "expect_tensor('x', x, 'f32[8, 8]')" in code
    assert "expect_constant('scale', scale, '0.5')" in code
    assert "expect_constant('double', double, 'True')" in code


def test_inputs_like_the_example_pass_the_checks(prog):
    err = _unbound(prog, X, 0.5, double=True)
    assert not isinstance(err, InputError) and "not bound" in str(err)
    assert not isinstance(_unbound(prog, torch.zeros(8, 8), 0.5, True), InputError)


@pytest.mark.parametrize("args, kwargs, said", [
    ((X, 0.7), {"double": True}, "input 'scale' is float 0.7, but the model was traced with 0.5"),
    ((X, 0.5), {"double": False}, "input 'double' is bool False, but the model was traced with True"),
    ((X, 1), {"double": True}, "input 'scale' is int 1, but the model was traced with 0.5"),
    ((X[:4], 0.5), {"double": True}, "input 'x' is f32[4, 8] on this rank, but this rank's "
                                     "program was compiled for f32[8, 8]"),
    ((X.double(), 0.5), {"double": True}, "input 'x' is f64[8, 8] on this rank"),
    ((X, torch.tensor(0.5)), {"double": True}, "input 'scale' is a tensor f32[], but"),
])  # fmt: skip
def test_another_constant_shape_or_dtype_is_an_input_error(prog, args, kwargs, said):
    err = _unbound(prog, *args, **kwargs)
    assert isinstance(err, InputError), err
    assert said in str(err), str(err)


def test_a_constant_of_equal_value_passes_but_a_bool_is_not_an_int():
    class Times(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor, n: int) -> torch.Tensor:
            return self.w(x) * n

    prog = autoparallelize(Times(), Mesh(tp=2), (torch.randn(2, 4), 1))
    assert not isinstance(_unbound(prog, torch.randn(2, 4), 1.0), InputError)
    err = _unbound(prog, torch.randn(2, 4), True)
    assert isinstance(err, InputError) and "traced with 1" in str(err)


def test_a_program_sent_to_another_process_keeps_its_checks(prog):
    """A pickled rank program is rebuilt without node metadata: the checks travel with it."""
    m = pickle.loads(pickle.dumps(prog.module(0)))
    err = _called(m, X, 0.7, double=True)
    assert isinstance(err, InputError) and "traced with 0.5" in str(err)
    assert not isinstance(_called(m, X, 0.5, double=True), InputError)


def test_a_loss_fn_call_names_its_inputs_by_position():
    c = Config(layers=1, hidden=32, heads=2, kv_heads=2, ffn=64, vocab=64, seq=8, batch=2)
    x, y = tokens(c)
    prog = autoparallelize(build("llama", c), Mesh(tp=2), (x, y), loss_fn=lm_loss)
    assert "expect_tensor('example_inputs[0]', args_0, 'i64[2, 8]')" in prog.code(rank=0)
    err = _unbound(prog, x[:, :4], y)
    assert isinstance(err, InputError)
    assert "example_inputs[0] is i64[2, 4] on this rank" in str(err)
    assert "compiled for i64[2, 8]" in str(err)


PP = Config(layers=2, hidden=32, heads=2, kv_heads=2, ffn=64, vocab=64, seq=8, batch=4)


def _pipeline_step(rank: int, groups: dict, share, x: torch.Tensor, y: torch.Tensor) -> str:
    from autopar.ops import collectives
    from autopar.runtime import PipelineRunner

    collectives.bind(groups)
    runner = PipelineRunner(share, groups["pp"])
    try:
        runner.step(x, y)
    except InputError as e:
        return str(e)
    return "ran"


def test_a_pipeline_step_checks_the_whole_call_on_every_rank():
    """Every rank raises before the schedule runs (none is left waiting for a stage that
    failed), naming the whole step's shape: dim 0 is micro-batches x micro-batch."""
    x, y = tokens(PP)
    prog = autoparallelize(build("llama", PP), Mesh(pp=2), (x, y), loss_fn=lm_loss,
                           n_microbatches=2)  # fmt: skip
    shares = [prog.share(r) for r in range(2)]
    pool = get_pool(2)
    ok = pool.run(_pipeline_step, prog.mesh.axes, [(s, x, y) for s in shares])
    assert ok == ["ran", "ran"]
    said = pool.run(_pipeline_step, prog.mesh.axes, [(s, x[:2], y[:2]) for s in shares])
    for msg in said:
        assert msg.startswith("example_inputs[0] is i64[2, 8] on this rank, but the pipeline "
                              "step was compiled for i64[4, 8] (this rank's batch, split into 2 "
                              "micro-batches along dim 0"), msg  # fmt: skip


def test_a_pipeline_step_takes_keywords_in_any_order_but_not_other_keywords():
    from autopar.runtime.guards import StepInputs

    class Keyed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor, *, a: torch.Tensor, flag: bool) -> torch.Tensor:
            return self.w(x + a) if flag else self.w(x)

    from autopar.frontend.trace import trace

    x, a = torch.randn(2, 4), torch.randn(2, 4)
    inputs = StepInputs.of(trace(Keyed(), (x,), {"a": a, "flag": True}), 2)
    inputs.check((torch.randn(4, 4),), {"flag": True, "a": torch.randn(4, 4)})
    with pytest.raises(InputError, match=r"compiled for \(1 positional, keywords \[a, flag\]\)"):
        inputs.check((torch.randn(4, 4),), {"a": torch.randn(4, 4)})
    with pytest.raises(InputError, match="input 'flag' is bool False"):
        inputs.check((torch.randn(4, 4),), {"a": torch.randn(4, 4), "flag": False})
