"""Where the torchtitan versions the export tests check against are installed (`make setup`, Makefile TT_*): 0.2 in
the virtual environment, 0.3 in `<venv>/torchtitan-0.3`, and what both import beyond pipeplan's environment in
`<venv>/torchtitan-deps`; and the subprocess that runs torchtitan_check.py (or torchtitan_split.py) with one
of them on the path."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

VENV = Path(sys.prefix)
DEPS = VENV / "torchtitan-deps"
PATHS = {"0.2": (DEPS,), "0.3": (VENV / "torchtitan-0.3", DEPS)}  # searched before the venv's site-packages
CHECK = Path(__file__).with_name("torchtitan_check.py")
SPLIT = Path(__file__).with_name("torchtitan_split.py")  # torchtitan's stage builder on the exported FQNs


def require(version: str) -> tuple[Path, ...]:
    """The folders to put on the path for `version`; skips (naming `make setup`) where they are not installed."""
    if version == "0.3" and sys.version_info < (3, 11):
        pytest.skip("torchtitan 0.3 needs Python >= 3.11")
    missing = [str(path) for path in PATHS[version] if not path.is_dir()]
    if missing:
        pytest.skip(f"torchtitan {version} test environment not installed ({', '.join(missing)}): run make setup")
    return PATHS[version]


def environment(version: str) -> dict[str, str]:
    """The environment of a process importing torchtitan `version`: its folders first on PYTHONPATH, CUDA hidden
    (torchtitan picks cuda whenever it is visible; these checks run on the CPU)."""
    paths = [str(path) for path in require(version)]
    existing = os.environ.get("PYTHONPATH")
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(paths + ([existing] if existing else [])),
        "CUDA_VISIBLE_DEVICES": "",
    }


def run_check(version: str, cases: dict[str, dict], script: Path = CHECK) -> dict[str, dict]:
    """`script` (torchtitan_check.py, torchtitan_split.py) under torchtitan `version`: {label: what torchtitan read}
    for each case."""
    result = subprocess.run(
        [sys.executable, str(script), version, json.dumps(cases)],
        env=environment(version),
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    read = json.loads(result.stdout.strip().splitlines()[-1])
    installed = str(PATHS[version][0]) if version == "0.3" else str(VENV)
    assert read.pop("torchtitan").startswith(installed), f"torchtitan {version} not the one imported"
    return read
