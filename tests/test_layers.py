"""Imports point one way, files import no circle, and no module reaches into another's private names.

Each room (a subpackage, or a base module) says which rooms it may import (`MAY_IMPORT`, besides itself and the
base modules); ARCHITECTURE.md draws the same map:

    base (errors, units, console, options, jsonio, paths, precision, cluster, hardware, version)
    models < graph < profiling < calibrate
    schedules (pure op lists: base only)
    costs < partition < predict < artifact < search < capacity, refine (a run's trace -> refined profile -> plan again)
    runtime (executes a Plan: artifact, graph, schedules, models; nothing of the search), in rooms of its own:
        runtime.weights < runtime.step < runtime.train < runtime.launch < runtime (commands, export_weights)
    api, cli (everything): the Python API and the command line over it; the package's `__init__` names the API's
    functions lazily (`pipeplan.profile` loads pipeplan.api on first use)

Imports are counted wherever they are written (module level, inside functions, under TYPE_CHECKING).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "pipeplan"
BASE = (
    "errors",
    "units",
    "console",
    "options",
    "jsonio",
    "paths",
    "precision",
    "cluster",
    "hardware",
    "version",
    "__init__",
    "__main__",
)
MAY_IMPORT: dict[str, set[str]] = {
    "models": set(),
    "graph": {"models"},
    "profiling": {"models", "graph"},
    "calibrate": {"models", "graph", "profiling"},
    "schedules": set(),
    "costs": {"profiling", "graph", "schedules"},
    "partition": {"costs", "profiling", "graph", "schedules"},
    "predict": {"partition", "costs", "profiling", "graph", "schedules"},
    "artifact": {"predict", "costs", "profiling", "graph", "schedules", "models"},
    "search": {"artifact", "predict", "partition", "costs", "profiling", "graph", "schedules", "models"},
    "capacity": {"search", "artifact", "predict", "partition", "costs", "profiling", "graph", "schedules", "models"},
    "refine": {"search", "artifact", "predict", "partition", "costs", "profiling", "graph", "schedules", "models"},
}
RUNTIME_ROOMS = ("weights", "step", "train", "launch")  # runtime's subpackages, bottom to top
_BELOW_RUNTIME = {"artifact", "graph", "schedules", "models"}  # nothing of the search
for _i, _sub in enumerate(RUNTIME_ROOMS):
    MAY_IMPORT[f"runtime.{_sub}"] = _BELOW_RUNTIME | {f"runtime.{below}" for below in RUNTIME_ROOMS[:_i]}
MAY_IMPORT["runtime"] = _BELOW_RUNTIME | {f"runtime.{sub}" for sub in RUNTIME_ROOMS}  # commands.py, export_weights.py
MAY_IMPORT["api"] = set(MAY_IMPORT)
MAY_IMPORT["cli"] = set(MAY_IMPORT) | {"api"}
BASE_MAY_IMPORT = {"__init__": {"api"}}  # the package's face: its lazy attributes are the API's functions


def _room(module: str) -> str:
    parts = module.split(".")
    if len(parts) > 2 and parts[1] == "runtime" and parts[2] in RUNTIME_ROOMS:
        return f"runtime.{parts[2]}"
    return parts[1] if len(parts) > 1 else "__init__"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _import_nodes(path: Path):
    """(imported module, names imported from it) for every pipeplan import in `path`."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "pipeplan" or node.module.startswith("pipeplan."):
                yield node.module, [alias.name for alias in node.names]
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "pipeplan" or alias.name.startswith("pipeplan."):
                    yield alias.name, []


def _imports(path: Path) -> set[str]:
    return {module for module, _ in _import_nodes(path)}


def _modules():
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE)
        room = relative.parts[0] if len(relative.parts) > 1 else relative.stem
        if room == "runtime" and len(relative.parts) > 2:
            room = f"runtime.{relative.parts[1]}"
        yield room, path


def _known_modules() -> dict[str, Path]:
    return {_module_name(path): path for _, path in _modules()}


def test_every_room_is_known():
    unknown = {room for room, _ in _modules()} - set(BASE) - set(MAY_IMPORT)
    assert not unknown, f"place these in BASE or MAY_IMPORT (and in ARCHITECTURE.md): {sorted(unknown)}"


def test_base_modules_import_only_base():
    for room, path in _modules():
        if room in BASE and room != "__main__":
            allowed = set(BASE) | BASE_MAY_IMPORT.get(room, set())
            bad = {m for m in _imports(path) if _room(m) not in allowed}
            assert not bad, f"{path.relative_to(PACKAGE)} is a base module but imports {sorted(bad)}"


@pytest.mark.parametrize("room", sorted(MAY_IMPORT))
def test_rooms_import_only_what_they_stand_on(room):
    allowed = MAY_IMPORT[room] | set(BASE) | {room}
    wrong = [
        f"{path.relative_to(PACKAGE)} imports {module}"
        for module_room, path in _modules()
        if module_room == room
        for module in _imports(path)
        if _room(module) not in allowed
    ]
    assert not wrong, f"{room}/ may import only {sorted(MAY_IMPORT[room])} and base: " + "; ".join(wrong)


def _file_graph() -> dict[str, set[str]]:
    """Module -> the pipeplan modules it imports (a `from package import name` that names a submodule counts as
    importing that submodule)."""
    known = _known_modules()
    graph: dict[str, set[str]] = {}
    for name, path in known.items():
        targets = set()
        for module, names in _import_nodes(path):
            submodules = {f"{module}.{n}" for n in names if f"{module}.{n}" in known}
            targets |= submodules or ({module} if module in known else set())
        graph[name] = targets - {name}
    return graph


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_no_import_circle_between_files():
    """A package's `__init__` re-exporting its modules is not a circle with them unless a module imports it back."""
    cycle = _find_cycle(_file_graph())
    assert cycle is None, "files importing each other in a circle: " + " -> ".join(cycle)


def test_the_cycle_finder_finds_cycles():
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_private_names_from_other_modules():
    known = _known_modules()
    found = []
    for name, path in known.items():
        for module, names in _import_nodes(path):
            private = [n for n in names if n.startswith("_") and not n.startswith("__")]
            if private and module != name:
                found.append(f"{path.relative_to(PACKAGE)} imports {', '.join(private)} from {module}")
    assert not found, "private names used outside their module (make them public or move them): " + "; ".join(found)
