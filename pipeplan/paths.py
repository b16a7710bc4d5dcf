"""Output paths checked before any work starts, so a bad `-o` / `--trace` / `--plot` fails in one line up front
instead of after a long profile or run."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from pipeplan.errors import ConfigError

_NAME_MAX = 255


def _first_existing(path: Path) -> Path:
    for candidate in (path, *path.parents):
        if candidate.exists():
            return candidate
    return Path(".")


_KINDS = (
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISDIR, "a directory"),
)


def not_regular(path: Path | str) -> str | None:
    """What the existing `path` is when it is not a regular file ("a character device", ...; symbolic links
    followed), or None (a regular file, or nothing there yet). pipeplan replaces only regular files."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return None
    if stat.S_ISREG(mode):
        return None
    return next((kind for test, kind in _KINDS if test(mode)), "not a regular file")


def check_replaceable(path: Path | str, option: str) -> None:
    """Refuse an output path that exists and is not a regular file (a device node such as /dev/null, a FIFO, a
    socket): writing pipeplan's file there would replace it or block."""
    kind = not_regular(path)
    if kind is not None and kind != "a directory":
        raise ConfigError(
            f"{option} {str(path)!r} is {kind}, not a regular file; pipeplan writes only regular files: give a "
            "file path"
        )


def _check_common(path: str | os.PathLike[str] | None, option: str) -> Path:
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


def check_output_file(path: str | os.PathLike[str] | None, option: str) -> Path:
    """A file pipeplan will write: not a directory, under a directory it can create and write in."""
    target = _check_common(path, option)
    if target.is_dir():
        raise ConfigError(f"{option} {str(target)!r} is a directory; give a file name (e.g. {target}/out.json)")
    check_replaceable(target, option)
    if target.exists() and not os.access(target, os.W_OK):
        raise ConfigError(f"{option} {str(target)!r} is not writable")
    _check_parent(target, option)
    return target


def check_output_dir(path: str | os.PathLike[str] | None, option: str, files: tuple[str, ...] = ()) -> Path:
    """A directory pipeplan will create (or write `files` into): not a file, creatable and writable, and none of
    `files` already there as something other than a regular file."""
    target = _check_common(path, option)
    if target.exists() and not target.is_dir():
        kind = not_regular(target)
        raise ConfigError(f"{option} {str(target)!r} is {kind or 'a file'}; give a directory")
    if target.is_dir():
        if not os.access(target, os.W_OK | os.X_OK):
            raise ConfigError(f"{option} {str(target)!r} is not writable")
        for name in files:
            inside = target / name
            if not_regular(inside) is not None:
                raise ConfigError(
                    f"{option} {str(target)!r}: {str(inside)!r} is {not_regular(inside)}, not a regular file; "
                    "pipeplan replaces only regular files: give another directory"
                )
        return target
    _check_parent(target, option)
    return target
