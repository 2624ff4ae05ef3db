"""passes: graph rewrites that implement a plan."""
