"""Capture: torch.export tracing and the rewrites before planning (canonical forms, in-place writes, vocab padding, fused-projection cuts, MoE loops, autocast dtypes, mask structure)."""
