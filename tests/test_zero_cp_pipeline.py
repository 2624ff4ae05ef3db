"""ZeRO over dp x cp under a pipeline: Mesh(dp, pp, cp).

Each cp stage's boundary values cross split over cp (tests/test_cp_pipeline.py), so no
stage's incoming activation needs its gradient whole: every stage leaves its dense
parameters' gradients partial over cp (``leave_grads_to_data_axis``) and the pipeline's data
axis reduces and shards them once over the flattened dp x cp group (DDP's divisor dp; FSDP2,
which averages over its group, gets the loss's gradient scaled by cp).  Loss and every
gradient equal one device's, on the verify pool and on a real 8-process DeviceMesh job.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from autopar import Mesh, autoparallelize, verify
from autopar.ops.collectives import grad_all_reduce
from autopar.tools.testing import Config, build, lm_loss, run_rank_scripts, tokens

C = Config(layers=2, hidden=32, heads=4, kv_heads=2, ffn=64, vocab=48, seq=16, batch=4)
MESH = Mesh(dp=2, pp=2, cp=2)


def test_plan_shards_zero_over_dp_x_cp_on_every_stage():
    """The ZeRO group is dp x cp; no stage reduces a parameter's gradient over cp (the one
    cp all-reduce left per step is the loss's token count); the state rows divide by 4."""
    x, y = tokens(C)
    prog = autoparallelize(build("llama", C), MESH, (x, y), lm_loss, zero=2, n_microbatches=2)
    assert prog.plan.dp.zero_axes == ("dp", "cp") and prog.plan.label.endswith("-dp2cp2z2")
    for st in prog.stages:
        assert not [n for n in st.graph_module.graph.nodes if n.target is grad_all_reduce
                    and n.args[1] == "cp"]  # fmt: skip
    cp_reductions = [c for c in prog.collectives() if c.axis == "cp" and c.kind == "all_reduce"]
    assert [c.shape for c in cp_reductions] == [(2,)]
    stage_bytes = {sum(st.traced.tensors[f].numel() for f in st.traced.params.values()) * 4
                   for st in prog.stages}  # fmt: skip
    assert prog.plan.dp.memory[2].grads in {b / 4 for b in stage_bytes}  # 1/(dp cp) of a stage
    assert "ZeRO group dp x cp = 4 ranks" in str(prog.plan)
    assert any(c.axis == "dp_cp" for c in prog.collectives())


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_dp_x_pp_x_cp_equals_one_device(zero):
    x, y = tokens(C)
    report = verify(build("llama", C), MESH, (x, y), lm_loss, zero=zero, n_microbatches=2,
                    reference_dtype=torch.float64, rtol=1e-5)  # fmt: skip
    assert report.ok, report


def _device_mesh_main(rank: int, port: int) -> None:
    """One rank of a real 8-process Gloo job: for ZeRO 0 and 3, ``autoparallelize`` on a
    (dp, pp, cp) DeviceMesh (dp and cp not adjacent: the ZeRO group flattens them), one
    pipeline step on this rank's batch slice, the loss and every gradient of this rank's
    stage against one device (exit status 1 on a mismatch)."""
    from datetime import timedelta

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=8, timeout=timedelta(seconds=200))  # fmt: skip
    mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("dp", "pp", "cp"))
    x, y = tokens(C)
    model = build("llama", C)
    want = lm_loss(model(x), y)
    want.backward()
    d = mesh.get_local_rank("dp")
    for zero in (0, 3):
        runner = autoparallelize(build("llama", C), mesh, (x, y), lm_loss, zero=zero,
                                 n_microbatches=2)  # fmt: skip
        assert dist.get_world_size(runner.data.shards) == 4
        loss = runner.step(x.chunk(2)[d], y.chunk(2)[d])
        torch.testing.assert_close(loss, want.detach(), rtol=1e-5, atol=1e-6)
        for m in runner.modules.values():
            for n, p in m.named_parameters():
                g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
                torch.testing.assert_close(g, model.get_parameter(n).grad, rtol=1e-4,
                                           atol=1e-6, msg=f"zero={zero} {n}")  # fmt: skip
    dist.barrier()
    dist.destroy_process_group()


def test_a_device_mesh_flattens_dp_x_cp_around_pp():
    root = Path(__file__).resolve().parents[1]
    codes, errs = run_rank_scripts(__file__, 8, timeout=500, root=str(root))
    assert all(code == 0 for code in codes), "\n".join(e[-2000:] for e in errs)


if __name__ == "__main__":
    _device_mesh_main(int(sys.argv[1]), int(sys.argv[2]))
