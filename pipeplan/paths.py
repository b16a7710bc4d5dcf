"""Output paths checked before any work starts, so a bad `-o` / `--trace` / `--plot` fails in one line up front
instead of after a long profile or run."""

from __future__ import annotations

import os
from pathlib import Path

from pipeplan.errors import ConfigError

_NAME_MAX = 255


def _first_existing(path: Path) -> Path:
    for candidate in (path, *path.parents):
        if candidate.exists():
            return candidate
    return Path(".")


def _check_common(path: Path | str | None, option: str) -> Path:
    if path is None or str(path).strip() == "":
        raise ConfigError(f"{option} needs a path; got an empty one")
    target = Path(path).expanduser()
    too_long = [part for part in target.parts if len(os.fsencode(part)) > _NAME_MAX]
    if too_long or len(os.fsencode(str(target.absolute()))) > 4095:
        raise ConfigError(f"{option} {str(path)[:60]!r}...: a file name is too long; choose a shorter path")
    return target


def _check_parent(target: Path, option: str) -> None:
    existing = _first_existing(target.parent)
    if not existing.is_dir():
        raise ConfigError(
            f"{option} {str(target)!r}: {str(existing)!r} is a file, not a directory; choose another path"
        )
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"{option} {str(target)!r}: no permission to write in {str(existing)!r}")


def check_output_file(path: Path | str | None, option: str) -> Path:
    """A file pipeplan will write: not a directory, under a directory it can create and write in."""
    target = _check_common(path, option)
    if target.is_dir():
        raise ConfigError(f"{option} {str(target)!r} is a directory; give a file name (e.g. {target}/out.json)")
    if target.exists() and not os.access(target, os.W_OK):
        raise ConfigError(f"{option} {str(target)!r} is not writable")
    _check_parent(target, option)
    return target


def check_output_dir(path: Path | str | None, option: str) -> Path:
    """A directory pipeplan will create (or write into): not a file, creatable and writable."""
    target = _check_common(path, option)
    if target.exists() and not target.is_dir():
        raise ConfigError(f"{option} {str(target)!r} is a file; give a directory")
    if target.is_dir():
        if not os.access(target, os.W_OK | os.X_OK):
            raise ConfigError(f"{option} {str(target)!r} is not writable")
        return target
    _check_parent(target, option)
    return target
