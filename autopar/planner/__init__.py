"""Planning: the tensor-parallel solver (tp) and the whole-cluster search front end (auto, for Mesh.auto), both priced by cost/."""
