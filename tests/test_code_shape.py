"""The code's shape, checked on the source with `ast`: in pipeplan/, files under 400 lines, functions under 60 and
CLI commands (the functions `pipeplan.cli` registers) under 40 — parse -> library call -> render; and nowhere
(package, tests, benchmarks, examples) lines packed past the formatter with its skip marker.

A function's length counts from its `def` line to its last line: signature, docstring and body (decorators not).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "pipeplan"
FORMATTED = ("pipeplan", "tests", "benchmarks", "examples")
SKIP_MARKER = "# fmt: " + "skip"  # spelled in two parts so that grepping the repository finds only real uses
MAX_FILE_LINES = 400
MAX_FUNCTION_LINES = 60
MAX_COMMAND_LINES = 40

# Functions allowed over MAX_FUNCTION_LINES while another change splits them (none now). Keys: "path relative to
# pipeplan/:qualified function name", e.g. "search/search.py:search_plans".
LONG_FUNCTIONS_ALLOWED: set[str] = set()
# Files allowed to keep the skip marker (none: every skip was formatted away in issue 13). Paths from the root.
FMT_SKIP_ALLOWED: set[str] = set()


def _sources() -> dict[str, str]:
    return {str(path.relative_to(PACKAGE)): path.read_text(encoding="utf-8") for path in sorted(PACKAGE.rglob("*.py"))}


def _all_python() -> dict[str, str]:
    paths = [path for folder in FORMATTED for path in sorted((ROOT / folder).rglob("*.py"))]
    return {str(path.relative_to(ROOT)): path.read_text(encoding="utf-8") for path in paths}


def _functions(tree: ast.AST, prefix: str = ""):
    """(qualified name, node) for every function and method, nested ones too."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            yield prefix + node.name, node
            yield from _functions(node, f"{prefix}{node.name}.")
        elif isinstance(node, ast.ClassDef):
            yield from _functions(node, f"{prefix}{node.name}.")
        else:
            yield from _functions(node, prefix)


def _length(node: ast.AST) -> int:
    return node.end_lineno - node.lineno + 1


def _registered_commands() -> list[tuple[str, str]]:
    """(file, function) of every command `pipeplan.cli` registers: its `_COMMANDS` table, read from the source."""
    tree = ast.parse((PACKAGE / "cli.py").read_text(encoding="utf-8"))
    table = next(
        node.value
        for node in ast.walk(tree)
        if isinstance(node, ast.AnnAssign | ast.Assign)
        and any(
            getattr(t, "id", None) == "_COMMANDS" for t in getattr(node, "targets", [getattr(node, "target", None)])
        )
    )
    targets = [ast.literal_eval(item)[1] for item in table.elts]
    return [
        (module.removeprefix("pipeplan.").replace(".", "/") + ".py", func)
        for module, func in (t.split(":") for t in targets)
    ]


def test_files_under_400_lines():
    long = {name: text.count("\n") for name, text in _sources().items() if text.count("\n") > MAX_FILE_LINES}
    assert not long, f"files over {MAX_FILE_LINES} lines: {long}"


def test_functions_under_60_lines():
    long = {}
    for name, text in _sources().items():
        for qualname, node in _functions(ast.parse(text)):
            if _length(node) > MAX_FUNCTION_LINES and f"{name}:{qualname}" not in LONG_FUNCTIONS_ALLOWED:
                long[f"{name}:{qualname}"] = _length(node)
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines: {long}"


def test_allow_lists_hold_only_what_still_breaks_the_rules():
    sources = _sources()
    lengths = {
        f"{name}:{q}": _length(node) for name, text in sources.items() for q, node in _functions(ast.parse(text))
    }
    stale = [key for key in LONG_FUNCTIONS_ALLOWED if lengths.get(key, 0) <= MAX_FUNCTION_LINES]
    everywhere = _all_python()
    stale += [name for name in FMT_SKIP_ALLOWED if SKIP_MARKER not in everywhere.get(name, "")]
    assert not stale, f"remove from the allow-lists (fixed or gone): {stale}"


def test_no_formatter_skips():
    packed = [name for name, text in _all_python().items() if SKIP_MARKER in text and name not in FMT_SKIP_ALLOWED]
    assert not packed, f"{SKIP_MARKER!r} in {packed}: format these lines normally"


def test_commands_are_registered_and_short():
    commands = _registered_commands()
    assert len(commands) >= 9  # models, profile, simulate, plan, show, export, run, capacity, calibrate
    sources = _sources()
    long = {}
    for path, func in commands:
        nodes = [node for name, node in _functions(ast.parse(sources[path])) if name == func]
        assert len(nodes) == 1, f"{path} must define one top-level function {func}"
        if _length(nodes[0]) > MAX_COMMAND_LINES:
            long[f"{path}:{func}"] = _length(nodes[0])
    assert not long, f"CLI commands over {MAX_COMMAND_LINES} lines (move work into library functions): {long}"


def test_the_walker_sees_methods_and_nested_functions():
    """Methods and nested functions are measured too, from `def` to the last line."""
    statements = "".join(f"        x{i} = {i}\n" for i in range(MAX_FUNCTION_LINES))
    source = f"class A:\n    def long(self):\n{statements}        def inner():\n            pass\n"
    found = dict(_functions(ast.parse(source)))
    assert set(found) == {"A.long", "A.long.inner"}
    assert _length(found["A.long"]) == MAX_FUNCTION_LINES + 3 and _length(found["A.long.inner"]) == 2
