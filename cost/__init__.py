"""cost: prices ops, collectives and memory of a plan on a mesh's hardware.

Modules, from hardware up to a whole plan:
- `hardware`  GPU, Link and Cluster presets; which link a mesh axis rides.
- `comm`      alpha–beta collective times (ring, tree, hierarchical).
- `compute`   FLOPs and bytes per ATen node; roofline time with efficiency factors.
- `model`     ModelShape: transformer dimensions and named presets.
- `config`    ParallelConfig and its validation against model and cluster.
- `workload`  per-rank, per-micro-batch work of a ModelShape; `graph` the same for a traced model.
- `memory`    per-rank memory: model state per ZeRO stage, activations in flight.
- `step`      step time: compute, exposed communication per axis, pipeline bubble.
- `estimate`  the search over free fields and the printed `Estimate` (`report`).
- `symbolic`  the closed formulas as sympy expressions.

`cost` imports nothing from `passes` or the autopar runtime.
"""
