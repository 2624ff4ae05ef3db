"""ZeRO-2/3 under a pipeline hold what the plan says they hold, measured on real Gloo ranks.

torch's pipeline schedules turn an FSDP2 stage's gradient sync and reshard-after-backward off
until the last micro-batch; run that way, a ZeRO-2/3 stage holds its whole gradients, and
ZeRO-3 from its first backward its whole weights, for the step: ZeRO-1's memory, while the
plan's memory table counts them sharded.  autopar's runtime keeps FSDP2's per-micro-batch
sync on (``PipelineRunner`` step 6), so the peak of unsharded gradients is a block or two and
ZeRO-3 gathers a few blocks at a time; the zero-bubble schedule, which needs torch's
deferral, holds them whole, and its plan says so.  Sampled at every dispatched op of a step,
per rank: the bytes of FSDP2's unsharded gradients and of gathered (whole) parameters.
"""

from __future__ import annotations

import pytest
import torch

from autopar import Mesh, autoparallelize, verify
from autopar.runtime.pool import get_pool
from autopar.tools.testing import Config, build, lm_loss, tokens
from autopar.verify import program_view, rank_jobs
from cost.config import ParallelConfig

C = Config(layers=12, hidden=32, heads=4, kv_heads=2, ffn=64, vocab=48, seq=8, batch=8)
M = 4  # micro-batches per step


def _held_during_step(rank, groups, share, args, kwargs, cots, data):
    """A warm-up step, then one step sampled at every dispatched op: the peak bytes of
    FSDP2's unsharded gradients and of gathered parameters on this rank, its parameters'
    whole bytes per stage module (root group and blocks apart), and its gradient shards'
    bytes after the step."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import FSDPModule
    from torch.utils._python_dispatch import TorchDispatchMode

    from autopar.ops import collectives
    from autopar.runtime import DataAxis, PipelineRunner, gathered_bytes

    collectives.bind(groups)
    zero, reduction, _ = data
    mesh = DeviceMesh.from_group(groups["dp"], "cpu", mesh_dim_names=("dp",))
    axis = DataAxis(group=groups["dp"], mesh=mesh, zero=zero, reduction=reduction)
    runner = PipelineRunner(share, groups["pp"], data=axis)
    groups_of = [m._get_fsdp_state()._fsdp_param_group for st in runner.modules.values()
                 for m in st.modules() if isinstance(m, FSDPModule)]  # fmt: skip
    groups_of = [g for g in groups_of if g is not None]

    def unsharded_grads() -> int:
        seen = {}
        for g in groups_of:
            for fp in g.fsdp_params:
                param = getattr(fp, "_unsharded_param", None)
                for t in (fp.unsharded_accumulated_grad, None if param is None else param.grad):
                    if t is not None and t.untyped_storage().nbytes():
                        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return sum(seen.values())

    class Sample(TorchDispatchMode):
        grads = weights = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            self.grads = max(self.grads, unsharded_grads())
            self.weights = max(self.weights, sum(gathered_bytes(m)[0]
                                                 for m in runner.modules.values()))
            return out

    runner.step(*args, **kwargs)
    for m in runner.modules.values():
        m.zero_grad(set_to_none=True)
    with (mode := Sample()):
        runner.step(*args, **kwargs)
    sizes = [sum(fp._orig_size.numel() * 4 for fp in g.fsdp_params) for g in groups_of]
    shards = sum(p.grad.to_local().numel() * 4 for m in runner.modules.values()
                 for p in m.parameters() if p.grad is not None)  # fmt: skip
    return mode.grads, mode.weights, sizes, shards


def _measure(zero: int, schedule: str):
    x, y = tokens(C)
    prog = autoparallelize(build("llama", C), Mesh(dp=2, pp=2), (x, y), loss_fn=lm_loss,
                           zero=zero, n_microbatches=M, schedule=schedule)  # fmt: skip
    jobs = rank_jobs(program_view(prog), (x, y), None, [])
    return prog, get_pool(4).run(_held_during_step, prog.mesh.axes, jobs)


def _split(sizes: list[int]) -> tuple[int, int, int]:
    """(whole, one block, the root groups) bytes of a rank's FSDP2 groups: the blocks are the
    largest groups, all of one size (the test model's), the rest are its stages' roots."""
    block = max(sizes)
    return sum(sizes), block, sum(s for s in sizes if s != block)


@pytest.mark.parametrize("schedule", ["1f1b", "interleaved"])
@pytest.mark.parametrize("zero", [2, 3])
def test_zero_stages_under_pp_stay_sharded_across_micro_batches(zero, schedule):
    prog, results = _measure(zero, schedule)
    for rank, (grads, weights, sizes, shards) in enumerate(results):
        whole, block, roots = _split(sizes)
        # gradients are reduce-scattered in every micro-batch's backward: at most the running
        # block's and the next one's are whole at once, with the roots', never the stage's
        # (torch's deferral holds all of them: grads == whole, as under zero-bubble below)
        assert grads <= roots + 2 * block < whole / 2, (rank, grads, roots, block, whole)
        assert shards == whole // 2  # after the step: this rank's dp shard of every gradient
        if zero == 3:  # a few blocks at a time: per stage its kept last, running, prefetched
            stages = len(prog.stages_of(prog.mesh.coordinates(rank)["pp"]))
            assert weights <= roots + (2 + stages) * block < whole, (rank, weights, whole)
    # the plan's table counts what the ranks hold: the rank position with the most in total
    assert prog.plan.dp.memory[zero].grads in {r[3] for r in results}


def test_zero_bubble_defers_and_its_plan_counts_the_whole_stage():
    """The zero-bubble schedule's weight pass runs outside autograd's hooks, so torch's own
    post-backward reduces once after the last micro-batch: whole gradients for the step,
    which the plan's memory table now counts (it counted them sharded)."""
    prog, results = _measure(2, "zero_bubble")
    for grads, _, sizes, _ in results:
        assert grads == sum(sizes)
    assert prog.plan.dp.memory[2].grads in {sum(r[2]) for r in results}


@pytest.mark.parametrize("schedule", ["1f1b", "interleaved"])
def test_zero_stages_under_pp_still_equal_one_device(schedule):
    """Reduce-scattering every micro-batch into the shards (and the schedule's final scaling
    by the micro-batch count) gives one device's loss and gradients."""
    x, y = tokens(C)
    for zero in (2, 3):
        report = verify(build("llama", C), Mesh(dp=2, pp=2), (x, y), loss_fn=lm_loss, zero=zero,
                        n_microbatches=M, schedule=schedule, reference_dtype=torch.float64,
                        rtol=1e-5)  # fmt: skip
        assert report.ok, f"zero={zero} {schedule}\n{report}"


@pytest.mark.parametrize(("zero", "schedule", "times"), [(3, "1f1b", M), (2, "interleaved", M),
                                                         (2, "zero_bubble", 1), (1, "1f1b", 1)])
def test_printed_data_axis_traffic_counts_every_micro_batch(zero, schedule, times):
    """The plan's data-axis traffic says how often a step runs each collective: under pp a
    ZeRO-2/3 gather or reduce-scatter runs once per micro-batch (as the runtime issues them
    and `cost.step` prices them), the loss all-reduce once; zero-bubble and ZeRO-1 sync once."""
    import re

    from autopar.plan import _fmt_bytes, wire_bytes

    x, y = tokens(C)
    prog = autoparallelize(build("llama", C), Mesh(dp=2, pp=2), (x, y), loss_fn=lm_loss,
                           zero=zero, n_microbatches=M, schedule=schedule)  # fmt: skip
    assert prog.plan.dp.micro_batches == times
    text = str(prog.plan)
    rows = text[text.index("data-axis traffic of one training step"):].splitlines()[1:]
    rows = rows[:next(i for i, r in enumerate(rows) if r.lstrip().startswith("total"))]
    each = [r for r in rows if r.endswith(" per micro-batch")]
    synced = [r for r in rows if re.match(r"\s+(fwd|bwd) (all_gather|reduce_scatter)", r)]
    assert each == (synced if times > 1 else []) and bool(synced) == (zero >= 2)
    assert all("per micro-batch" not in r for r in rows if " loss" in r)
    dp = [c for c in prog.plan.collectives if c.axis == "dp"]
    per_mb = sum(wire_bytes(c, 2) for c in dp if c.direction in ("fwd", "bwd")
                 and c.kind in ("all_gather", "reduce_scatter"))  # fmt: skip
    once = sum(wire_bytes(c, 2) for c in dp) - per_mb
    total = re.search(r"total (.+) sent per rank per step", text).group(1)
    assert total == _fmt_bytes(times * per_mb + once)


def _pipeline_buffers_held(rank, groups, share, args, kwargs, cots, data):
    """After a step: the bytes of the receive buffers this rank's torch ``PipelineStage`` s
    keep (distinct storages, activation and gradient buffers), and the most outputs its
    stages that send on hold at once for backward (forward-cache entries, summed over them,
    seen at any dispatched op)."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.utils._python_dispatch import TorchDispatchMode

    from autopar.ops import collectives
    from autopar.runtime import DataAxis, PipelineRunner

    collectives.bind(groups)
    zero, reduction, _ = data
    mesh = DeviceMesh.from_group(groups["dp"], "cpu", mesh_dim_names=("dp",))
    axis = DataAxis(group=groups["dp"], mesh=mesh, zero=zero, reduction=reduction)
    runner = PipelineRunner(share, groups["pp"], data=axis)
    senders = [st for st in runner.stages if not st.is_last]

    class Sample(TorchDispatchMode):
        peak = chunks = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.peak = max(self.peak, sum(len(st.fwd_cache) for st in senders))
            self.chunks = max(self.chunks, sum(len(st.fwd_cache) for st in runner.stages))
            return func(*args, **(kwargs or {}))

    runner.step(*args, **kwargs)
    with (mode := Sample()):
        runner.step(*args, **kwargs)
    storages = {}
    for st in runner.stages:
        for infos in (*st.args_recv_info.values(), *st.grad_recv_info.values()):
            for info in infos:
                buf = getattr(info, "buffer", None)
                if isinstance(buf, torch.Tensor) and buf.untyped_storage().nbytes():
                    storages[buf.untyped_storage().data_ptr()] = buf.untyped_storage().nbytes()
    return sum(storages.values()), mode.peak, mode.chunks


@pytest.mark.parametrize("schedule", ["1f1b", "interleaved"])
def test_plan_counts_the_pipeline_runtime_buffers(schedule):
    """torch's ``PipelineStage`` keeps a receive buffer per micro-batch for a stage's input
    activations (every stage but the first) and its output gradients (every stage but the
    last; only the values that carry one), each the size the cut sends across that
    boundary, and holds a stage's output for
    each micro-batch in flight: what the plan's memory table adds to the saved activations
    (``data_parallel.pipeline_buffers``), and what the search prices
    (``cost.memory.pipeline_buffers``)."""
    from autopar.axes.data_parallel import pipeline_buffers

    x, y = tokens(C)
    prog = autoparallelize(build("llama", C), Mesh(dp=2, pp=2), (x, y), loss_fn=lm_loss,
                           zero=1, n_microbatches=M, schedule=schedule)  # fmt: skip
    jobs = rank_jobs(program_view(prog), (x, y), None, [])
    results = get_pool(4).run(_pipeline_buffers_held, prog.mesh.axes, jobs)
    pipe, n = prog.pipeline, len(prog.stages)
    sent, back = pipe.cut.boundary_bytes, pipe.cut.gradient_bytes
    assert all(0 < g < b for g, b in zip(back[:-1], sent[:-1], strict=True))  # ids: no grad
    assert sent[-1] == back[-1] == 0
    for rank, (recv, peak, chunks) in enumerate(results):
        stages = prog.stages_of(prog.mesh.coordinates(rank)["pp"])
        buffers = sum(M * (sent[i - 1] if i > 0 else 0) + M * (back[i] if i < n - 1 else 0)
                      for i in stages)  # fmt: skip
        assert recv == buffers, (rank, recv, buffers)  # one buffer per micro-batch, cut-sized
        held = [(i, pipe.config.in_flight(i, n)) for i in stages]
        # the micro-batches in flight at the rank's peak, counted over its stages: the
        # schedule's warm-up plus one (interleaved: (v - 1) p + 2 (p - 1 - r) + 1 chunks); a
        # rank holding only the loss stage is not sampled (its one cache entry lives between
        # forward and backward, where no op is dispatched)
        if stages != [n - 1]:
            assert chunks == sum(h for _, h in held), (rank, chunks, held)
        if schedule == "1f1b":  # the outputs held for backward at once: the in-flight count
            # (an interleaved rank's count is its average over its chunks, `in_flight`, so
            # one chunk may hold more while the other holds less)
            assert peak == sum(min(h, M) for i, h in held if i < n - 1), (rank, peak, held)
        # the table's term: the buffers less the in-flight inputs, plus the held outputs
        inputs = sum(min(h, M) * sent[i - 1] for i, h in held if i > 0)
        outputs = sum(min(h, M) * sent[i] for i, h in held if i < n - 1)
        assert pipeline_buffers(prog, held) == pytest.approx(buffers - inputs + outputs)


def test_zero_bubble_plan_prices_the_accumulation_of_its_deferred_gradients(monkeypatch):
    """The deferred sync keeps each parameter's gradient whole over the micro-batches, so
    FSDP2 adds every micro-batch's into its fp32 accumulator (`cost.step.accumulation_time`,
    what the search prices under `defer_grad_sync`): the plan's predicted step counts it with
    the sub-mesh's compute, and only that term moves when the deferral is taken away."""
    from autopar.axes import data_parallel
    from cost.step import accumulation_time

    x, y = tokens(C)
    prog = autoparallelize(build("llama", C), Mesh(dp=2, pp=2), (x, y), loss_fn=lm_loss,
                           zero=2, n_microbatches=M, schedule="zero_bubble")  # fmt: skip
    axes = prog.plan.dp.zero_axes
    deferred = data_parallel.predict_step(prog, prog.mesh, 2, axes)
    assert deferred == prog.plan.dp.step  # the compiled plan's own
    monkeypatch.setattr(data_parallel, "_defers_sync", lambda _: False)
    synced = data_parallel.predict_step(prog, prog.mesh, 2, axes)
    cfg = ParallelConfig(tp=1, pp=2, dp=2, zero=2, global_batch=2 * M, micro_batch=1,
                         defer_grad_sync=True)  # fmt: skip
    params = [sum(p.numel() for s in prog.stages_of(r) for p in prog.module(
        prog.mesh.rank_of({"pp": r, "dp": 0}), s).parameters()) for r in range(2)]
    added = {accumulation_time(n, M, cfg, prog.mesh.cluster.gpu, new_bytes=4) for n in params}
    assert min(added) > 0
    assert any(deferred.sub_mesh - synced.sub_mesh == pytest.approx(a, rel=1e-6) for a in added)
