"""Resolve a model reference to a ModelSpec: a built-in name (`pipeplan models`), `path/to/file.py:factory` or
`package.module:factory`. Options arrive as `-a key=value` strings and are converted with the factory's type
annotations; an unknown option or a bad value is one ModelError line listing the valid options."""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import sys
import typing
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeplan.errors import ModelError
from pipeplan.models.spec import ModelSpec


@dataclass(frozen=True, kw_only=True)
class BuiltinModel:
    name: str
    factory: Callable[..., ModelSpec]
    description: str
    preset: dict[str, Any] | None = None  # fixed options for a named shape (gpt2-355m, llama-7b, ...)


BUILTINS: dict[str, BuiltinModel] = {}


def register(name: str, factory: Callable[..., ModelSpec], description: str, preset: dict | None = None) -> None:
    BUILTINS[name] = BuiltinModel(name=name, factory=factory, description=description, preset=preset)


def parse_assignments(pairs: list[str] | None) -> dict[str, str]:
    """`["layers=4", "hidden=256"]` -> `{"layers": "4", "hidden": "256"}`."""
    options: dict[str, str] = {}
    for pair in pairs or []:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise ModelError(f"model option {pair!r} must look like key=value (e.g. -a layers=4)")
        options[key.strip()] = value.strip()
    return options


def _convert(raw: Any, annotation: Any, key: str, valid: str) -> Any:
    if not isinstance(raw, str):
        return raw
    target = annotation
    if isinstance(annotation, str):
        target = {"int": int, "float": float, "bool": bool, "str": str}.get(annotation, str)
    origin_args = typing.get_args(target)
    if origin_args:  # Optional[int] / int | None
        target = next((arg for arg in origin_args if arg is not type(None)), str)
    try:
        if target is bool:
            lowered = raw.lower()
            if lowered not in ("true", "false", "1", "0", "yes", "no"):
                raise ValueError(raw)
            return lowered in ("true", "1", "yes")
        if target in (int, float):
            return target(raw)
    except ValueError:
        name = getattr(target, "__name__", str(target))
        raise ModelError(f"model option {key}={raw!r} must be {name}; valid options: {valid}") from None
    return raw


def _describe(params: list[inspect.Parameter]) -> str:
    return ", ".join(f"{p.name}={p.default!r}" for p in params) or "(none)"


def call_factory(factory: Callable[..., ModelSpec], options: dict[str, Any], *, ref: str) -> ModelSpec:
    """Call `factory(**options)` with options converted to its annotated types; errors are ModelError lines."""
    signature = inspect.signature(factory)
    params = [p for p in signature.parameters.values() if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)]
    accepts_any = any(p.kind is p.VAR_KEYWORD for p in signature.parameters.values())
    valid = _describe(params)
    known = {p.name: p for p in params}
    converted: dict[str, Any] = {}
    for key, raw in options.items():
        if key not in known and not accepts_any:
            raise ModelError(f"model {ref!r} has no option {key!r}; valid options: {valid}")
        param = known.get(key)
        annotation = param.annotation if param is not None else str
        if param is not None and annotation is inspect.Parameter.empty and param.default is not None:
            annotation = type(param.default)
        converted[key] = _convert(raw, annotation, key, valid)
    try:
        spec = factory(**converted)
    except (ValueError, TypeError) as exc:
        raise ModelError(f"model {ref!r}: {exc}; valid options: {valid}") from None
    if not isinstance(spec, ModelSpec):
        raise ModelError(f"model factory {ref!r} must return a pipeplan ModelSpec, got {type(spec).__name__}")
    return spec


def _import_factory(ref: str) -> Callable[..., ModelSpec]:
    location, _, attr = ref.rpartition(":")
    if location.endswith(".py"):
        path = Path(location)
        if not path.is_file():
            raise ModelError(
                f"model file {location!r} does not exist (MODEL is name, file.py:factory or pkg.mod:factory)"
            )
        module_name = f"pipeplan_user_{path.stem}_{abs(hash(str(path.resolve())))}"
        spec = importlib.util.spec_from_file_location(module_name, path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module
        try:
            spec.loader.exec_module(module)
        except Exception as exc:  # a user's file may raise anything while importing
            raise ModelError(f"importing model file {location!r} failed: {type(exc).__name__}: {exc}") from None
    else:
        try:
            module = importlib.import_module(location)
        except ImportError as exc:
            raise ModelError(f"cannot import module {location!r} for model {ref!r}: {exc}") from None
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise ModelError(f"{location!r} has no callable {attr!r} (MODEL must be file.py:factory or pkg.mod:factory)")
    return factory


def load_model(ref: str, options: dict[str, Any] | None = None) -> ModelSpec:
    """Resolve `ref` (built-in name, file.py:factory, pkg.mod:factory) with `options` into a ModelSpec."""
    options = dict(options or {})
    _ensure_builtins()
    if ref in BUILTINS:
        builtin = BUILTINS[ref]
        if builtin.preset is not None:
            fixed = sorted(set(options) & set(builtin.preset))
            if fixed:
                raise ModelError(f"preset {ref!r} fixes {', '.join(fixed)}; use the base model to change them")
            options = {**builtin.preset, **options}
        return call_factory(builtin.factory, options, ref=ref)
    if ref.startswith("hf:"):  # Hugging Face transformers (optional extra)
        from pipeplan.models.hf import hf_model

        return hf_model(ref.removeprefix("hf:"), options)
    if ":" not in ref:
        names = ", ".join(sorted(BUILTINS))
        raise ModelError(f"unknown model {ref!r}; built-in models: {names} (or file.py:factory, pkg.mod:factory)")
    return call_factory(_import_factory(ref), options, ref=ref)


def _ensure_builtins() -> None:
    import pipeplan.models  # noqa: F401  (registers the built-ins)
