"""Parsing and printing sizes, counts and times: `80GiB`, `1.5e9`, `1T` tokens. Every number pipeplan prints as
bytes, GiB, a count or milliseconds goes through one of the `format_*` functions here."""

from __future__ import annotations

import math
import re

from pipeplan.errors import ConfigError

_DECIMAL_UNITS = {"kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_BINARY_UNITS = {"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_BYTE_UNITS = {"": 1, "b": 1, **_DECIMAL_UNITS, **_BINARY_UNITS, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}
_COUNT_UNITS = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "g": 10**9, "t": 10**12}
_NUMBER = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z]*)\s*$", re.IGNORECASE)


def parse_size(text: str | int | float, *, option: str = "size") -> int:
    """`"80GiB"` -> bytes; bare numbers are bytes; `G`/`GB` are 2**30 / 10**9."""
    if isinstance(text, int | float):
        value, unit = float(text), ""
    else:
        match = _NUMBER.match(text)
        if not match or match.group(2).lower() not in _BYTE_UNITS:
            raise ConfigError(f"{option} {text!r} is not a size; use e.g. 80GiB, 16GB or 512MiB")
        value, unit = float(match.group(1)), match.group(2).lower()
    if not math.isfinite(value * _BYTE_UNITS[unit]) or value * _BYTE_UNITS[unit] >= 2**63:
        raise ConfigError(f"{option} {text!r} is too large")
    size = int(value * _BYTE_UNITS[unit])
    if size <= 0:
        raise ConfigError(f"{option} must be positive, got {text!r}")
    return size


def parse_count(text: str | int | float, *, option: str = "count") -> float:
    """`"1T"` -> 1e12, `"300B"` -> 3e11, `"2.5M"` -> 2.5e6."""
    if isinstance(text, int | float):
        return float(text)
    match = _NUMBER.match(text)
    if not match or match.group(2).lower() not in _COUNT_UNITS:
        raise ConfigError(f"{option} {text!r} is not a count; use e.g. 1T, 300B or 2.5e9")
    value = float(match.group(1)) * _COUNT_UNITS[match.group(2).lower()]
    if not math.isfinite(value):
        raise ConfigError(f"{option} {text!r} is too large")
    return value


def parse_int_list(text: str, *, option: str, example: str = "2,4") -> tuple[int, ...]:
    """`"4"` or `"1,2,4"` -> sorted distinct positive integers; an empty item (`"8,,"`) is an error."""
    parts = [part.strip() for part in str(text).split(",")]
    try:
        values = [int(part) for part in parts]
    except ValueError:
        raise ConfigError(f"{option} {text!r} must be an integer or a list like {example}") from None
    if any(value < 1 for value in values):
        raise ConfigError(f"{option} {text!r}: every value must be >= 1")
    return tuple(sorted(set(values)))


GIB = 2**30
_BINARY_STEPS = (("T", 2**40), ("G", 2**30), ("M", 2**20), ("K", 2**10))
_COUNT_STEPS = (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3))


def format_bytes(num: float, *, compact: bool = False) -> str:
    """`1.50 GiB` (binary units); `compact` for narrow table cells: `1.5G`, `4.0K`, `512B`."""
    for unit, scale in _BINARY_STEPS:
        if abs(num) >= scale:
            return f"{num / scale:.1f}{unit}" if compact else f"{num / scale:.2f} {unit}iB"
    return f"{int(num)}B" if compact else f"{int(num)} B"


def format_gib(num: float, *, digits: int = 2) -> str:
    """Bytes as a number of GiB without the unit (`1.25`), for columns and lines that say GiB once."""
    return f"{num / GIB:.{digits}f}"


def format_count(num: float) -> str:
    """A count with a K/M/B/T suffix and three significant digits: `124M` parameters, `1.5B`, `3.2K` tokens/s."""
    num = float(f"{num:.3g}")  # rounded first, so that 999,999 reads 1M, not 1e+03K
    for unit, scale in _COUNT_STEPS:
        if abs(num) >= scale:
            return f"{num / scale:.3g}{unit}"
    return f"{num:.3g}"


def format_percent(fraction: float, *, digits: int = 1) -> str:
    """A fraction as a percentage: `0.123` -> `12.3%`."""
    return f"{fraction * 100.0:.{digits}f}%"


def format_ms(ms: float) -> str:
    """Milliseconds for table cells, about four significant digits: `0.123`, `12.3`, `1,234`."""
    if abs(ms) < 10:
        return f"{ms:.3f}"
    return f"{ms:.1f}" if abs(ms) < 100 else f"{ms:,.0f}"
