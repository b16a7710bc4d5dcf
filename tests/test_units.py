"""pipeplan.units: the one place sizes and counts are parsed and numbers are formatted for people."""

from __future__ import annotations

import pytest

from pipeplan.errors import ConfigError
from pipeplan.units import (
    format_bytes,
    format_count,
    format_gib,
    format_ms,
    format_percent,
    parse_count,
    parse_size,
)


@pytest.mark.parametrize(
    ("text", "expected"),
    [("80GiB", 80 * 2**30), ("16GB", 16 * 10**9), ("512MiB", 512 * 2**20), ("1k", 1024), ("1.5e3", 1500), (7, 7)],
)
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["-4GiB", "80 parsecs", "0", "1e30TiB"])
def test_parse_size_refuses_with_the_option_name(text):
    with pytest.raises(ConfigError, match="--memory-per-device"):
        parse_size(text, option="--memory-per-device")


def test_parse_count():
    assert parse_count("1T") == 1e12 and parse_count("300B") == 3e11 and parse_count("2.5M") == 2.5e6
    with pytest.raises(ConfigError, match="--target-tokens"):
        parse_count("many", option="--target-tokens")


def test_format_bytes_full_and_compact():
    assert format_bytes(1.5 * 2**30) == "1.50 GiB"
    assert format_bytes(10 * 2**20) == "10.00 MiB"
    assert format_bytes(100) == "100 B"
    assert format_bytes(4096, compact=True) == "4.0K"
    assert format_bytes(3 * 2**40, compact=True) == "3.0T"
    assert format_bytes(512, compact=True) == "512B"


def test_format_gib():
    assert format_gib(3 * 2**29) == "1.50"
    assert format_gib(2**30, digits=1) == "1.0"


def test_format_count_rounds_before_choosing_the_suffix():
    assert format_count(124_439_808) == "124M"
    assert format_count(1.5e9) == "1.5B"
    assert format_count(999_999) == "1M"  # not 1e+03K
    assert format_count(12_000) == "12K"
    assert format_count(999) == "999" and format_count(0) == "0"


def test_format_percent():
    assert format_percent(0.1234) == "12.3%" and format_percent(0.5, digits=0) == "50%"


def test_format_ms():
    assert format_ms(0.1234) == "0.123"
    assert format_ms(12.34) == "12.3"
    assert format_ms(1234.5) == "1,234"
