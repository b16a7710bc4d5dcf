"""Megatron-LM's distributed-optimizer table, a test oracle for pipeplan's bytes per parameter (costs/optimizer.py).

Source: Megatron Core developer guide, "Distributed Optimizer" (docs.nvidia.com/megatron-core/developer-guide/latest/
api-guide/dist_optimizer.html). The optimizer state is Adam's fp32 moments (8 bytes) plus the fp32 main copies the
model's own dtypes do not already provide."""

# (param dtype, grad dtype) -> (bytes without the distributed optimizer, (constant, numerator) of c + n/d over d ranks)
MEGATRON_TABLE = {
    "float16 param, float16 grads": (20, (4, 16)),
    "float16 param, fp32 grads": (18, (6, 12)),
    "fp32 param, fp32 grads": (16, (8, 8)),
}
# (weights, gradients, optimizer state incl. fp32 main params / main grads) of each row, in bytes per parameter
MEGATRON_SPLITS = {
    "float16 param, float16 grads": (2, 2, 16),  # fp32 main params + main grads + Adam m, v
    "float16 param, fp32 grads": (2, 4, 12),  # fp32 main params + Adam m, v (grads accumulate in fp32)
    "fp32 param, fp32 grads": (4, 4, 8),  # Adam m, v
}
