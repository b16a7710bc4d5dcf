"""Schedule generators: each a pure function (devices, microbatches, ...) -> Schedule, one file per schedule
family, citing its paper and commenting its phases. The registry (`schedules/registry.py`) names them."""
