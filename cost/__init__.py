"""cost: prices ops, collectives and memory of a plan on a mesh's hardware."""
