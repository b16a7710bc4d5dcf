"""Resolve a model reference to a ModelSpec: a built-in name (`pipeplan models`), `path/to/file.py:factory` or
`package.module:factory`. Options arrive as `-a key=value` strings and are converted with the factory's type
annotations; an unknown option or a bad value is one ModelError line listing the valid options."""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import importlib.util
import inspect
import sys
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pipeplan.errors import ModelError, PipeplanError, user_code_location
from pipeplan.models.builtins import BUILTINS
from pipeplan.models.spec import ModelSpec, check_batch


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
    except Exception as exc:  # a user's factory may raise anything: one line naming it and where, no traceback
        where = user_code_location(exc)
        if where is not None:
            raise ModelError(f"your factory {ref!r} raised {_described(exc)} at {where}") from None
        if isinstance(exc, ValueError | TypeError):  # a built-in factory refusing its options
            raise ModelError(f"model {ref!r}: {exc}; valid options: {valid}") from None
        raise ModelError(f"model factory {ref!r} raised {_described(exc)}") from None
    except SystemExit as exc:
        raise ModelError(_exited(ref, "its factory", exc)) from None
    if not isinstance(spec, ModelSpec):
        raise ModelError(f"model factory {ref!r} must return a pipeplan ModelSpec, got {type(spec).__name__}")
    return guarded(spec, ref)


def _described(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {_first_line(exc)}"


def _exited(ref: str, what: str, exc: SystemExit) -> str:
    return (
        f"model {ref!r}: {what} called sys.exit({exc.code!r}) instead of returning; pipeplan stops here (a model's "
        "code must return or raise, not exit)"
    )


def _first_line(exc: BaseException) -> str:
    text = str(exc)
    return text.splitlines()[0] if text else "(no message)"


def guarded(spec: ModelSpec, ref: str) -> ModelSpec:
    """`spec` whose build() turns any exception into one ModelError line naming the factory, and whose
    sample_batch() checks it returns `((inputs, ...), target)`."""
    build, sample_batch = spec.build, spec.sample_batch

    def checked_build():
        try:
            return build()
        except PipeplanError:
            raise
        except Exception as exc:
            where = user_code_location(exc)
            at = f" at {where}" if where else ""
            raise ModelError(f"building model {ref!r} (its ModelSpec.build) raised {_described(exc)}{at}") from None
        except SystemExit as exc:
            raise ModelError(_exited(ref, "its ModelSpec.build", exc)) from None

    def checked_sample_batch(*args, **kwargs):
        try:
            batch = sample_batch(*args, **kwargs)
        except PipeplanError:
            raise
        except Exception as exc:
            where = user_code_location(exc)
            if where is None:
                raise
            raise ModelError(f"model {ref!r}: its sample_batch raised {_described(exc)} at {where}") from None
        except SystemExit as exc:
            raise ModelError(_exited(ref, "its sample_batch", exc)) from None
        return check_batch(batch, f"model {ref!r}: sample_batch")

    return dataclasses.replace(spec, build=checked_build, sample_batch=checked_sample_batch)


def _import_factory(ref: str) -> Callable[..., ModelSpec]:
    location, _, attr = ref.rpartition(":")
    if location.endswith(".py"):
        path = Path(location)
        if not path.is_file():
            raise ModelError(
                f"model file {location!r} does not exist (MODEL is name, file.py:factory or pkg.mod:factory)"
            )
        module = _exec_model_file(path, location)
    else:
        try:
            module = importlib.import_module(location)
        except ImportError as exc:
            raise ModelError(f"cannot import module {location!r} for model {ref!r}: {exc}") from None
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise ModelError(f"{location!r} has no callable {attr!r} (MODEL must be file.py:factory or pkg.mod:factory)")
    return factory


def _exec_model_file(path: Path, location: str):
    """Import a model file as a module; its own directory is importable while it loads (and stays so, since its
    functions may import lazily), so it can import a module beside it."""
    resolved = path.resolve()
    module_name = f"pipeplan_user_{resolved.stem}_{hashlib.sha256(str(resolved).encode()).hexdigest()[:12]}"
    spec = importlib.util.spec_from_file_location(module_name, resolved)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    folder = str(resolved.parent)
    if folder not in sys.path:
        sys.path.insert(0, folder)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as exc:  # a user's file may raise anything while importing
        del sys.modules[module_name]
        raise ModelError(
            f"importing model file {location!r} failed: {type(exc).__name__}: {_first_line(exc)}"
        ) from None
    except SystemExit as exc:  # sys.exit() at import time (a script, not a module): not a success
        del sys.modules[module_name]
        raise ModelError(
            f"importing model file {location!r} called sys.exit({exc.code!r}); a model file must define a factory "
            'and not exit when imported (guard script code with `if __name__ == "__main__":`)'
        ) from None
    return module


def file_of(ref: str) -> Path | None:
    """The file a reference's graph comes from: `path/to/file.py` of `path/to/file.py:factory`, or the config.json
    of a Hugging Face model directory `hf:path/to/dir` (None for built-ins, pkg.mod:factory and hf:<model_type>)."""
    if ref.startswith("hf:"):
        folder = Path(ref.removeprefix("hf:"))
        return folder / "config.json" if (folder / "config.json").is_file() else None
    location, sep, _ = ref.rpartition(":")
    return Path(location) if sep and location.endswith(".py") else None


def file_sha256(path: str | Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def canonical_ref(ref: str) -> tuple[str, str]:
    """(reference to record in a plan, sha256 of its model file or ""): a `file.py:factory` or `hf:dir` reference
    becomes absolute, so the plan runs from any directory, and its file's hash lets `run` refuse an edited file."""
    path = file_of(ref)
    if path is None or not path.is_file():
        return ref, ""
    if ref.startswith("hf:"):
        return f"hf:{path.parent.resolve()}", file_sha256(path)
    return f"{path.resolve()}:{ref.rpartition(':')[2]}", file_sha256(path)


def recorded_options(ref: str, spec: ModelSpec, given: dict[str, Any]) -> dict[str, Any]:
    """The options a plan records for its model: an `hf:` model's every config field that defines its shapes as
    built, with the adapter's options (rebuilding from them gives the same model, whatever transformers' defaults
    are); other models' options as given (a preset refuses its fixed options given again)."""
    return dict(spec.options) if ref.startswith("hf:") else dict(given)


def load_model(
    ref: str, options: dict[str, Any] | None = None, *, preset_overridable: tuple[str, ...] = ()
) -> ModelSpec:
    """Resolve `ref` (built-in name, file.py:factory, pkg.mod:factory) with `options` into a ModelSpec. A preset's
    fixed options may be replaced only where `preset_overridable` names them (e.g. capacity's --seq)."""
    options = dict(options or {})
    if ref in BUILTINS:
        builtin = BUILTINS[ref]
        if builtin.preset is not None:
            fixed = sorted((set(options) - set(preset_overridable)) & set(builtin.preset))
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
