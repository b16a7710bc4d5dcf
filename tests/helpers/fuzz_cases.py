"""The fuzz corpus: fixture files, one valid base command per CLI command, bad values per option, corrupted plan
files, and the seed cases reported in the reliability issue. A case is (argv, expect) where expect is "error"
(exit 1 or 2: nonsense must never succeed) or "any" (may succeed; must still be clean and bounded)."""

from __future__ import annotations

import copy
import json
import math
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from helpers.search import synthetic_profile
from pipeplan.artifact.manual import manual_plan
from pipeplan.hardware import hardware_presets

TINY_GPT = dict(layers=2, hidden=16, heads=2, seq=8, vocab=32)
DEV_NULL = "/dev/null"
USER_CODE = """\
import sys
import torch
from torch import nn
from pipeplan.models.spec import ModelSpec


class Fails(nn.Module):
    def __init__(self, mode):
        super().__init__()
        self.a, self.mode = nn.Linear(4, 4), mode

    def forward(self, x):
        if self.mode == "exit":
            sys.exit(0)
        raise RuntimeError("loss exploded")


def batch(b, generator=None):
    return (torch.randn(b, 4),), torch.randn(b, 4)


def raises():
    raise ValueError("no data today")


def exits():
    sys.exit(0)


def forward_raises():
    return ModelSpec(name="fails", build=lambda: Fails("raise"), sample_batch=batch, loss_fn=nn.functional.mse_loss)


def forward_exits():
    return ModelSpec(name="fails", build=lambda: Fails("exit"), sample_batch=batch, loss_fn=nn.functional.mse_loss)
"""


@dataclass(frozen=True)
class Case:
    argv: tuple[str, ...]
    expect: str = "error"  # or "any"

    def label(self) -> str:
        return " ".join(self.argv)[:160]


@dataclass(frozen=True)
class Files:
    root: Path
    profile: Path
    plan: Path  # from a profile alone (not runnable)
    runnable: Path  # a tiny gpt, 2 ranks
    a_dir: Path
    a_file: Path
    binary: Path
    empty: Path
    nan_hardware: Path
    inf_hardware: Path
    fifo: Path  # a named pipe: an output there must be refused, the pipe left as it is (also /dev/null)

    @property
    def bad_outputs(self) -> list[str]:
        return [str(self.a_dir), str(self.a_file / "x.json"), str(self.root / ("y" * 300)), "", *self.devices]

    @property
    def devices(self) -> list[str]:
        return [str(self.fifo), DEV_NULL]


def make_files(root: Path) -> Files:
    from typer.testing import CliRunner

    from pipeplan.cli import app

    profile = root / "profile.json"
    synthetic_profile(num_layers=4).save(profile)
    plan_dir = root / "plan"
    result = CliRunner().invoke(app, ["plan", "--profile", str(profile), "--devices", "2", "-o", str(plan_dir)])
    assert result.exit_code == 0, result.output
    runnable = root / "runnable.json"
    manual_plan("gpt", TINY_GPT, schedule="1f1b", pipeline_devices=2, num_microbatches=2).save(runnable)
    (root / "a_dir").mkdir()
    (root / "a_file").write_text("not a directory\n")
    (root / "binary.bin").write_bytes(bytes(range(256)) * 8)
    (root / "empty.json").write_text("")
    (root / "exits.py").write_text("import sys\nsys.exit(0)\n")
    (root / "raises.py").write_text("def build():\n    raise RuntimeError('boom')\n")
    (root / "user_code.py").write_text(USER_CODE)
    os.mkfifo(root / "fifo")
    base = hardware_presets()["h100"].to_file_entry()
    for name, field, value in (
        ("nan_hw.json", "hbm_tb_per_s", math.nan),
        ("inf_hw.json", "peak_bf16_tflops", math.inf),
    ):
        entry = {**base, field: value, "description": "fuzz"}
        (root / name).write_text(json.dumps({"schema_version": 1, "hardware": {name.split("_")[0] + "chip": entry}}))
    return Files(
        root=root,
        profile=profile,
        plan=plan_dir / "plan.json",
        runnable=runnable,
        a_dir=root / "a_dir",
        a_file=root / "a_file",
        binary=root / "binary.bin",
        empty=root / "empty.json",
        nan_hardware=root / "nan_hw.json",
        inf_hardware=root / "inf_hw.json",
        fifo=root / "fifo",
    )


BAD_COUNT = ["0", "-1", "-7", "abc", "", "1.5", "1000000000"]
BAD_TIME = ["-1", "nan", "inf", "-inf", "1e400", "abc", ""]
BAD_RATE = ["0", "-1", "nan", "inf", "1e400", "abc"]


USER_FACTORIES = ("raises", "exits", "forward_raises", "forward_exits")  # user code errors: one line, never exit 0
EXPORT_FORMATS = ((), ("--format", "torch-csv"), ("--format", "megatron"), ("--format", "torchtitan"))


def option_cases(f: Files) -> list[Case]:
    """Each command's valid base with one option given a bad value."""
    simulate = ("simulate", "-s", "1f1b", "-p", "2", "-m", "4")
    profile = ("profile", "mlp", "-a", "layers=2", "-a", "hidden=8", "--batch-size", "2", "-o", str(f.root / "p.json"))
    plan = ("plan", "--profile", str(f.profile), "--devices", "2", "-o", str(f.root / "out"))
    run = ("run", str(f.runnable), "--steps", "1")
    capacity = ("capacity", "gpt2-124m", "--hardware", "h100", "--devices", "8")
    table: list[tuple[tuple[str, ...], str, list[str]]] = [
        (simulate, "-p", BAD_COUNT[:-1] + ["100000"]),
        (simulate, "-m", BAD_COUNT),
        (simulate, "--f", BAD_TIME),
        (simulate, "--b", BAD_TIME),
        (simulate, "--w", BAD_TIME),
        (simulate, "--comm", BAD_TIME),
        (simulate, "--memory-limit", ["0", "-1", "abc"]),
        (simulate, "--schedule", ["nosuch", ""]),
        (simulate, "--trace", f.bad_outputs),
        (profile, "--batch-size", BAD_COUNT),
        (profile, "-a", ["hidden=0", "hidden=-1", "hidden=10000000", "layers=1000000", "layers=0", "nosuch=1", "x"]),
        (profile, "--device", ["tpu", "meta", ""]),
        (profile, "--hardware", ["nosuch"]),
        (profile, "--granularity", ["0", "-1", "abc"]),
        (profile, "-o", f.bad_outputs),
        (plan, "--devices", BAD_COUNT[:-1] + ["100000", "8,,", "2x0", "0x8", "2xabc", "3x2x1"]),
        (plan, "--memory", ["0", "-1", "1e400", "abc", "10XB", "nan", "reserve=-1", "zero=2", "recompute=x", "k=v"]),
        (plan, "--global-batch-size", BAD_COUNT),
        (plan, "-b", ["0", "-1", "1,,", "abc"]),
        (plan, "--parallel", ["pp=0", "pp=3", "pp=abc", "pp=-2", "tp=2/4", "tp=0", "x=1", "replicate=maybe", "pp="]),
        (plan, "--precision", ["nosuch", "fp16-mixed", "bf16,nosuch", "sgd,adamw", "fp32,bf16", ""]),
        (plan, "--schedule", ["nosuch", "zbx", "auto,nosuch"]),
        (plan, "--overlap", ["", ",", "nosuch"]),
        (plan, "--attention", ["", "nosuch"]),
        (plan, "--layout", ["pp=2,pp=1", "pp=2,schedule=pipedream-2bw,zero=1", "", "pp=abc"]),
        (plan, "--profile", [str(f.binary), str(f.empty), str(f.a_dir), str(f.root / "missing.json")]),
        (plan, "-o", [str(f.a_file), str(f.a_file / "sub"), str(f.root / ("z" * 300)), ""]),
        (run, "--steps", ["0", "-1", "abc"]),
        (run, "--lr", BAD_RATE),
        (run, "--weight-decay", ["-1", "nan", "inf", "abc"]),
        (run, "--heartbeat-timeout", ["0", "-1", "nan", "inf", "abc", "1e-9"]),
        (run, "--threads", ["0", "-1", "abc"]),
        (run, "--device", ["tpu", ""]),
        (run, "--precision", ["nosuch", "bf16", ""]),
        (run, "--optimizer", ["", "nosuch", "sgd"]),
        (run, "--log", [str(f.a_dir), *f.devices, ""]),
        (run, "--checkpoint-every", ["-1", "abc"]),
        (run, "--trace", f.bad_outputs),
        (run, "--checkpoint-dir", [str(f.a_file), str(f.a_file / "sub"), ""]),
        (capacity, "-B", ["0", "-1", "abc"]),
        (capacity, "--target-tokens", ["0", "-1", "1e400", "abc", "nan"]),
        (capacity, "--days", ["0", "-1", "nan", "inf", "abc"]),
        (capacity, "--devices", ["8,,", "0", "-8", "abc", "100000000"]),
        (capacity, "--hardware", ["nosuch"]),
        (capacity, "--plot", f.bad_outputs),
        (capacity, "--overlap", ["", "nosuch"]),
    ]
    cases = [Case((*base, option, value)) for base, option, values in table for value in values]
    cases += [
        Case((*capacity[:2], "--hardware", f"{path}:{chip}", *capacity[4:]))
        for path, chip in ((f.nan_hardware, "nanchip"), (f.inf_hardware, "infchip"), (f.binary, "h100"))
    ]
    cases += [
        Case(("simulate", "-s", "1f1b", "-p", "2", "-m", "4", "--f", "0", "--b", "0", "--w", "0")),
        Case(("simulate", "-s", "1f1b", "-p", "2", "-m", "4", "--f", "1e308", "--b", "1e308")),
        Case(("simulate", "--compare", "-p", "0", "-m", "0")),
        Case(("simulate", "--compare", "-p", "4", "-m", "100000000")),
        Case(("simulate", "-s", "1f1b", "-p", "4", "-m", "1000000000")),
        Case(("plan", "--profile", str(f.profile), "--devices", "100000", "--parallel", "pp=2")),
        Case(("plan", "--profile", str(f.profile), "--memory", "1e400")),
        Case(("export", str(f.plan), "--format", "nosuch", "-o", str(f.root / "s.csv"))),
        Case(("export", str(f.plan), "-o", str(f.a_dir))),
        Case(("profile", "nosuch_model")),
        Case(("profile", str(f.a_file) + ":build")),
        Case(("profile", str(f.root / "exits.py") + ":build")),
        Case(("profile", str(f.root / "raises.py") + ":build")),
        Case(("plan", "--profile", str(f.binary), "--devices", "2")),
        *(Case(("profile", f"{f.root / 'user_code.py'}:{name}")) for name in USER_FACTORIES),
        Case(("profile", "hf:gpt2", "-a", "n_layer=-1")),
        Case(("profile", "hf:gpt2", "-a", "seq_len=abc")),
        Case(("plan", "--profile", str(f.profile), "--parallel", "cp=3")),
        *(Case(("export", str(f.plan), *fmt, "-o", device)) for fmt in EXPORT_FORMATS for device in f.devices),
        Case(("capacity", "gpt2-124m", "--hardware", "h100", "--devices", "8", "-B", "0")),
    ]
    return cases


def _set(data: dict, path: tuple, value) -> dict:
    mutated = copy.deepcopy(data)
    node = mutated
    for key in path[:-1]:
        node = node[key]
    if value is _DELETE:
        del node[path[-1]]
    else:
        node[path[-1]] = value
    return mutated


_DELETE = object()

# (path in plan.json, new value or _DELETE, whether show/export must fail)
PLAN_MUTATIONS: list[tuple[tuple, object, bool]] = [
    (("stages", 0, "node_names"), _DELETE, True),
    (("stages", 0, "layer_names"), _DELETE, True),
    (("ranks", 0, "stages"), _DELETE, True),
    (("chunks",), "abc", True),
    (("rank_ops", 0, 0), 5, True),
    (("rank_ops", 0), "0F0", True),
    (("schedule",), "nosuch", True),
    (("predicted", "step_ms"), -5.0, True),
    (("model", "tokens_per_sample"), -5, True),
    (("training", "num_microbatches"), "x", True),
    (("stages",), [], True),
    (("ranks",), "x", True),
    (("cluster", "memory_per_device"), "lots", True),
    (("schema_version",), 99, True),
    (("schedule",), "dualpipev", True),  # edited schedule / chunks fields: the op lists are not theirs
    (("schedule",), "gpipe", True),
    (("chunks",), 2, True),
    (("model", "fingerprint"), _DELETE, False),
    (("rationale",), 7, False),
]


def corrupted_plans(f: Files) -> list[Case]:
    """show / export / run on plan files with one field deleted or mistyped, and on op lists that cannot run."""
    cases = []
    for label, base in (("plan", f.plan), ("runnable", f.runnable)):
        data = json.loads(base.read_text())
        mutations = [(_set(data, path, value), must_fail) for path, value, must_fail in PLAN_MUTATIONS]
        ops = data["rank_ops"]
        mutations += [
            (_set(data, ("rank_ops", 0), list(reversed(ops[0]))), True),  # B before F / deadlock
            (_set(data, ("rank_ops", 1), ops[1][:-1]), True),  # an op dropped
        ]
        for i, (mutated, must_fail) in enumerate(mutations):
            path = f.root / f"bad_{label}_{i}.json"
            path.write_text(json.dumps(mutated))
            expect = "error" if must_fail else "any"
            cases.append(Case(("show", str(path)), expect))
            cases.append(Case(("export", str(path), "-o", str(f.root / f"bad_{label}_{i}.csv")), expect))
            if label == "runnable":  # must be refused before any rank starts
                cases.append(Case(("run", str(path), "--steps", "1"), "error"))
    dropped = json.loads(f.runnable.read_text())  # a stage that lost one of its FX nodes: only tracing shows it
    dropped["stages"][1]["node_names"] = dropped["stages"][1]["node_names"][1:]
    (f.root / "dropped_node.json").write_text(json.dumps(dropped))
    cases.append(Case(("run", str(f.root / "dropped_node.json"), "--steps", "1"), "error"))
    return cases


def _edit_stage(folder: Path, stage: int, edit) -> None:
    import torch

    path = folder / "step_00000002" / f"stage_{stage:03d}.pt"
    state = torch.load(path, weights_only=True)
    edit(state)
    torch.save(state, path)


def _first_param(state: dict) -> str:
    return sorted(state["params"])[0]


# a checkpoint of steps 1 and 2 (2 stages), each damaged one way; `run --resume` must refuse every one
CHECKPOINT_TAMPERS = {
    "another step's stage file": lambda d: shutil.copy(d / "step_00000001/stage_001.pt", d / "step_00000002"),
    "step field": lambda d: _edit_stage(d, 0, lambda s: s.update(step=7)),
    "stage field": lambda d: _edit_stage(d, 1, lambda s: s.update(stage=0)),
    "removed parameter": lambda d: _edit_stage(d, 0, lambda s: s["params"].pop(_first_param(s))),
    "extra parameter": lambda d: _edit_stage(d, 0, lambda s: s["params"].update(extra=s["params"][_first_param(s)])),
    "emptied Adam state": lambda d: _edit_stage(d, 1, lambda s: s.update(optimizer={n: {} for n in s["optimizer"]})),
    "half Adam state": lambda d: _edit_stage(d, 1, lambda s: s["optimizer"][_first_param(s)].pop("exp_avg")),
    "parameter dtype": lambda d: _edit_stage(
        d, 0, lambda s: s["params"].update({_first_param(s): s["params"][_first_param(s)].double()})
    ),  # noqa: E501
    "partition": lambda d: _edit_stage(d, 1, lambda s: s.update(partition="0000")),
    "fingerprint": lambda d: _edit_stage(d, 1, lambda s: s.update(fingerprint="0000")),
    "truncated file": lambda d: (d / "step_00000002/stage_000.pt").write_bytes(b"PK\x03\x04"),
    "stage file missing": lambda d: (d / "step_00000002/stage_001.pt").unlink(),
    "latest names a missing step": lambda d: (d / "latest").write_text("step_00000009\n"),
    "latest garbage": lambda d: (d / "latest").write_text("nonsense\n"),
    "empty directory": lambda d: [shutil.rmtree(d), d.mkdir()],
}


def tampered_checkpoints(f: Files, written: Path) -> list[Case]:
    """`run --resume` from copies of `written` (a checkpoint of f.runnable) damaged as CHECKPOINT_TAMPERS says."""
    cases = []
    for index, (label, tamper) in enumerate(CHECKPOINT_TAMPERS.items()):
        copy_dir = f.root / f"tampered_{index}_{''.join(c if c.isalnum() else '_' for c in label)}"
        shutil.rmtree(copy_dir, ignore_errors=True)
        shutil.copytree(written, copy_dir)
        tamper(copy_dir)
        cases.append(Case(("run", str(f.runnable), "--steps", "3", "--checkpoint-dir", str(copy_dir), "--resume")))
    return cases
