"""Tracing (torch.fx -> LayerGraph), measured and analytic profiling, Profile read/write."""
