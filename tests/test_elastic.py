"""Elastic training (autopar.elastic): torchrun agents on a c10d rendezvous gain a node, lose
one, or evict a straggler's node; the workers re-plan, resume resharded and finish with the loss
curve of one device (examples/elastic.py is the job; no process is left behind)."""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
from pathlib import Path

import pytest

from autopar.elastic import mesh_rule
from autopar.errors import InputError, MeshError
from autopar.runtime.resilience import StragglerMonitor, StragglerReport

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "elastic.py"


def _example():
    spec = importlib.util.spec_from_file_location("elastic_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _alive(root: Path) -> list[str]:
    """Processes still running with ``root`` in their environment (the job's workers)."""
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes()
        except OSError:
            continue
        if str(root).encode() in env and int(pid) != os.getpid():
            out.append(pid)
    return out


def _job(tmp_path: Path, mode: str) -> list[dict]:
    """examples/elastic.py's job in ``mode``: agent a ends with 0, no process is left behind and
    the losses of steps 1-12 equal one device's; returns the re-plan reports."""
    ex = _example()
    code = ex.launch(tmp_path, mode, timeout=400)
    left = _alive(tmp_path)
    for pid in left:
        os.kill(int(pid), signal.SIGKILL)
    assert code == 0, (tmp_path / "agent_a.log").read_text()[-3000:]
    assert not left
    single, elastic = ex.single_device(), ex.curve(tmp_path)
    assert all(abs(a - b) <= 1e-5 * abs(a) for a, b in zip(single, elastic, strict=True))
    return ex.replans(tmp_path)


def test_world_grows_then_a_node_is_lost(tmp_path: Path) -> None:
    """Agent a alone (world 2, micro_rows=1: 2 accumulated chunks); agent b joins at step 4:
    world 4 from step 3's checkpoint; b is lost at step 7: world 2 from step 6."""
    start, grown, lost = _job(tmp_path, "grow")
    assert [p["world"] for p in (start, grown, lost)] == [2, 4, 2]
    assert grown["reason"] == "the world is now 4 ranks (was 2)"
    assert grown["old_mesh"] == start["new_mesh"] != grown["new_mesh"]
    assert grown["resumed_step"] == 3
    assert lost["old_mesh"] == grown["new_mesh"] != lost["new_mesh"]
    assert lost["resumed_step"] == 6 and "dead" in lost["reason"]
    assert [p["chunks"] for p in (start, grown, lost)] == [2, 1, 2]


def test_straggler_is_evicted_and_the_rest_resume(tmp_path: Path) -> None:
    plans = _job(tmp_path, "evict")
    assert [p["world"] for p in plans] == [4, 2]
    assert plans[1]["old_mesh"] == "Mesh(tp=4)" and plans[1]["new_mesh"] == "Mesh(tp=2)"
    assert "evicted node 1" in plans[1]["reason"] and "rank 3" in plans[1]["reason"]


def test_mesh_rule() -> None:
    rule = mesh_rule("tp=2, dp=*")
    assert str(rule(8)) == "Mesh(dp=4, tp=2)"
    assert str(rule(2)) == "Mesh(tp=2)"
    with pytest.raises(MeshError, match="does not fit a world of 3"):
        rule(3)
    for bad in ("tp=two", "xx=2", "tp=*, dp=*", "tp=2, tp=4"):
        with pytest.raises(InputError):
            mesh_rule(bad)


def test_micro_rows_chunks_each_step(tmp_path: Path) -> None:
    """How many accumulated forwards a step takes so no rank feeds more than micro_rows rows
    (the torchrun job above checks the accumulated steps' losses against one device)."""
    import torch

    from autopar import Mesh
    from autopar.elastic import Elastic

    def run(rows: int, micro: int | None) -> Elastic:
        return Elastic(tmp_path, model=torch.nn.Identity, loss_fn=None, steps=1, save_every=1,
                       batch=lambda _: (torch.zeros(rows, 3), torch.zeros(rows)),
                       micro_rows=micro)  # fmt: skip

    assert run(8, 2).accumulate(2, None) == 2  # Mesh.auto: every rank assumed to split
    assert run(8, 2).accumulate(4, Mesh(dp=4)) == 1
    assert run(8, 2).accumulate(2, Mesh(tp=2)) == 4  # tp ranks all feed the whole chunk
    assert run(8, 3).accumulate(2, Mesh(dp=2)) == 2
    assert run(8, 1).accumulate(4, Mesh(pp=2, dp=2)) == 1  # the pipeline's micro-batches
    assert run(8, None).accumulate(1, Mesh(tp=1)) == 1
    with pytest.raises(InputError, match="global batch of 6 rows does not split into equal"):
        run(6, 1).accumulate(4, Mesh(dp=4))


def _report(step: int, compute: tuple[float, ...]) -> StragglerReport:
    slow = tuple((r, "compute") for r, c in enumerate(compute) if c > 2 * min(compute))
    return StragglerReport(step=step, step_s=compute, waiting_s=(0.0,) * len(compute), slow=slow)


def test_eviction_needs_consecutive_windows() -> None:
    monitor = StragglerMonitor(every=2, evict_after=2)
    monitor.reports = [_report(2, (0.1, 0.5, 0.1)), _report(4, (0.1, 0.1, 0.1))]
    assert monitor.to_evict() is None
    monitor.reports.append(_report(6, (0.1, 0.5, 0.1)))
    assert monitor.to_evict() is None
    monitor.reports.append(_report(8, (0.1, 0.6, 0.1)))
    rank, why = monitor.to_evict()
    assert rank == 1 and "2 consecutive" in why and "steps 6, 8" in why
    with pytest.raises(ValueError, match="evict_after"):
        StragglerMonitor(evict_after=0)


def test_subprocess_helpers_do_not_leak() -> None:
    proc = subprocess.Popen(["sleep", "60"], start_new_session=True)
    _example().with_group_killed(proc)
    assert proc.poll() is not None
