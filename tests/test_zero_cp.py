"""ZeRO over dp x cp: under a mesh with dp and cp the cp ranks join the data axis's gradient
reduction (torchtitan's FSDP over ``dp_shard_cp``).  The cp program leaves its dense
parameters' gradients partial over cp, DDP / FSDP2 / ZeroRedundancyOptimizer run over the
flattened dp x cp group, and every gradient is reduced once.  Checked on real Gloo ranks:
loss and every gradient equal one device; the gradient and optimizer-state bytes a rank
holds after a step are 1/(dp*cp) of the model's (measured); the plan says so."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from autopar import Mesh, autoparallelize, verify
from autopar.ops.collectives import grad_all_reduce, grad_partial
from autopar.ops.cp_ops import cp_localize
from autopar.runtime.pool import get_pool
from autopar.tools.testing import Config, build, lm_loss, run_rank_scripts, tokens

C = Config(layers=2, hidden=32, heads=4, kv_heads=2, ffn=64, vocab=48, seq=16, batch=4)


@pytest.mark.parametrize(("kind", "zero"), [("llama", 0), ("llama", 1), ("llama", 2),
                                           ("llama", 3), ("gpt", 0), ("gpt", 3)])  # fmt: skip
def test_dp_x_cp_equals_one_device(kind, zero):
    """Loss (a mean over the global tokens) and every gradient match one device; GPT's
    learned position table reaches the split program through a localize (its gathered
    gradient continues from cp rank 0).  A sum loss under dp x cp is refused before this
    change too (batch_stats: the cp loss's token count is a statistic over the batch)."""
    x, y = tokens(C)
    report = verify(build(kind, C), Mesh(dp=2, cp=2), (x, y), loss_fn=lm_loss, zero=zero)
    assert report.ok, report
    assert len([r for r in report.rows if r.kind == "grad"]) == len(list(build(kind, C).parameters()))


def test_dp_x_cp_x_tp_equals_one_device():
    """Eight ranks: the ZeRO group is dp x cp within each tp coordinate."""
    x, y = tokens(C)
    report = verify(build("llama", C), Mesh(dp=2, cp=2, tp=2), (x, y), loss_fn=lm_loss, zero=3,
                    rtol=1e-4)  # tp's rounding on a zero-gradient bias (test_data_parallel)  # fmt: skip
    assert report.ok, report


def test_plan_says_the_zero_group_is_dp_x_cp():
    """The memory rows divide the state by dp*cp, the gradient collectives ride dp_cp (the
    loss's all-reduce stays on dp), the cp program holds no dense-gradient reduction over cp
    and says where it went, and the hash names the group."""
    x, y = tokens(C)
    prog = autoparallelize(build("gpt", C), Mesh(dp=2, cp=2), (x, y), lm_loss, zero=2)
    whole = sum(p.numel() for p in build("gpt", C).parameters()) * 4
    plan, text = prog.plan.dp, str(prog.plan)
    assert plan.zero_axes == ("dp", "cp") and prog.plan.label.endswith("-dp2cp2z2")
    assert plan.memory[0].grads == whole and plan.memory[2].grads == whole / 4
    assert plan.memory[3].weights < plan.memory[2].weights == whole  # ZeRO-3 keeps some whole
    assert plan.memory[1].optimizer == 2 * whole / 4
    assert "ZeRO group dp x cp = 4 ranks" in text and "over the flattened dp x cp group" in text
    added = prog.plan.collectives[len(prog.stages[0].plan.collectives):]  # the data axis's traffic
    assert {c.axis for c in added} == {"dp", "dp_cp"}
    assert [c.where for c in added if c.axis == "dp"] == ["loss"]
    gm = prog.stages[0].graph_module
    params = {n for n in gm.graph.nodes if n.op == "placeholder" and n.name in prog.stages[0].traced.params}
    reduced = [n for n in gm.graph.nodes if n.target is grad_all_reduce and n.args[1] == "cp"]
    assert not any(_above(n, params) for n in reduced)
    assert [n.args[0].target for n in gm.graph.nodes if n.target is cp_localize
            and n.args[0].target is grad_partial] == [grad_partial]  # the position table  # fmt: skip
    assert "left to the data axis" in prog.stages[0].plan.notes[-1]


def _above(node, params) -> bool:
    todo, seen = [node], set()
    while todo:
        n = todo.pop()
        if n in params:
            return True
        seen.add(n)
        todo += [a for a in n.all_input_nodes if a not in seen]
    return False


def _state_bytes(rank, groups, module, x, y, zero):
    """One AdamW step of a dp x cp rank over the flattened group: the bytes of its gradients
    and optimizer state (local shards)."""
    from torch.distributed.device_mesh import DeviceMesh

    from autopar.ops import collectives
    from autopar.runtime import DataParallelModule

    def local_bytes(ts):
        return sum((t.to_local() if hasattr(t, "to_local") else t).numel() * 4 for t in ts)

    collectives.bind(groups)
    mesh = DeviceMesh.from_group(groups["dp_cp"], "cpu", mesh_dim_names=("dp_cp",))
    wrapped = DataParallelModule(module, group=groups["dp"], dp_mesh=mesh, zero=zero,
                                 reduction="mean", shard_group=groups["dp_cp"])  # fmt: skip
    opt = wrapped.optimizer(torch.optim.AdamW, lr=1e-3)
    out = wrapped(x, y)
    (out[0] if isinstance(out, tuple) else out).backward()
    grads = local_bytes(p.grad for p in wrapped.parameters() if p.grad is not None)
    opt.step()
    state = getattr(opt, "optim", opt).state.values()
    return grads, local_bytes(t for s in state for t in s.values() if t.dim())


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_dp_x_cp_state_bytes_are_per_zero_group_rank(zero):
    """Measured after one step: each rank's gradients (ZeRO-2/3) and optimizer state (ZeRO
    1-3) are 1/(dp*cp) of the model's, as the plan's row says (ZeRO-0: whole; ZeRO-1 within
    the whole parameters ZeroRedundancyOptimizer places per rank)."""
    x, y = tokens(C)
    prog = autoparallelize(build("llama", C), Mesh(dp=2, cp=2), (x, y), lm_loss, zero=zero)
    whole = sum(p.numel() for p in build("llama", C).parameters()) * 4
    row = prog.plan.dp.memory[zero]
    jobs = [(prog.module(r), *(t.chunk(2)[prog.mesh.coordinates(r)["dp"]] for t in (x, y)), zero)
            for r in range(4)]  # fmt: skip
    measured = get_pool(4).run(_state_bytes, prog.mesh.axes, jobs)
    share = 1 if zero == 0 else 4
    assert {(row.grads, row.optimizer)} == {(whole / (4 if zero >= 2 else 1), 2 * whole / share)}
    if zero == 1:  # ZeroRedundancyOptimizer gives each rank whole parameters' state
        assert {g for g, _ in measured} == {row.grads}
        assert sum(o for _, o in measured) == 2 * whole
        assert max(o for _, o in measured) == pytest.approx(row.optimizer, rel=0.05), measured
    else:
        assert set(measured) == {(row.grads, row.optimizer)}, measured


class _Regularised(nn.Module):
    """A causal-attention LM whose loss adds a term of its head weight alone: that gradient
    is whole on every cp rank, so cp keeps its own reduction and ZeRO stays over dp."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.head = nn.Embedding(48, 16), nn.Linear(16, 48)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        b, s = x.shape
        h = self.emb(x).view(b, s, 2, 8).transpose(1, 2)
        h = F.scaled_dot_product_attention(h, h, h, is_causal=True).transpose(1, 2)
        h = h.reshape(b, s, 16)
        return lm_loss(self.head(h), y) + 1e-2 * self.head.weight.square().mean()


def test_a_gradient_whole_over_cp_keeps_zero_over_dp():
    x, y = tokens(C)
    prog = autoparallelize(_Regularised(), Mesh(dp=2, cp=2), (x, y), zero=2)
    assert prog.plan.dp.zero_axes == ("dp",) and prog.plan.label.endswith("-dp2z2")
    assert "ZeRO group dp = 2 ranks" in str(prog.plan)
    report = verify(_Regularised(), Mesh(dp=2, cp=2), (x, y), zero=2)
    assert report.ok, report



def _device_mesh_main(rank: int, port: int) -> None:
    """One rank of a real 4-process Gloo job (not the pool, whose world may be larger): for
    ZeRO 0 and 3, ``autoparallelize`` on a (dp, cp) DeviceMesh, one backward on this rank's
    batch slice, every gradient against one device (exit status 1 on a mismatch)."""
    from datetime import timedelta

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=4, timeout=timedelta(seconds=120))  # fmt: skip
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))
    x, y = tokens(C)
    model = build("llama", C)
    lm_loss(model(x), y).backward()
    d = mesh.get_local_rank("dp")
    for zero in (0, 3):
        module = autoparallelize(build("llama", C), mesh, (x, y), lm_loss, zero=zero)
        out = module(x.chunk(2)[d], y.chunk(2)[d])
        (out[0] if isinstance(out, tuple) else out).backward()
        assert module.shard_group.size() == 4
        for n, g in module.full_grads().items():
            torch.testing.assert_close(g, model.get_parameter(n).grad, rtol=1e-5, atol=1e-6,
                                       msg=f"zero={zero} {n}")  # fmt: skip
    dist.barrier()
    dist.destroy_process_group()


def test_a_device_mesh_flattens_dp_x_cp():
    """On a DeviceMesh the data axis flattens its dp and cp dims (``_flatten``) into the
    ZeRO group; every rank's gradients equal one device's (ZeRO 0 and 3)."""
    root = Path(__file__).resolve().parents[1]
    codes, errs = run_rank_scripts(__file__, 4, timeout=300, root=str(root))
    assert all(code == 0 for code in codes), "\n".join(e[-2000:] for e in errs)


if __name__ == "__main__":
    _device_mesh_main(int(sys.argv[1]), int(sys.argv[2]))
