"""Executes a Plan on torch.distributed: stage building, per-rank executor, split backward, training loop."""
