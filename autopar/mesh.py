"""The virtual device mesh: named axes and sizes, plus (optionally) the hardware it runs on.

``Mesh(tp=4)`` plans and prints without any process.  A virtual mesh orders its axes
canonically outermost first (dp, pp, cp, ep, tp, whatever order they are written in), so the
last axis holds contiguous ranks (tp inside a node when it fits, dp across nodes).  A torch
``DeviceMesh`` with ``mesh_dim_names`` converts with :func:`Mesh.from_device_mesh`, keeping the
DeviceMesh's own order (its ranks are laid out that way).  ``Mesh.auto(cluster)`` leaves the
degrees to the whole-cluster search (:mod:`autopar.planner.auto`), run when the model is compiled.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from autopar.errors import MeshError
from cost.hardware import Cluster

SUPPORTED_AXES = ("dp", "pp", "cp", "ep", "tp")
KNOWN_AXES = ("dp", "pp", "cp", "ep", "tp")


@dataclass(frozen=True, init=False)
class Mesh:
    """Named mesh axes (outermost first) and the cluster they are priced on."""

    axes: tuple[tuple[str, int], ...]
    cluster: Cluster = field(compare=False)

    def __new__(cls, cluster: Cluster | None = None, **axes: int) -> Any:
        """``Mesh(cluster)`` with no degrees is ``Mesh.auto(cluster)``."""
        if cluster is not None and not axes:
            return AutoMesh(cluster=cluster)
        return super().__new__(cls)

    def __init__(self, cluster: Cluster | None = None, **axes: int) -> None:
        for name, size in axes.items():
            if name not in KNOWN_AXES:
                raise MeshError(
                    f"unknown mesh axis {name!r}; axes are named {', '.join(KNOWN_AXES)} "
                    f"(e.g. Mesh(tp=4) or Mesh(pp=2, tp=2))"
                )
            if name not in SUPPORTED_AXES:
                raise MeshError(
                    f"mesh axis {name!r} is not supported yet; autopar plans "
                    f"{' and '.join(SUPPORTED_AXES)} today"
                )
            if not isinstance(size, int) or size < 1:
                raise MeshError(f"mesh axis {name!r} needs a positive int size, got {size!r}")
        if not axes:
            raise MeshError("a mesh needs at least one axis, e.g. Mesh(tp=2)")
        ordered = sorted(axes.items(), key=lambda a: KNOWN_AXES.index(a[0]))
        object.__setattr__(self, "axes", tuple(ordered))
        object.__setattr__(self, "cluster", cluster or Cluster.default())

    @staticmethod
    def ordered(axes: tuple[tuple[str, int], ...], cluster: Cluster | None = None) -> Mesh:
        """A mesh with exactly this axis order (a DeviceMesh's, or a plan's)."""
        mesh = Mesh(cluster, **dict(axes))
        object.__setattr__(mesh, "axes", tuple(axes))
        return mesh

    def without(self, axis: str) -> Mesh:
        """The sub-mesh of the other axes (``Mesh(tp=1)`` when ``axis`` is the only one)."""
        rest = tuple(a for a in self.axes if a[0] != axis) or (("tp", 1),)
        return Mesh.ordered(rest, self.cluster)

    def describe(self) -> list[str]:
        """Each axis's degree and the link its groups ride on the cluster."""
        return [f"{a}={s} over {self.cluster.axis_link(self.axes, a).name}"
                for a, s in self.axes]  # fmt: skip

    @staticmethod
    def from_device_mesh(device_mesh: Any, cluster: Cluster | None = None) -> Mesh:
        """The virtual mesh of a torch DeviceMesh whose dims are named (mesh_dim_names)."""
        names = device_mesh.mesh_dim_names
        if not names:
            raise MeshError(
                "the DeviceMesh has no mesh_dim_names; build it with "
                "init_device_mesh(device, (2,), mesh_dim_names=('tp',))"
            )
        return Mesh.ordered(tuple(zip(names, device_mesh.mesh.shape, strict=True)), cluster)

    @staticmethod
    def auto(cluster: Cluster | None = None, *, global_batch: int | None = None,
             zero: tuple[int, ...] = (0, 1, 2, 3)) -> AutoMesh:  # fmt: skip
        """Every GPU of ``cluster``; the degrees, their nesting, micro-batching, schedule,
        recompute and ZeRO stage are searched at compile time for ``global_batch`` sequences
        per step (default: the example batch), within the ZeRO stages ``zero``."""
        return AutoMesh(cluster=cluster or Cluster.default(), global_batch=global_batch,
                        zero=tuple(zero))  # fmt: skip

    def size(self, axis: str) -> int:
        return dict(self.axes).get(axis, 1)

    @property
    def sizes(self) -> dict[str, int]:
        return dict(self.axes)

    @property
    def world_size(self) -> int:
        return math.prod(s for _, s in self.axes)

    def coordinates(self, rank: int) -> dict[str, int]:
        """Mesh coordinates of a global rank (row-major, last axis fastest)."""
        if not 0 <= rank < self.world_size:
            raise MeshError(f"rank {rank} is outside a mesh of {self.world_size} ranks")
        coords = {}
        for name, size in reversed(self.axes):
            coords[name] = rank % size
            rank //= size
        return {name: coords[name] for name, _ in self.axes}

    def rank_of(self, coords: dict[str, int]) -> int:
        rank = 0
        for name, size in self.axes:
            rank = rank * size + coords.get(name, 0)
        return rank

    def __str__(self) -> str:
        return "Mesh(" + ", ".join(f"{a}={s}" for a, s in self.axes) + ")"


@dataclass(frozen=True)
class AutoMesh:
    """A mesh whose degrees the whole-cluster search chooses (see :meth:`Mesh.auto`)."""

    cluster: Cluster
    global_batch: int | None = None
    zero: tuple[int, ...] = (0, 1, 2, 3)

    def __str__(self) -> str:
        c = self.cluster
        return f"Mesh.auto({c.nodes} × {c.gpus_per_node} {c.gpu.name})"
