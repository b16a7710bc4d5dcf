"""Versioned JSON files written atomically (temp file + rename) and read with one clear error per problem."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import tempfile
import types
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pipeplan.errors import FormatError, OutputError
from pipeplan.paths import not_regular


def atomic_write(path: str | os.PathLike, write: Callable[[str], None]) -> None:
    """Have `write(temporary_path)` write the file, then rename it onto `path`, so that readers see either the old
    file or the complete new one. An OS error (a directory in the way, a full disk, no permission) is one
    OutputError naming the path; nothing is left behind. Only a regular file is ever replaced: a device node, a
    FIFO or a socket at `path` is refused (a symbolic link is written through, onto the file it names)."""
    target = Path(os.path.realpath(path))
    _refuse_special(path, target)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
        os.close(fd)
    except OSError as exc:
        raise OutputError(f"cannot write {str(target)!r}: {exc.strerror or exc}") from None
    try:
        write(tmp)
        _refuse_special(path, target)  # created while `write` ran
        os.replace(tmp, target)
    except OSError as exc:
        Path(tmp).unlink(missing_ok=True)
        raise OutputError(f"cannot write {str(target)!r}: {exc.strerror or exc}") from None
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _refuse_special(path: str | os.PathLike, target: Path) -> None:
    kind = not_regular(target)
    if kind is not None:
        raise OutputError(
            f"cannot write {str(path)!r}: it is {kind}, not a regular file, and pipeplan replaces only regular "
            "files; choose another path"
        )


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """Write `text` to `path` atomically (`atomic_write`), synced to disk before the rename."""

    def write(tmp: str) -> None:
        with open(tmp, "w") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())

    atomic_write(path, write)


def write_json(path: str | os.PathLike, data: dict[str, Any]) -> None:
    atomic_write_text(path, json.dumps(data, indent=2, sort_keys=False) + "\n")


def fingerprint(data: dict[str, Any]) -> str:
    """A file's content fingerprint: sha256 of its JSON with sorted keys (the first 16 hex digits); the same for a
    dataclass written and read back (`Plan`, `Profile`), so a run's trace can name the plan and profile it ran."""
    text = json.dumps(data, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def read_json(
    path: str | os.PathLike, *, kind: str, schema_version: int, older_versions: tuple[int, ...] = ()
) -> dict[str, Any]:
    """Read a `kind` file (e.g. "profile") and check its schema_version: the current one, or one of
    `older_versions` that the caller still reads (it fills in what they lack); errors name the file."""
    target = Path(path)
    if not target.is_file():
        raise FormatError(f"{kind} file {str(target)!r} does not exist")
    try:
        data = json.loads(target.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise FormatError(f"{kind} file {str(target)!r} is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise FormatError(f"{kind} file {str(target)!r} must hold a JSON object")
    found = data.get("schema_version")
    if found != schema_version and (isinstance(found, bool) or found not in older_versions):
        raise FormatError(
            f"{kind} file {str(target)!r} has schema_version {found!r}; this pipeplan reads version "
            f"{schema_version} (re-create the file with this version)"
        )
    return data


def require_fields(data: dict[str, Any], fields: list[str], *, where: str) -> None:
    """Fail with one line listing every missing field of `where`."""
    missing = [name for name in fields if name not in data]
    if missing:
        raise FormatError(f"{where} is missing field(s): {', '.join(missing)}")


def build_dataclass(cls: type, data: Any, *, where: str) -> Any:
    """`cls(**data)` with every field checked against its annotation, recursively (nested dataclasses, tuples,
    lists, dicts, optionals): a missing, unknown or mistyped field, or a number that is negative or not finite, is
    one FormatError naming `where` and the field. (Files pipeplan writes hold no negative numbers.)"""
    if not isinstance(data, dict):
        raise FormatError(f"{where} must be a JSON object, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    known = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise FormatError(f"{where} has unknown field(s): {', '.join(unknown)}")
    required = [
        name
        for name, f in known.items()
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    ]
    require_fields(data, required, where=where)
    values = {name: _coerce(hints[name], value, f"{where}: {name}") for name, value in data.items()}
    try:
        return cls(**values)
    except (TypeError, ValueError) as exc:
        raise FormatError(f"{where}: {exc}") from None


def _coerce(hint: Any, value: Any, where: str) -> Any:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for option in (a for a in args if a is not type(None)):
            try:
                return _coerce(option, value, where)
            except FormatError as exc:
                errors.append(str(exc))
        raise FormatError(errors[0] if len(errors) == 1 else f"{where} has an unexpected value {value!r}")
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return build_dataclass(hint, value, where=where)
    if origin in (tuple, list):
        if not isinstance(value, list | tuple):
            raise FormatError(f"{where} must be a list, got {type(value).__name__}")
        if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
            items = [_coerce(args[0], v, f"{where}[{i}]") for i, v in enumerate(value)]
        elif origin is tuple and args:
            if len(value) != len(args):
                raise FormatError(f"{where} must have {len(args)} items, got {len(value)}")
            items = [_coerce(a, v, f"{where}[{i}]") for i, (a, v) in enumerate(zip(args, value))]
        else:
            items = [_coerce(args[0], v, f"{where}[{i}]") if args else v for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is dict or hint is dict:
        if not isinstance(value, dict):
            raise FormatError(f"{where} must be an object, got {type(value).__name__}")
        return dict(value)
    return _scalar(hint, value, where)


def _scalar(hint: Any, value: Any, where: str) -> Any:
    if hint is bool:
        if not isinstance(value, bool):
            raise FormatError(f"{where} must be true or false, got {value!r}")
        return value
    if hint is int or hint is float:
        ok = isinstance(value, int) if hint is int else isinstance(value, int | float)
        if isinstance(value, bool) or not ok:
            raise FormatError(f"{where} must be {'an integer' if hint is int else 'a number'}, got {value!r}")
        if not math.isfinite(value) or value < 0:
            raise FormatError(f"{where} must be a finite number >= 0, got {value!r}")
        return value
    if hint is str:
        if not isinstance(value, str):
            raise FormatError(f"{where} must be a string, got {value!r}")
        return value
    return value
