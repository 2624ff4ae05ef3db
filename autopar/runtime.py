"""Run programs inside a distributed job: bind mesh axes to torch DeviceMesh process groups.

Algorithm (:func:`bind_mesh`):
1. Check the job's world size equals the mesh size (a mismatch would hang in the first
   collective, so it is an error up front).
2. Bind each named mesh dim to its process group (NCCL on GPU, Gloo on CPU, as the DeviceMesh
   was built) for the collectives in the per-rank program.
3. Return this rank's global rank in the mesh (row-major coordinates).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from autopar import collectives
from autopar.errors import MeshError
from autopar.layout import Shard, parse_placement
from autopar.mesh import Mesh


def bind_mesh(device_mesh: Any, mesh: Mesh) -> int:
    """Bind ``device_mesh``'s named dims to the collectives and return this rank (steps 1-3)."""
    if not dist.is_initialized():
        raise MeshError("torch.distributed is not initialised; launch with torchrun")
    world = dist.get_world_size()
    if world != mesh.world_size:
        raise MeshError(
            f"the job has {world} processes but {mesh} needs {mesh.world_size}; launch "
            f"with torchrun --nproc-per-node={mesh.world_size} (or resize the mesh)"
        )
    names = device_mesh.mesh_dim_names
    collectives.bind({name: device_mesh.get_group(name) for name in names})
    coords = {name: device_mesh.get_local_rank(name) for name in names}
    return mesh.rank_of(coords)


class PipelineRunner:
    """This rank's share of a pipelined program, run by torch.distributed.pipelining.

    Algorithm (:meth:`step`):
    1. Every stage the rank holds becomes a ``PipelineStage`` over the pipeline-axis group; the
       schedule (GPipe, 1F1B, interleaved 1F1B, interleaved zero-bubble) splits the batch into
       micro-batches and runs forward and backward; the last stage's output is the loss.
    2. Gradients of a weight held by several stages (tied embeddings) are summed across them.
    3. The mean micro-batch loss is broadcast from the last stage, so every rank returns it.
    """

    def __init__(self, share: RankShare, pp_group: Any, device: str = "cpu") -> None:
        from torch.distributed.pipelining import PipelineStage

        self.share, self.pp_group = share, pp_group
        self.stage_ids = sorted(share.modules)
        self.modules = share.modules
        self.stages = [
            PipelineStage(
                self.modules[s],
                s,
                share.n_stages,
                torch.device(device),
                input_args=_examples(share.io[s][0], device),
                output_args=_examples(share.io[s][1], device),
                group=pp_group,
            )
            for s in self.stage_ids
        ]  # shapes given up front: inferring them would run a stage on uninitialised ids
        self.schedule = _schedule(share.config, self.stages)

    def parameters(self) -> list[torch.nn.Parameter]:
        return [p for m in self.modules.values() for p in m.parameters()]

    def step(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        """One schedule over the batch (steps 1-3); returns the loss on every rank."""
        losses: list[torch.Tensor] = []
        dummy = torch.zeros(self.share.config.n_microbatches)
        first = 0 in self.stage_ids
        if first:
            self.schedule.step(*args, target=dummy, losses=losses, return_outputs=False, **kwargs)
        else:
            self.schedule.step(target=dummy, losses=losses, return_outputs=False)
        self._sum_tied_grads()
        return self._broadcast_loss(losses)

    def train_step(self, optimizer_factory: Any) -> Any:
        """A callable ``step(*batch) -> loss`` that also updates the parameters."""
        opt = optimizer_factory(self.parameters())

        def step(*args: Any, **kwargs: Any) -> torch.Tensor:
            loss = self.step(*args, **kwargs)
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss

        return step

    def _sum_tied_grads(self) -> None:
        """Stages may split a tied weight differently: sum whole gradients over the pipeline
        group (ranks without a copy add zeros, so no extra process group is needed), re-split."""
        for fqn, shape in sorted(self.share.tied_shapes.items()):
            copies = [(s, self.modules[s].get_parameter(fqn)) for s in self.stage_ids
                      if _has(self.modules[s], fqn)]  # fmt: skip
            total = torch.zeros(shape)
            for s, p in copies:
                total += _whole(p.grad, self.share.placements[s][fqn])
            dist.all_reduce(total, group=self.pp_group)
            for s, p in copies:
                p.grad = _local(total, self.share.placements[s][fqn])

    def _broadcast_loss(self, losses: list[torch.Tensor]) -> torch.Tensor:
        holder = (self.share.n_stages - 1) % self.share.mesh.size("pp")
        value = torch.stack([x.detach() for x in losses]).mean() if losses else torch.zeros(())
        src = dist.get_global_rank(self.pp_group, holder)
        dist.broadcast(value, src=src, group=self.pp_group)
        return value


def _whole(grad: torch.Tensor, placement: str) -> torch.Tensor:
    p = parse_placement(placement)
    return collectives._gather(grad, "tp", p.dim, p.blocks) if isinstance(p, Shard) else grad


def _local(total: torch.Tensor, placement: str) -> torch.Tensor:
    p = parse_placement(placement)
    return (
        collectives._slice(total, "tp", p.dim, p.blocks) if isinstance(p, Shard) else total.clone()
    )


def _examples(specs: list[tuple[tuple[int, ...], torch.dtype, bool]], device: str) -> tuple:
    return tuple(torch.zeros(shape, dtype=dtype, device=device).requires_grad_(grad)
                 for shape, dtype, grad in specs)  # fmt: skip


def _has(module: Any, fqn: str) -> bool:
    try:
        module.get_parameter(fqn)
    except AttributeError:
        return False
    return True


def _schedule(config: Any, stages: list) -> Any:
    from torch.distributed import pipelining as pl

    loss = _loss_is_output
    m = config.n_microbatches
    if config.schedule == "gpipe":
        return pl.ScheduleGPipe(stages[0], m, loss_fn=loss)
    if config.schedule == "1f1b":
        return pl.Schedule1F1B(stages[0], m, loss_fn=loss)
    if config.schedule == "interleaved":
        return pl.ScheduleInterleaved1F1B(stages, m, loss_fn=loss)
    return pl.ScheduleInterleavedZeroBubble(stages, m, loss_fn=loss)


def _loss_is_output(output: Any, target: Any) -> torch.Tensor:
    """The last stage already returns the loss; the schedule's target is a placeholder."""
    del target
    return output[0] if isinstance(output, (tuple, list)) else output


@dataclass(frozen=True, kw_only=True)
class RankShare:
    """What one rank of a pipelined program needs to run (picklable)."""

    modules: dict[int, Any]  # stage index -> this rank's module of it
    n_stages: int
    config: Any  # autopar.pipeline.PipelineConfig
    tied_shapes: dict[str, tuple[int, ...]]  # weight held by several stages -> full shape
    mesh: Mesh
    coords: dict[str, int]
    io: dict[int, tuple[list, list]]  # stage -> (shape, dtype, requires_grad) of inputs, outputs
    placements: dict[int, dict[str, str]]  # stage -> tied weight -> its placement on 'tp'
