"""Pipeline stages under cp send each cp rank's sequence chunks (Megatron / torchtitan).

A boundary value the cp pass splits along the sequence leaves its stage as this rank's
chunks (no gather over cp) and arrives at the next stage already split (no re-split; its
gradient goes back split), in the one sequence layout of the whole model (the balanced
chunks of a causal mask on both sides).  Values without a split sequence dim (the labels)
travel whole.  Loss and every gradient equal one device's (fp32, 1e-5), on Gloo ranks.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from autopar import Mesh, autoparallelize, verify
from autopar.ops import cp_ops
from autopar.tools.testing import Config, build, hf_tiny_llama, lm_loss, tokens


def _program(mesh: Mesh, **kw):
    c = Config(batch=8, seq=32)
    return c, autoparallelize(build("llama", c), mesh, tokens(c), lm_loss, n_microbatches=2, **kw)


def _ranks(prog) -> list[int]:
    """One rank per pipeline coordinate (cp, tp, dp 0)."""
    return [prog.mesh.rank_of({a: (p if a == "pp" else 0) for a in prog.mesh.sizes})
            for p in range(prog.mesh.size("pp"))]  # fmt: skip


@pytest.mark.parametrize("axes", [{"pp": 2, "cp": 2}, {"pp": 2, "cp": 2, "tp": 2}])
def test_stage_sends_its_sequence_chunks(axes):
    """Stage 0 sends the residual [4, 32, 64] fp32 as each rank's [4, 16, 64] (1/cp of the
    32 KiB) plus the labels [4, 32] int64 whole; the runtime's io specs are the local shapes."""
    c, prog = _program(Mesh(**axes))
    mb = c.batch // 2
    act, labels = mb * c.seq * c.hidden * 4, mb * c.seq * 8
    assert prog.pipeline.cut.boundary_bytes == (act / 2 + labels, 0.0)
    assert "sends     0.02 MiB" in prog.plan.notes[0]
    first, second = (prog.share(r) for r in _ranks(prog))
    local = ((mb, c.seq // 2, c.hidden), torch.float32, True)
    assert local in first.io[0][1] and local in second.io[1][0]
    assert ((mb, c.seq), torch.int64, False) in first.io[0][1]  # the labels, whole


@pytest.mark.parametrize("axes", [{"pp": 2, "cp": 2}, {"pp": 2, "cp": 2, "tp": 2}])
def test_boundary_is_neither_gathered_nor_resplit(axes):
    """No cp_gather at the end of stage 0, no cp_localize of the arriving residual in stage
    1, and no all_gather over cp of the boundary value among the plan's collectives."""
    c, prog = _program(Mesh(**axes))
    whole = (c.batch // 2, c.seq, c.hidden)
    assert not [x for x in prog.collectives() if x.axis == "cp" and x.kind == "all_gather"
                and tuple(x.shape) == whole]  # fmt: skip
    for st, g in zip(prog.stages, prog.pipeline.graphs, strict=True):
        gm = st.graph_module
        assert not [n for n in gm.graph.nodes if n.target is cp_ops.cp_gather]
        arrived = [n for n in gm.graph.nodes if n.op == "placeholder" and n.name in g.inputs
                   and n.meta["val"].dim() == 3]  # fmt: skip
        assert all(u.target is not cp_ops.cp_localize for n in arrived for u in n.users)
    assert "cp_gather" not in prog.code(_ranks(prog)[0])


def test_stage_without_attention_shares_the_balanced_layout():
    """A last stage holding only the epilogue (no attention of its own) still reads the
    causal model's balanced chunks the stage before sent it."""
    c = Config(seq=32, kv_heads=2, batch=4)
    kw = dict(n_microbatches=2, split_points=["epilogue"])
    prog = autoparallelize(build("llama", c), Mesh(pp=2, cp=2), tokens(c), lm_loss, **kw)
    assert prog.pipeline.cut.boundary_bytes[0] == 2 * c.seq * c.hidden * 4 / 2 + 2 * c.seq * 8
    report = verify(build("llama", c), Mesh(pp=2, cp=2), tokens(c), lm_loss, rtol=1e-5,
                    reference_dtype=torch.float64, **kw)  # fmt: skip
    assert report.ok, report


@pytest.mark.parametrize("axes", [{"pp": 2, "cp": 2, "tp": 2}, {"dp": 2, "pp": 2, "cp": 2}])
def test_reference_llama_equals_single_device(axes):
    c = Config(seq=32, kv_heads=2, batch=4)
    report = verify(build("llama", c), Mesh(**axes), tokens(c), lm_loss, rtol=1e-5,
                    n_microbatches=2, cp_attention="ring", reference_dtype=torch.float64)  # fmt: skip
    assert report.ok, report


def _hf_batch(batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 128, (batch, 32), generator=g)
    labels = torch.randint(0, 128, (batch, 32), generator=g)
    return ids, torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], -100)], dim=1)


def shifted_loss(out, labels: torch.Tensor) -> torch.Tensor:
    logits = out.logits
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


@pytest.mark.parametrize(("axes", "strategy"), [
    ({"pp": 2, "cp": 2}, "all_to_all"), ({"pp": 2, "cp": 2, "tp": 2}, "ring"),
    ({"dp": 2, "pp": 2, "cp": 2}, "ring"),
])  # fmt: skip
def test_hf_llama_equals_single_device(axes, strategy):
    batch = _hf_batch(4)
    kw = dict(n_microbatches=2, cp_attention=strategy)
    prog = autoparallelize(hf_tiny_llama(2), Mesh(**axes), batch, shifted_loss, **kw)
    mb = 4 // axes.get("dp", 1) // 2
    assert prog.pipeline.cut.boundary_bytes[0] == mb * 32 * 64 * 4 / 2 + mb * 32 * 8
    report = verify(hf_tiny_llama(2), Mesh(**axes), batch, shifted_loss, rtol=1e-5,
                    reference_dtype=torch.float64 if strategy == "ring" else None, **kw)  # fmt: skip
    assert report.ok, report
