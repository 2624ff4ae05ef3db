"""verify() itself: garbage (NaN/inf, run-to-run differences, a corrupted shard on every kind
of program) fails by name; it works from a script without a main guard and from exec()-ed
notebook code; workers load the modules that register custom operators; a value written in
place is re-laid out after the writes."""

from __future__ import annotations

import collections
import os
import pickle
import subprocess
import sys
import types
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from verify_ops_fixture import ScaledMLP

import autopar
from autopar import Mesh, autoparallelize
from autopar.compare import bitwise_equal, check
from autopar.runtime.pool import dumps
from autopar.runtime.serialize import op_providers
from autopar.verify import verify

REPO = Path(autopar.__file__).resolve().parents[1]


class LogOfLinear(nn.Module):
    """Its output is NaN where the linear is negative, on one device and on every rank."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(x).log()


class Jitter(nn.Module):
    """Adds noise far below the tolerance: only run-to-run comparison can tell."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.a(x))
        return self.b(h + 1e-6 * torch.rand_like(h))


class FilledBuffer(nn.Module):
    """Fills a ``new_empty`` buffer slice by slice with ``copy_`` (as DeepSeek-V3's attention
    builds its keys) and feeds it to a split linear."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        buf = h.new_empty(x.shape[0], 16)
        buf[:, :8].copy_(h[:, 8:])
        buf[:, 8:].copy_(torch.relu(h[:, :8]))
        return self.b(buf)


class AddedInPlaceThenViewed(nn.Module):
    """Llama 4's MoE: ``out = shared(x); out.add_(routed(x)); x + out.view(x.shape)``, both
    row-parallel (partial): the view is taken after the in-place write, so its reduction
    goes after the view, not after the write."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 32), nn.Linear(8, 32)
        self.shared, self.routed = nn.Linear(32, 8, bias=False), nn.Linear(32, 8, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.view(-1, 8)
        out = self.shared(torch.relu(self.a(flat)))
        out.add_(self.routed(torch.relu(self.b(flat))))
        return x + out.view(x.shape)


class Kink(nn.Module):
    """``relu(h - h0)`` with ``h0`` the fp32 value of ``h`` on one device: every pre-activation
    is exactly 0 there, and +-rounding on the ranks (a row-parallel sum adds in another
    order), so relu's branch differs while the program is right."""

    def __init__(self, x: torch.Tensor) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(64, 1000, bias=False), nn.Linear(1000, 64, bias=False)
        self.c = nn.Linear(64, 64, bias=False)
        with torch.no_grad():
            self.register_buffer("h0", self.b(torch.relu(self.a(x))))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.relu(self.b(torch.relu(self.a(x))) - self.h0)).sum()


class KinkWithoutFloat64(Kink):
    """The kink, in a model whose kernels refuse float64 (HF's grouped matmul has none)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float64:
            raise RuntimeError("no float64 kernel")
        return super().forward(x)


class TracedDiffers(nn.Module):
    """A wrong program: the exported graph scales by 1.01, the eager model does not."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 32), nn.Linear(32, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = 1.01 if torch.compiler.is_exporting() else 1.0
        return self.b(torch.relu(self.a(x)) * scale)


def _x() -> torch.Tensor:
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(0))


def test_nan_in_output_fails_as_non_finite():
    torch.manual_seed(0)
    report = verify(LogOfLinear(), Mesh(tp=2), (_x(),))
    bad = [r for r in report.rows if not r.ok]
    assert not report.ok
    assert [r.name for r in bad] == ["output[0] (4, 16)"]
    assert "non-finite (NaN/inf) in ours and reference" in str(report)


@pytest.mark.parametrize(
    ("ours", "ref", "where"),
    [
        ([torch.tensor([1.0, float("nan")]), torch.tensor([1.0, 2.0])], torch.ones(2), "ours"),
        ([torch.ones(2), torch.ones(2)], torch.tensor([1.0, float("inf")]), "reference"),
        ([torch.ones(2), torch.tensor([float("-inf"), 1.0])], torch.ones(2), "ours"),
    ],
)
def test_check_names_where_the_non_finite_value_is(ours, ref, where):
    row = check("t", "output", ours, None, ref, Mesh(tp=2), 1e-4, 1.0)
    assert not row.ok
    assert row.note == f"non-finite (NaN/inf) in {where}"
    assert "BAD" in str(row) and "non-finite" in str(row)


def test_program_that_differs_between_identical_runs_fails():
    torch.manual_seed(0)
    report = verify(Jitter(), Mesh(tp=2), (_x(),))
    bad = [r for r in report.rows if not r.ok]
    assert bad, str(report)
    assert all(r.note == "nondeterministic across identical runs" for r in bad)
    assert all(r.max_rel < report.rtol for r in bad)  # the tolerance alone would have passed


def test_bitwise_equal():
    nan = torch.tensor([float("nan"), 1.0])
    assert bitwise_equal(nan, nan.clone())
    assert not bitwise_equal(torch.tensor(0.0), torch.tensor(-0.0))
    assert not bitwise_equal(torch.ones(2), torch.ones(2, dtype=torch.float64))
    assert not bitwise_equal(torch.ones(2), None)


def test_in_place_filled_buffer_is_relaid_out_after_its_writes():
    torch.manual_seed(0)
    report = verify(FilledBuffer(), Mesh(tp=2), (_x(),))
    assert report.ok, str(report)


@pytest.fixture
def one_thread():
    """The one-device reference on one thread, as the ranks run: with two threads MKL splits
    a K=1000 product's sum in halves, exactly as tp=2's row split does, and no kink flips."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_relu_kink_flip_is_told_apart_from_a_wrong_program_by_a_float64_rerun(one_thread):
    torch.manual_seed(0)
    x = torch.randn(16, 64)
    report = verify(Kink(x), Mesh(tp=2), (x,))
    assert not all(r.ok for r in report.rows)  # fp32 alone: the kink flips
    assert report.recheck is not None and report.recheck.max_rel_error < 1e-6
    assert report.ok and "re-run in float64: OK" in str(report)
    wrong = verify(TracedDiffers(), Mesh(tp=2), (_x(),))
    assert not wrong.ok and wrong.recheck is not None and not wrong.recheck.ok
    assert "wrong in float64 too" in str(wrong)


def test_float64_rerun_that_cannot_run_keeps_the_fp32_verdict(one_thread):
    torch.manual_seed(0)
    x = torch.randn(16, 64)
    report = verify(KinkWithoutFloat64(x), Mesh(tp=2), (x,))
    assert not report.ok and report.recheck is None
    assert "no float64 kernel" in report.recheck_error and "fp32 verdict stands" in str(report)


def test_view_taken_after_an_in_place_add_is_relaid_out_after_the_view():
    torch.manual_seed(0)
    report = verify(AddedInPlaceThenViewed(), Mesh(tp=2), (_x().view(2, 2, 8),))
    assert report.ok, str(report)


SCRIPT = """\
import torch, torch.nn as nn, autopar
class M(nn.Module):
    def __init__(s): super().__init__(); s.a = nn.Linear(8, 16); s.b = nn.Linear(16, 8)
    def forward(s, x): return s.b(torch.relu(s.a(x)))
r = autopar.verify(M(), autopar.Mesh(tp=2), (torch.randn(4, 8),)); print(r); assert r.ok
"""


def test_script_without_main_guard(tmp_path):
    script = tmp_path / "user_script.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=300, env=env, cwd=tmp_path)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert "verify on Mesh(tp=2): OK" in done.stdout


NOTEBOOK = """\
import collections
import torch, torch.nn as nn
Out = collections.namedtuple("Out", "y total")
class M(nn.Module):
    def __init__(s): super().__init__(); s.a = nn.Linear(8, 16); s.b = nn.Linear(16, 8)
    def forward(s, x):
        y = s.b(torch.relu(s.a(x)))
        return Out(y, y.sum())
"""


def test_notebook_code_run_with_exec():
    cell = types.ModuleType("notebook_cell")  # no __file__, not importable by a worker
    exec(NOTEBOOK, cell.__dict__)  # noqa: S102 - what a notebook kernel does
    torch.manual_seed(0)
    report = verify(cell.M(), Mesh(tp=2), (_x(),))
    assert report.ok, str(report)
    assert len([r for r in report.rows if r.kind == "output"]) == 2


def test_job_referencing_a_class_from_main_fails_fast_with_the_fix():
    thing = type("Thing", (), {"__module__": "__main__"})
    with pytest.raises(pickle.PicklingError, match=r"Thing is defined in the script being run "
                       r"\(__main__\).*Move Thing into a module file"):  # fmt: skip
        dumps(((), [thing()]))


def test_namedtuple_from_main_travels_by_name_and_fields():
    point = collections.namedtuple("Point", "x y")
    point.__module__ = "__main__"
    back = pickle.loads(dumps(point(1, 2)))
    assert type(back).__name__ == "Point" and back._fields == ("x", "y") and tuple(back) == (1, 2)


def test_custom_op_registered_with_library_runs_on_workers():
    torch.manual_seed(0)
    model = ScaledMLP()
    prog = autoparallelize(model, Mesh(tp=2), (_x(),))
    assert op_providers(prog.module(0))["modules"] == ["verify_ops_fixture"]
    report = verify(model, Mesh(tp=2), (_x(),))
    assert report.ok, str(report)


def _ids() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, 128, (2, 16), generator=g), torch.randint(0, 128, (2, 16), generator=g)


def test_hf_mixtral_custom_grouped_mm_op_verifies():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.MixtralConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
        num_experts_per_tok=2, max_position_embeddings=64, use_cache=False,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(cfg)
    ids, labels = _ids()
    prog = autoparallelize(model, Mesh(tp=2), (ids,), example_kwargs={"labels": labels})
    assert "transformers.integrations.moe" in op_providers(prog.module(0))["modules"]
    report = verify(model, Mesh(tp=2), (ids,), example_kwargs={"labels": labels})
    assert report.ok, str(report)


def test_hf_deepseek_v3_verifies_deterministically():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.DeepseekV3Config(
        vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1,
        n_routed_experts=4, kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8, v_head_dim=16,
        qk_nope_head_dim=16, n_group=2, topk_group=1, num_experts_per_tok=2,
        first_k_dense_replace=1, max_position_embeddings=64, use_cache=False,
    )  # fmt: skip
    torch.manual_seed(0)
    ids, labels = _ids()
    report = verify(transformers.DeepseekV3ForCausalLM(cfg), Mesh(tp=2), (ids,),
                    example_kwargs={"labels": labels})  # fmt: skip
    assert report.ok, str(report)
    assert report.max_rel_error < 1e-5


def test_float64_reference_casts_float_inputs():
    """``reference_dtype=torch.float64`` runs the reference on a float64 copy; its fp32 float
    inputs are cast too (a LayerNorm would otherwise meet fp32 input and float64 weights)."""
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.LayerNorm(32),
                                torch.nn.Linear(32, 16))  # fmt: skip
    x = torch.randn(4, 8, 16)
    report = verify(model, Mesh(tp=2), (x,), reference_dtype=torch.float64, rtol=1e-5)
    assert report.ok, str(report)
    assert next(model.parameters()).dtype == torch.float32  # the user's model is untouched


@pytest.mark.parametrize("axes", [dict(dp=2, ep=2), dict(pp=2), dict(dp=2, pp=2),
                                  dict(pp=2, ep=2)])  # fmt: skip
def test_a_corrupted_shard_fails_on_every_kind_of_program(axes, monkeypatch):
    """The last rank's copy of ``blocks.1.gate_up`` (its experts under ep) scaled by 1.01
    after compiling: verify's one path fails it on data-parallel, pipelined and
    expert-parallel programs and their products, not only on the tp program above."""
    from autopar.tools.testing import MoEConfig, build_moe, lm_loss, tokens

    V = sys.modules["autopar.verify"]  # the module (autopar.verify is the function)
    compile_ = V.autoparallelize

    def corrupted(*args, **kwargs):
        prog = compile_(*args, **kwargs)
        rank = prog.mesh.world_size - 1
        module = (next(iter(prog.share(rank).modules.values())) if "pp" in prog.mesh.sizes
                  else prog.module(rank))  # fmt: skip
        with torch.no_grad():
            module.get_parameter("blocks.1.gate_up").mul_(1.01)
        return prog

    monkeypatch.setattr(V, "autoparallelize", corrupted)
    c = MoEConfig(batch=8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = V._verify(build_moe(c), Mesh(**axes), tokens(c), lm_loss, rtol=1e-5)
    bad = {r.name.split(" (stage")[0] for r in report.rows if not r.ok}
    assert not report.ok and "blocks.1.gate_up" in bad, str(report)
