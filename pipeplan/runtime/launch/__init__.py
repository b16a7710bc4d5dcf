"""Starting ranks: the local launch, one rank under torchrun, heartbeats, the checks before any rank starts, `run`'s
options (see pipeplan/runtime/__init__.py)."""
