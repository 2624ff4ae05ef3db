"""cleanup: remove dead code left by the rewrites.

Algorithm:
1. Erase nodes without users that have no side effects (collectives feed their consumers, so a
   collective without users is dead too).
2. Lint and recompile.
"""

from __future__ import annotations

import torch.fx as fx

from passes import PassContext


def cleanup(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Dead-code elimination (steps 1-2)."""
    del ctx
    gm.graph.eliminate_dead_code()
    gm.graph.lint()
    gm.recompile()
    return gm
