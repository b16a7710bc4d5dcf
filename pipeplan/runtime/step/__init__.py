"""One rank's step: its stages, messages and transfers, the F/B/I/W executor, recomputation, gradient groups, the
optimizer step (ZeRO-1), precision at run time, weight versions (see pipeplan/runtime/__init__.py)."""
