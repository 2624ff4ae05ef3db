"""Run programs inside a distributed job: bind mesh axes to torch DeviceMesh process groups.

Algorithm (:func:`bind_mesh`):
1. Check the job's world size equals the mesh size (a mismatch would hang in the first
   collective, so it is an error up front).
2. Bind each named mesh dim to its process group (NCCL on GPU, Gloo on CPU, as the DeviceMesh
   was built) for the collectives in the per-rank program.
3. Return this rank's global rank in the mesh (row-major coordinates).
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from autopar import collectives
from autopar.errors import MeshError
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
