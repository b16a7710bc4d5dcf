"""Search over (pipeline depth, replicas, microbatches, schedule); Plan read/write; launch scripts; capacity."""
