"""Per-layer costs (`Profile`): measured on cpu/cuda, analytic on the meta device for a hardware preset, or imported
from PipeDream's profiler; Profile read/write and its summary; the `profile` command."""
