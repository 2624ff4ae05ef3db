"""context_parallel: split every sequence-dim value over the ``cp`` mesh axis.

Runs on the graph the tp passes lowered (or the traced graph without tp), with the sequence
layout and attention choices the cp planner part decided (``ctx.sections["cp"]``,
autopar.axes.context_parallel.CpDecisions).

Algorithm:
1. Set the tp layouts aside, so the walk sees the cp axis alone.
2. Walk the graph (autopar.axes.context_parallel's ``_SplitSequence``): inputs' sequence chunks
   are localized, ops run split by their sharding rules on the cp axis, replicated operands
   get their gradient reduced, attention becomes ring or all-to-all attention, a mean loss
   over the sequence becomes a sum and a count all-reduced, split outputs are gathered.
3. Shape arguments become local over cp (passes.localize on the cp axis).
4. The tp layouts come back with cp added on the sequence dim (``P(None, ('cp', 'tp'),
   None)`` under Megatron-SP: cp outer, tp inner); each ring exchange is annotated with its
   peers and bytes.  The attention prices are left in ``gm.meta["cp_prices"]``.
"""

from __future__ import annotations

import torch.fx as fx

from passes import PassContext


def context_parallel(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Steps 1-4."""
    from autopar.axes.context_parallel import split_sequence

    return split_sequence(gm, ctx)
