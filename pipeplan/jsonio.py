"""Versioned JSON files written atomically (temp file + rename) and read with one clear error per problem."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

from pipeplan.errors import FormatError


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """Write `text` to `path` so that readers see either the old file or the complete new one."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_json(path: str | os.PathLike, data: dict[str, Any]) -> None:
    atomic_write_text(path, json.dumps(data, indent=2, sort_keys=False) + "\n")


def read_json(path: str | os.PathLike, *, kind: str, schema_version: int) -> dict[str, Any]:
    """Read a `kind` file (e.g. "profile") and check its schema_version; errors name the file."""
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
    if found != schema_version:
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
