"""The CLI starts without torch where it needs none: `pipeplan --help` (and every command's --help), `simulate`,
`show`, `export`, and `plan --profile FILE` given the device memory (--memory SIZE or --hardware; otherwise
torch asks CUDA). Each runs in a fresh interpreter, which then says whether torch was imported. Timings are in
benchmarks/bench_cli.py, not here."""

from __future__ import annotations

import subprocess
import sys

import pytest

import pipeplan

RUN_CLI = (
    "import sys\nfrom pipeplan.cli import main\nsys.argv = ['pipeplan', *sys.argv[1:]]\n"
    "try:\n    main()\nexcept SystemExit as exc:\n    code = exc.code\nelse:\n    code = 0\n"
    "print('EXIT', code, 'TORCH', 'torch' in sys.modules)"
)


def cli(*argv: str, cwd) -> tuple[int, bool, str]:
    """(exit code, whether torch was imported, output) of `pipeplan ARGV` in a fresh interpreter."""
    done = subprocess.run([sys.executable, "-c", RUN_CLI, *argv], capture_output=True, text=True, cwd=cwd)
    last = done.stdout.strip().splitlines()[-1].split()
    return int(last[1]), last[3] == "True", done.stdout + done.stderr


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("startup")
    profile = pipeplan.profile("mlp", assignments={"layers": 2, "hidden": 8}, batch_size=2, repeats=1, warmup=1)
    profile.save(folder / "p.json")
    options = dict(devices=2, global_batch_size=4, memory="4GiB", parallel="pp=2,replicate=off")
    pipeplan.plan("mlp", assignments={"layers": 2, "hidden": 8}, profile=profile, output=folder / "plan", **options)
    return folder


TORCH_FREE = [
    ("--help",),
    ("--version",),
    *((name, "--help") for name in ("profile", "simulate", "plan", "show", "export", "run", "capacity", "models")),
    ("simulate", "-s", "1f1b", "-p", "4", "-m", "8"),
    ("simulate", "--compare", "-p", "4", "-m", "8", "--json"),
    ("show", "plan/plan.json"),
    ("export", "plan/plan.json", "-f", "megatron", "-o", "m.args"),
    ("export", "plan/plan.json", "-f", "torch-csv", "-o", "s.csv"),
    ("plan", "--profile", "p.json", "-n", "2", "-B", "4", "--memory", "4GiB", "-o", "p2", "--json"),
    ("plan", "--profile", "p.json", "-n", "8", "-B", "16", "--hardware", "h100", "-o", "p3", "--json"),
    (
        "capacity",
        "llama-7b",
        "--hardware",
        "h100",
        "-n",
        "8",
        "--memory",
        "zero=9",
    ),  # refused before the model is traced
]


@pytest.mark.parametrize("argv", TORCH_FREE, ids=" ".join)
def test_commands_that_need_no_torch_do_not_import_it(argv, files):
    code, torch_imported, output = cli(*argv, cwd=files)
    assert code == (1 if "zero=9" in argv else 0), output
    assert not torch_imported, output
