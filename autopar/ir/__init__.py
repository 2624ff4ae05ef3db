"""The IR around the torch.export graph: N-D layouts, the one metadata key, shared analyses."""
