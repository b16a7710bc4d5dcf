"""The training run: RunConfig, the one loop and its step strategies, the checks before an update, the optimizer and
learning-rate schedule, metrics, the measured trace (see pipeplan/runtime/__init__.py)."""
