"""Run-time ops the generated rank programs call: named, differentiable collectives and the lowerings a split needs (vocab-parallel ops, ring attention)."""
