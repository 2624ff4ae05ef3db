"""The plan's placement promise, checked where the job runs.

A plan prices each mesh axis on the link its groups ride (``Cluster.axis_in_node``: tp on
NVLink, dp or pp across nodes); nothing in the DeviceMesh guarantees that the ranks of a group
priced inside a node really share a host.  Algorithm (:func:`check_placement`, run by
``runtime.bind_mesh`` on every rank):
1. Every rank's host identity (``AUTOPAR_HOST_ID`` when set -- a test hook -- else
   ``socket.gethostname()``) is all-gathered over the job's default group.
2. The axes checked are the bandwidth-bound ones (tp, ep, cp) that the plan placed inside a
   node; each one's process groups are read from the DeviceMesh's rank layout.
3. A group spanning hosts is a :class:`MeshError` naming the axis, the group, its hosts and the
   mesh order that keeps every checked axis on one host (searched over the orders of the
   axes, ranks laid out as ``init_device_mesh`` does); when ranks per host differ from the
   cluster's GPUs per node, the cluster to describe as well.
4. Forced (``force=True`` or ``AUTOPAR_FORCE_PLACEMENT=1``) it is a warning with the cost
   model's predicted extra seconds per step: the axis's collectives of the plan priced on the
   inter-node link instead of the intra-node one.
"""

from __future__ import annotations

import itertools
import os
import socket
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from autopar.errors import MeshError
from autopar.mesh import KNOWN_AXES, Mesh
from cost.comm import collective_time

HOST_ENV = "AUTOPAR_HOST_ID"
FORCE_ENV = "AUTOPAR_FORCE_PLACEMENT"
CHECKED_AXES = ("tp", "ep", "cp")


def host_id() -> str:
    """Step 1: this process's host (``AUTOPAR_HOST_ID`` overrides the hostname)."""
    return os.environ.get(HOST_ENV) or socket.gethostname()


def exchange_hosts() -> list[str]:
    """Step 1: every global rank's host, all-gathered over the default group."""
    import torch.distributed as dist

    hosts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(hosts, host_id())
    return [str(h) for h in hosts]


@dataclass(frozen=True, kw_only=True)
class Misplaced:
    """A group of ``axis`` the plan placed inside a node whose ranks sit on several hosts."""

    axis: str
    ranks: tuple[int, ...]
    hosts: tuple[str, ...]

    def __str__(self) -> str:
        where = ", ".join(f"{r} on {h!r}" for r, h in zip(self.ranks, self.hosts, strict=True))
        return f"{self.axis} group {list(self.ranks)} spans hosts ({where})"


def axis_groups(layout: torch.Tensor, index: int) -> list[tuple[int, ...]]:
    """The global ranks of every group along mesh dim ``index`` of a DeviceMesh layout."""
    moved = layout.movedim(index, -1).reshape(-1, layout.shape[index])
    return [tuple(int(r) for r in row) for row in moved]


def promised(mesh: Mesh) -> list[str]:
    """Step 2: the checked axes the plan prices inside a node."""
    return [a for a, s in mesh.axes
            if a in CHECKED_AXES and s > 1 and mesh.cluster.axis_in_node(mesh.axes, a)]  # fmt: skip


def misplaced(mesh: Mesh, layout: torch.Tensor, hosts: Sequence[str]) -> list[Misplaced]:
    """Step 3: the promised axes' groups that span hosts."""
    names = [a for a, _ in mesh.axes]
    out = []
    for axis in promised(mesh):
        for group in axis_groups(layout, names.index(axis)):
            on = tuple(hosts[r] for r in group)
            if len(set(on)) > 1:
                out.append(Misplaced(axis=axis, ranks=group, hosts=on))
    return out


def fixing_order(mesh: Mesh, hosts: Sequence[str]) -> tuple[tuple[str, int], ...] | None:
    """Step 3: an axis order (ranks laid out row-major, as ``init_device_mesh`` does) whose
    checked axes all keep their groups on one host, closest to the canonical order first."""
    checked = [a for a, s in mesh.axes if a in CHECKED_AXES and s > 1]
    orders = sorted(itertools.permutations(mesh.axes),
                    key=lambda o: [KNOWN_AXES.index(a) for a, _ in o])  # fmt: skip
    for order in orders:
        layout = torch.arange(mesh.world_size).reshape([s for _, s in order])
        names = [a for a, _ in order]
        if all(len({hosts[r] for r in g}) == 1
               for a in checked for g in axis_groups(layout, names.index(a))):  # fmt: skip
            return tuple(order)
    return None


def extra_seconds(mesh: Mesh, collectives: Sequence[Any], axes: set[str]) -> float:
    """Step 4: the plan's collectives on ``axes`` priced on the inter-node link minus on the
    intra-node one (per step)."""
    c = mesh.cluster
    total = 0.0
    for coll in collectives:
        if coll.axis in axes:
            size = mesh.size(coll.axis)
            total += (collective_time(coll.kind, coll.bytes, size, c.inter)
                      - collective_time(coll.kind, coll.bytes, size, c.intra))  # fmt: skip
    return total


def check_placement(device_mesh: Any, mesh: Mesh, collectives: Sequence[Any] = (),
                    hosts: Sequence[str] | None = None, force: bool | None = None) -> None:  # fmt: skip
    """Steps 1-4: raise (or, forced, warn) when a group the plan placed in a node spans hosts."""
    hosts = exchange_hosts() if hosts is None else list(hosts)
    layout = torch.as_tensor(device_mesh.mesh).cpu()
    bad = misplaced(mesh, layout, hosts)
    if not bad:
        return
    force = os.environ.get(FORCE_ENV) == "1" if force is None else force
    axes = sorted({b.axis for b in bad})
    extra = extra_seconds(mesh, collectives, set(axes))
    c = mesh.cluster
    head = (f"the plan places {', '.join(axes)} inside a node (priced on {c.intra.name}, "
            f"{c.gpus_per_node} GPUs per node) but {bad[0]}"
            f"{_more(len(bad) - 1)}")  # fmt: skip
    cost = (f"predicted +{extra * 1e3:.3f} ms per step: {', '.join(axes)}'s collectives on "
            f"{c.inter.name} instead of {c.intra.name}")  # fmt: skip
    if force:
        warnings.warn(f"{head}; running anyway ({FORCE_ENV}): {cost}", stacklevel=3)
        return
    raise MeshError(f"{head}; {_fix(mesh, hosts)}; or set {FORCE_ENV}=1 to run anyway "
                    f"({cost})")  # fmt: skip


def _more(n: int) -> str:
    return "" if n == 0 else f" (and {n} more group{'s' if n > 1 else ''})"


def _fix(mesh: Mesh, hosts: Sequence[str]) -> str:
    """What to change: the mesh order that fixes it, and the cluster as the hosts are."""
    per_host = max(hosts.count(h) for h in set(hosts))
    cluster = ""
    if per_host != mesh.cluster.gpus_per_node:
        cluster = (f" and describe the cluster as it is ({len(set(hosts))} hosts of "
                   f"{per_host} ranks: Cluster(..., gpus_per_node={per_host}, "
                   f"nodes={len(set(hosts))}))")  # fmt: skip
    too_big = [f"{a}={s}" for a, s in mesh.axes if a in CHECKED_AXES and s > per_host]
    if too_big:
        return (f"{', '.join(too_big)} cannot fit on a host of {per_host} ranks: lower it to "
                f"at most {per_host}{cluster}")  # fmt: skip
    order = fixing_order(mesh, hosts)
    if order is None:
        return (f"no order of {mesh} keeps {', '.join(promised(mesh))} on one host with these "
                f"hosts; launch so that each host holds consecutive ranks{cluster}")  # fmt: skip
    shape = tuple(s for _, s in order)
    names = tuple(a for a, _ in order)
    return (
        f"build the DeviceMesh in the order {', '.join(f'{a}={s}' for a, s in order)}: "
        f"init_device_mesh(device, {shape}, mesh_dim_names={names}){cluster}"
    )
