"""The tensors a run holds: exact materialization, --init-from files, whole state_dicts written out, per-stage
checkpoints (see pipeplan/runtime/__init__.py)."""
