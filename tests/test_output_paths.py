"""Outputs never replace what is not a regular file (issue 38, Deliver 1): a device node (/dev/null), a FIFO or a
socket given as an output is refused in one line before any work, by every writer, and the atomic writer itself
refuses to rename over one; a symbolic link is written through onto the file it names."""

from __future__ import annotations

import os
import socket
import stat
from pathlib import Path

import pytest
from helpers.search import synthetic_profile
from typer.testing import CliRunner

from pipeplan.artifact.manual import manual_plan
from pipeplan.cli import app
from pipeplan.errors import ConfigError, OutputError
from pipeplan.jsonio import atomic_write_text
from pipeplan.paths import check_output_dir, check_output_file, not_regular

DEV_NULL = "/dev/null"


@pytest.fixture
def fifo(tmp_path) -> Path:
    path = tmp_path / "pipe"
    os.mkfifo(path)
    return path


@pytest.fixture(scope="module")
def plans(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("outputs")
    profile = root / "profile.json"
    synthetic_profile(num_layers=4).save(profile)
    runnable = root / "runnable.json"
    tiny = dict(layers=2, hidden=16, heads=2, seq=8, vocab=32)
    manual_plan("gpt", tiny, schedule="1f1b", pipeline_devices=2, num_microbatches=2).save(runnable)
    return {"profile": profile, "runnable": runnable}


def _still_special(fifo: Path) -> None:
    assert stat.S_ISFIFO(os.stat(fifo).st_mode), "the FIFO was replaced"
    assert stat.S_ISCHR(os.stat(DEV_NULL).st_mode), "/dev/null was replaced"


def test_kinds(tmp_path, fifo):
    regular = tmp_path / "f.txt"
    regular.write_text("x")
    assert not_regular(regular) is None and not_regular(tmp_path / "missing") is None
    assert not_regular(fifo) == "a FIFO (named pipe)"
    assert not_regular(DEV_NULL) == "a character device"
    assert not_regular(tmp_path) == "a directory"
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(str(tmp_path / "sock"))
        assert not_regular(tmp_path / "sock") == "a socket"


@pytest.mark.parametrize("special", ["fifo", DEV_NULL])
def test_checks_refuse(special, fifo, tmp_path):
    path = fifo if special == "fifo" else Path(special)
    with pytest.raises(ConfigError, match="not a regular file"):
        check_output_file(path, "-o")
    os.symlink(path, tmp_path / "link")  # a link to a device is the device
    with pytest.raises(ConfigError, match="not a regular file"):
        check_output_file(tmp_path / "link", "-o")
    with pytest.raises(ConfigError, match="give a directory"):
        check_output_dir(path, "-o")
    _still_special(fifo)


def test_directory_files_checked(tmp_path):
    os.mkfifo(tmp_path / "timeline.json")
    with pytest.raises(ConfigError, match="timeline.json' is a FIFO"):
        check_output_dir(tmp_path, "--output", files=("plan.json", "timeline.json"))
    check_output_dir(tmp_path, "--output", files=("plan.json",))


def test_atomic_write_refuses_and_writes_through_links(tmp_path, fifo):
    with pytest.raises(OutputError, match="not a regular file"):
        atomic_write_text(fifo, "x")
    with pytest.raises(OutputError, match="not a regular file"):
        atomic_write_text(DEV_NULL, "x")
    _still_special(fifo)
    assert [p.name for p in tmp_path.iterdir()] == ["pipe"]  # no temporary file left behind
    real = tmp_path / "real.txt"
    real.write_text("old")
    os.symlink(real, tmp_path / "link.txt")
    atomic_write_text(tmp_path / "link.txt", "new")
    assert (tmp_path / "link.txt").is_symlink() and real.read_text() == "new"


def _commands(plans: dict[str, Path], out: str) -> list[list[str]]:
    plan_dir = plans["profile"].parent / "plan"
    if not plan_dir.exists():
        argv = ["plan", "--profile", str(plans["profile"]), "--devices", "2", "-o", str(plan_dir)]
        result = CliRunner().invoke(app, argv)
        assert result.exit_code == 0, result.output
    plan = str(plan_dir / "plan.json")
    run = ["run", str(plans["runnable"]), "--steps", "1"]
    return [
        ["export", plan, "-o", out],
        ["export", plan, "--format", "torch-csv", "-o", out],
        ["export", plan, "--format", "megatron", "-o", out],
        ["export", plan, "--format", "torchtitan", "-o", out],
        ["simulate", "-s", "1f1b", "-p", "2", "-m", "4", "--trace", out],
        ["profile", "mlp", "-a", "layers=2", "-a", "hidden=8", "--batch-size", "2", "-o", out],
        ["capacity", "gpt2-124m", "--hardware", "h100", "--devices", "8", "--plot", out],
        [*run, "--trace", out],
        [*run, "--log", out],
        ["export-weights", str(plans["runnable"].parent / "ckpt"), "-o", out],
        ["plan", "--profile", str(plans["profile"]), "--devices", "2", "-o", out],
    ]


@pytest.mark.parametrize("special", ["fifo", DEV_NULL])
def test_every_writer_refuses(special, fifo, plans):
    out = str(fifo) if special == "fifo" else special
    for argv in _commands(plans, out):
        result = CliRunner().invoke(app, argv)
        assert result.exit_code == 1, (argv, result.output)
        assert result.output.count("error:") == 1, (argv, result.output)
        assert "regular file" in result.output or "give a directory" in result.output, (argv, result.output)
        _still_special(fifo)


def test_plan_directory_with_a_fifo_inside(plans, tmp_path):
    os.mkfifo(tmp_path / "launch.sh")
    argv = ["plan", "--profile", str(plans["profile"]), "--devices", "2", "-o", str(tmp_path)]
    result = CliRunner().invoke(app, argv)
    assert result.exit_code == 1 and "launch.sh' is a FIFO" in result.output, result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["launch.sh"]  # nothing half-written
