"""The model as pipeplan runs it: tracing (torch.fx / torch.export -> LayerGraph), stage modules, the loss stage, the
one backward (B, I, W), the saved-tensor rule, value dtypes and recomputation modes. Both profilers and the runtime
stand on this room."""
