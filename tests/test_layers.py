"""Imports point one way: each room imports only rooms at a lower layer (or its own).

    base (errors, units, console, options, jsonio, paths, precision, cluster)
      < models < profiling < schedules < partition < planner < capacity < runtime < cli

schedules/ is pure op-list code and knows nothing of profiles; partition/ asks schedules/ for the memory model;
capacity/ sits beside planner/ (it sweeps the planner's search) and nothing below imports it; runtime/ executes a
planner Plan. ARCHITECTURE.md explains what each room owns.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "pipeplan"
BASE = ("errors", "units", "console", "options", "jsonio", "paths", "precision", "cluster", "__init__", "__main__")
LAYERS = ("models", "profiling", "schedules", "partition", "planner", "capacity", "runtime", "cli")


def _rank(room: str) -> int:
    return -1 if room in BASE else LAYERS.index(room)


def _room(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {name for name in found if name == "pipeplan" or name.startswith("pipeplan.")}


def _modules():
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE)
        room = relative.parts[0] if len(relative.parts) > 1 else relative.stem
        yield room, path


def test_every_room_is_known():
    unknown = {room for room, _ in _modules()} - set(BASE) - set(LAYERS)
    assert not unknown, f"place these in BASE or LAYERS (and in ARCHITECTURE.md): {sorted(unknown)}"


def test_base_modules_import_only_base():
    for room, path in _modules():
        if room in BASE and room != "__main__":
            bad = {m for m in _imports(path) if _room(m) not in BASE}
            assert not bad, f"{path.relative_to(PACKAGE)} is a base module but imports {sorted(bad)}"


@pytest.mark.parametrize("room", LAYERS)
def test_imports_point_down(room):
    upward = []
    for module_room, path in _modules():
        if module_room != room:
            continue
        for module in _imports(path):
            target = _room(module)
            if target != room and _rank(target) > _rank(room):
                upward.append(f"{path.relative_to(PACKAGE)} imports {module}")
    assert not upward, "imports running up the layers: " + "; ".join(upward)
