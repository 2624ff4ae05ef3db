"""The Program a user inspects: code, modules, save(), and the runtime's bad-input errors."""

from __future__ import annotations

import ast
import pickle

import pytest
import torch

from autopar import Mesh, MeshError, Plan, autoparallelize
from autopar.runtime.pool import get_pool
from autopar.tools.testing import Config, build, lm_loss, tokens


@pytest.fixture(scope="module")
def prog():
    c = Config(layers=2, hidden=64, heads=4, kv_heads=2, ffn=128, vocab=64, seq=8, batch=2)
    return autoparallelize(build("llama", c), Mesh(tp=2), tokens(c), loss_fn=lm_loss)


def test_code_has_header_layouts_and_named_collectives(prog):
    code = prog.code(rank=1)
    assert code.startswith(f"# autopar program · plan {prog.plan.hash} · rank 1 of 2")
    assert "mesh coordinates (tp=1)" in code
    assert "all_reduce(" in code and "grad_all_reduce(" in code
    assert "# P(None, None, 'tp')" in code


def test_module_holds_only_its_shards(prog):
    m0, m1 = prog.module(0), prog.module(1)
    full = dict(prog.traced.tensors)
    for name, p in m0.named_parameters():
        assert p.numel() <= full[name].numel()
    q0, q1 = m0.get_parameter("layers.0.wq.weight"), m1.get_parameter("layers.0.wq.weight")
    assert q0.shape == (32, 64)
    assert torch.equal(torch.cat([q0, q1]), full["layers.0.wq.weight"])


def test_modules_pickle_without_retracing(prog):
    m = pickle.loads(pickle.dumps(prog.module(1)))
    assert [n for n, _ in m.named_parameters()] == [n for n, _ in prog.module(1).named_parameters()]
    assert str(m.graph) == str(prog.module(1).graph)


def test_module_follows_to_device_like_the_model():
    """Factory ops recorded with the tracing device (arange for RoPE) read the device from
    the module's parameters, so ``.to(device)`` moves the whole program (meta stands in for
    cuda here: a baked-in cpu arange meeting meta tensors raises a device mismatch)."""
    c = Config(layers=1, hidden=32, heads=2, kv_heads=1, ffn=64, vocab=64, seq=8, batch=2)
    prog = autoparallelize(build("llama", c), Mesh(tp=1), tokens(c), loss_fn=lm_loss)
    assert "device(type='cpu')" not in prog.code(rank=0)
    x, y = (t.to("meta") for t in tokens(c))
    loss = prog.module(0).to("meta")(x, y)
    assert loss.device.type == "meta" and loss.shape == ()


def test_hf_module_follows_to_device_inside_autocast_bodies():
    """HF's rotary embedding runs under ``autocast(enabled=False)``: export puts it in a
    nested graph whose ``_assert_tensor_metadata`` checks name the tracing device (seen on an
    H200: "Tensor device mismatch! Expected: cpu").  HF's mask code reads values (``.item``),
    so meta cannot stand in for cuda here: no graph may name a device, and it still runs."""
    from autopar.tools.testing import hf_tiny_llama

    x, y = torch.randint(0, 128, (2, 8)), torch.randint(0, 128, (2, 8))
    model = hf_tiny_llama(1)
    prog = autoparallelize(model, Mesh(tp=1), (x, y), loss_fn=hf_lm_loss)
    module = prog.module(0)
    graphs = [m for m in module.modules() if isinstance(m, torch.fx.GraphModule)]
    assert len(graphs) > 1  # the autocast body is a nested graph
    for g in graphs:
        assert "device(type=" not in g.code
    assert torch.allclose(module(x, y), hf_lm_loss(model(x), y), rtol=1e-6)


def hf_lm_loss(out, targets):
    return lm_loss(out.logits, targets)


def test_save_writes_one_program_and_a_reloadable_plan(prog, tmp_path):
    files = prog.save(tmp_path)
    names = sorted(f.name for f in files)
    assert names == ["plan.json", "plan.txt", "program_0.py"]  # both tp ranks run one program
    assert Plan.load(tmp_path / "plan.json") == prog.plan
    source = (tmp_path / "program_0.py").read_text()
    namespace: dict = {}
    exec(compile(source, "program_0.py", "exec"), namespace)  # the saved source is runnable Python
    assert "LlamaProgram" in namespace


def test_collectives_list_kind_axis_bytes_direction(prog):
    rows = prog.collectives()
    assert rows and {r.direction for r in rows} == {"fwd", "bwd"}
    assert all(r.axis == "tp" and r.bytes > 0 for r in rows)
    assert "collectives of one training step" in str(prog.plan)


class _FakeDeviceMesh:
    """A named one-axis mesh of twice the job's world size (only what bind_mesh reads)."""

    mesh_dim_names = ("tp",)

    def __init__(self, size: int) -> None:
        self.mesh = torch.empty(size)


def _bind_wrong_world(rank: int, groups: dict) -> str:
    import torch.distributed as dist

    from autopar.runtime import bind_mesh

    size = 2 * dist.get_world_size()
    try:
        bind_mesh(_FakeDeviceMesh(size), Mesh(tp=size))
    except MeshError as exc:
        return str(exc)
    return "no error"


def test_world_size_not_matching_the_mesh_is_an_error():
    pool = get_pool(2)
    msgs = pool.run(_bind_wrong_world, (("tp", 2),), [(), ()])
    size = 2 * pool.world
    assert all(f"the job has {pool.world} processes but Mesh(tp={size}) needs {size}" in m for m in msgs)


def test_saved_plan_reloads_and_recompiles_to_the_same_program(prog, tmp_path):
    prog.save(tmp_path)
    c = Config(layers=2, hidden=64, heads=4, kv_heads=2, ffn=128, vocab=64, seq=8, batch=2)
    again = autoparallelize(build("llama", c), Mesh(tp=2), tokens(c), loss_fn=lm_loss,
                            plan=Plan.load(tmp_path / "plan.json"))  # fmt: skip
    assert again.plan == prog.plan
    assert again.code(1) == prog.code(1)


def test_plan_for_another_mesh_is_refused(prog):
    c = Config(layers=2, hidden=64, heads=4, kv_heads=2, ffn=128, vocab=64, seq=8, batch=2)
    with pytest.raises(MeshError, match=r"the plan was made for Mesh\{'tp': 2\} but the mesh is Mesh\(tp=4\)"):
        autoparallelize(build("llama", c), Mesh(tp=4), tokens(c), loss_fn=lm_loss, plan=prog.plan)


_EVERY_MESH = [Mesh(tp=2), Mesh(dp=2, tp=2), Mesh(pp=2, tp=2), Mesh(cp=2, tp=2),
               Mesh(ep=2, tp=2), Mesh(dp=2, pp=2, ep=2)]  # fmt: skip


@pytest.mark.parametrize("mesh", _EVERY_MESH, ids=str)
def test_every_mesh_gives_the_one_program(mesh, tmp_path):
    """One Program class on every mesh: its stages (one without pp), the one Plan, a rank's
    module (under pp its share), code and collectives, and save() writing the distinct
    programs with the whole plan; no axis wraps another's program."""
    from autopar import Program
    from autopar.program import StageProgram
    from autopar.tools.testing import MoEConfig, build_moe

    if "ep" in mesh.sizes:
        c = MoEConfig(batch=8)
        model, inputs = build_moe(c), tokens(c)
    else:
        c = Config(layers=2, hidden=32, heads=4, kv_heads=2, ffn=64, vocab=48, seq=16, batch=8)
        model, inputs = build("llama", c), tokens(c)
    options = {"n_microbatches": 2} if "pp" in mesh.sizes else {}
    prog = autoparallelize(model, mesh, inputs, loss_fn=lm_loss, **options)
    assert type(prog) is Program and not hasattr(prog, "inner")
    assert len(prog.stages) == mesh.size("pp") and all(type(s) is StageProgram for s in prog.stages)
    assert isinstance(prog.plan, Plan) and prog.plan.mesh == mesh.axes
    assert prog.collectives() == list(prog.plan.collectives)
    last = mesh.world_size - 1
    if "pp" in mesh.sizes:
        share = prog.share(last)
        assert sorted(share.modules) == prog.stages_of(mesh.coordinates(last)["pp"]) == [1]
        assert share.modules[1] is prog.module(last, 1)
    assert f"rank {last} of {mesh.world_size}" in prog.code(last)
    written = {p.name for p in prog.save(tmp_path)}
    assert {"plan.txt", "plan.json", "program_0.py"} <= written
    assert Plan.load(tmp_path / "plan.json") == prog.plan
    heads = [path.read_text().split("\n")[0] for path in tmp_path.glob("program_*.py")]
    ranks = [r for h in heads for r in ast.literal_eval(h.split("ranks ")[1].split(";")[0])]
    assert sorted(ranks) == list(range(mesh.world_size))  # each rank's (one stage) program once


def test_no_other_program_class():
    """The program classes are Program and its StageProgram (one per pipeline stage)."""
    import importlib
    import inspect
    import pkgutil

    import autopar

    found = set()
    for info in pkgutil.walk_packages(autopar.__path__, "autopar."):
        module = importlib.import_module(info.name)
        found |= {name for name, obj in inspect.getmembers(module, inspect.isclass)
                  if name.endswith("Program") and obj.__module__.startswith("autopar")}  # fmt: skip
    assert found == {"Program", "StageProgram"}
