"""The CLI's answer to bad input, as the tests check it."""

from __future__ import annotations


def one_error_line(result) -> str:
    """A CliRunner result that exits 1 with exactly one line, `error: ...` (no traceback): that line."""
    assert result.exit_code == 1, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), result.output
    return lines[0]
