"""Every predicted figure of a corpus of `plan`, `show`, `capacity` and `simulate` commands (those of the tests and
the docs, meta-device production shapes included), written as one JSON file: run it before and after a refactor
and diff the two files — a refactor that changes no behaviour changes no figure.

Recorded per command: its exit code and output (`--json` where the command has it, else its text), and for each
plan directory written: plan.json (versions left out), timeline.json, `show --json` and `show`'s text, and the
step `run` would print as predicted with --post-validate and with --no-post-validate.

Measured profiles are timed on this machine, so they are made once into INPUTS (kept between runs: delete the folder
to measure again); every plan reads them, so the figures depend only on the code.

Run: .venv/bin/python benchmarks/prediction_corpus.py OUT.json [--only NAME,...] [--against BEFORE.json]
(--against: print every path whose value differs from BEFORE.json's, and how many.)

The commands are written in the CLI of before issue 33 (per-degree flags, --memory-per-device, --optimizer...); on a
checkout of that CLI (no pipeplan/artifact/ room) they run as written, else `translate` says them in today's words.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import shlex
import sys
import tempfile
import time
from pathlib import Path

os.environ["COLUMNS"] = "200"  # rich's width: the same tables every run

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from arguments import parse_args  # noqa: E402


def _options(parser) -> None:
    parser.add_argument("output", help="the corpus file to write (JSON)")
    parser.add_argument("--only", default="", help="comma-separated names")
    parser.add_argument("--against", default=None, help="a corpus file of before, to diff with")


if __name__ == "__main__":  # first of all: --help answers before torch or pipeplan is imported
    ARGS = parse_args(__doc__, _options)

import torch  # noqa: E402
from typer.testing import CliRunner  # noqa: E402

from pipeplan.cli import app  # noqa: E402

LEGACY_CLI = importlib.util.find_spec("pipeplan.artifact") is None  # the CLI of before issue 33: run as written

INPUTS = Path(os.environ.get("PIPEPLAN_CORPUS_INPUTS", "/tmp/pipeplan-corpus-inputs"))
PROFILES = {  # measured once (CPU timings), then read by every run
    "gpt.json": "profile gpt -b 2",
    "gpt-small.json": "profile gpt -a layers=4 -a hidden=256",
    "gpt-bf16.json": "profile gpt --precision bf16-mixed",
    "mlp.json": "profile mlp -a layers=6 -a hidden=64 -b 2",
}
ANALYTIC = {  # analytic profiles (deterministic), also kept with the inputs
    "gpt2.json": "profile gpt2-124m --device meta --hardware h100",
    "llama.json": "profile llama-7b --device meta --hardware h100 --precision bf16-main",
}
PD = "tests/data/pipedream-profiles"

# name -> command (after `pipeplan`); {in} is INPUTS. Plans write to a directory named after the command.
PLANS = {
    "readme-plan": "plan gpt --profile {in}/gpt.json -n 2 -B 8",
    "plan-depth2": "plan gpt --profile {in}/gpt.json --devices 2 --pipeline-depth 2 --no-replication -B 8",
    "plan-n4": "plan --profile {in}/gpt.json -n 4 -B 16",
    "plan-async": "plan gpt --profile {in}/gpt.json --devices 4 -B 32 --allow-async",
    "plan-2bw": "plan gpt --profile {in}/gpt.json --devices 2 -B 4 --schedule pipedream-2bw --allow-async",
    "plan-pipedream": "plan --profile {in}/gpt.json -n 4 -B 8 -s pipedream --allow-async",
    "plan-z1": (
        "plan gpt -a layers=4 -a hidden=256 --profile {in}/gpt-small.json --devices 4 --pipeline-depth 2 --zero 1"
    ),
    "plan-mem": (
        "plan gpt -a layers=4 -a hidden=256 --profile {in}/gpt-small.json --devices 2 --memory-per-device 64MiB"
    ),
    "plan-norc": "plan gpt -a layers=4 -a hidden=256 --profile {in}/gpt-small.json --devices 2 --recompute none",
    "plan-pv-on": "plan --profile {in}/gpt.json -n 4 -B 16 -s zb-h2 --post-validate on",
    "plan-pv-off": "plan --profile {in}/gpt.json -n 4 -B 16 -s zbv --post-validate off",
    "plan-zbauto": "plan --profile {in}/gpt.json -n 4 -B 16 -s zb-auto --memory-per-device 1GiB",
    "plan-dualpipev": "plan --profile {in}/gpt.json -n 4 -B 16 -s dualpipev",
    "plan-interleaved": "plan --profile {in}/gpt.json -n 4 -B 16 -s interleaved -p 2",
    "plan-sgd": "plan --profile {in}/gpt.json -n 2 -B 8 --optimizer sgd",
    "plan-reserve": "plan --profile {in}/gpt.json -n 4 -B 8 --memory-per-device 4GiB --memory-reserve 1GiB",
    "plan-mlp-repl": "plan --profile {in}/mlp.json -n 4 -B 16 --memory-per-device 100MiB",
    "plan-mlp-b": "plan --profile {in}/mlp.json -n 4 -B 16 -b 2,4 --overlap p2p",
    "plan-bf16": "plan gpt --profile {in}/gpt-bf16.json --devices 2 -B 8",
    "plan-vgg": f"plan --profile {PD}/vgg16.txt --profile-format pipedream --devices 8 -B 64 --memory-per-device 8GiB",
    "plan-gnmt": f"plan --profile {PD}/gnmt.txt --profile-format pipedream --devices 4 -B 32 --memory-per-device 8GiB",
    "plan-gpt2-file": "plan --profile {in}/gpt2.json --hardware h100 --devices 16 --devices-per-node 8 -B 64",
    "plan-gpt2-meta": "plan gpt2-124m --device meta --hardware h100 --devices 16 -B 64",
    "plan-llama-tp2": "plan llama-7b --device meta --hardware h100 --devices 16 -B 64 --tensor-parallel 2",
    "plan-llama-file": "plan --profile {in}/llama.json --hardware h100 --devices 64 -B 1024 --memory-reserve 6GiB",
    "plan-h100": "plan gpt --device meta --hardware h100 --devices 2 -B 8 --tensor-parallel 1",
    "plan-moe-ep": "plan moe --device meta --hardware h100 --devices 4 -B 8 -s 1f1b --expert-parallel 2",
    "plan-moe-z1": "plan moe --device meta --hardware h100 --devices 4 -B 8 --zero 1",
    "plan-llama-overlap": (
        "plan llama -a layers=2 --device meta --hardware h100 --devices 4 -B 8 --overlap all --post-validate on"
    ),
    "plan-layout": (
        'plan llama -a layers=4 --device meta --hardware h100 --devices 8 -B 16 --layout "tp=2,pp=2,vp=2,dp=2"'
    ),
    "plan-layout-file": (
        'plan --profile {in}/gpt2.json --hardware h100 --devices 8 -B 32 --layout "tp=2,pp=4,dp=1,mbs=1,recompute=full"'
    ),
    "plan-cp": "plan --profile {in}/llama.json --hardware h100 --devices 16 -B 32 --context-parallel 2 -t 4",
    "plan-infeasible": "plan --profile {in}/gpt.json -n 2 -B 8 --memory-per-device 1MiB",
    "plan-attn-math": "plan gpt --device meta --hardware h100 --devices 2 -B 8 --attention math",
    "plan-llama-math": "plan llama -a layers=2 --device meta --hardware h100 --devices 4 -B 8 --attention math",
}
CAPACITY = {
    "cap-readme": "capacity llama-7b --hardware h100 -n 8,64",
    "cap-target": "capacity llama-7b --hardware h100 --devices 8,64 --target-tokens 1T --days 30",
    "cap-async": "capacity gpt2-1.5b --hardware h100 --devices 8,64 --allow-async",
    "cap-70b": "capacity llama-70b --hardware h100 --devices 64 -B 1024 --zero 1 --recompute none",
    "cap-70b-layout": 'capacity llama-70b --hardware h100 -B 128 --seq 8192 --layout "tp=4,cp=2,pp=4,vp=5,dp=2"',
    "cap-7b-layout": (
        'capacity llama-7b --hardware h100 -B 64 --seq 8192 --overlap all --layout "tp=2,cp=2,pp=2,vp=2,dp=2"'
    ),
    "cap-moe": "capacity moe -a experts=8 -a layers=3 --hardware h100 --devices 8 -B 64 -t 1 --schedule 1f1b",
    "cap-gpt2": "capacity gpt2-124m --hardware h100 --devices 8,64",
    "cap-gpt2-schedules": "capacity gpt2-124m --hardware h100 --devices 8 -B 64 --schedule all --replication",
    "cap-cp": "capacity llama-7b --hardware h100 --devices 16 -B 32 --seq 16384 --context-parallel auto -t 8",
    "cap-fp8": "capacity llama-13b --hardware h100 --devices 64 --precision fp8 --overlap all",
    "cap-mixed": "capacity gpt2-1.5b --hardware a100-80gb --devices 16 --precision bf16-mixed -b 1,2",
    "cap-deepseek": (
        "capacity deepseek-v3 --hardware h800 --precision fp8 -t 1 -B 15360 "
        '--layout "pp=16,dp=128,ep=64,zero=1,recompute=full"'
    ),
    "cap-mixtral": "capacity mixtral-8x7b --hardware h100 --devices 64 -B 256",
    "cap-attn-math": "capacity llama-7b --hardware h100 -n 8 --attention math",
    "cap-preset": "capacity llama-3-8b --hardware h100 -n 8,64",
}
SIMULATE = {
    "sim-zb-auto": "simulate -s zb-auto -p 32 -m 96 --f 10.419 --b 10.207 --w 7.715 --comm 0.408 --memory-limit 64 "
    "--post-validate",
    "sim-zbv": "simulate -s zbv -p 16 -m 48 --f 28.814 --b 28.760 --w 19.352 --comm 1.610 --post-validate",
    "sim-compare": "simulate -p 4 -m 8 --w 0.5 --post-validate",
    "sim-2bw": "simulate --schedule pipedream-2bw --stages 4 --microbatches 8",
    "sim-dualpipev": "simulate -s dualpipev -p 4 -m 8 --overlap-ms 2.5",
}


SYNCHRONOUS = "gpipe,1f1b,interleaved,zb-h1,zb-h2,zb-auto,zbv,dualpipev,dualpipe"  # every synchronous schedule


def translate(argv: list[str]) -> list[str]:
    """The corpus's command lines (the CLI of before issue 33) in the current CLI's words, meaning the same: the
    parallelism degrees into --parallel, memory options into --memory, the optimizer into --precision, a hardware file
    into --hardware, --allow-async into --schedule; `plan --device meta` without --precision keeps bf16-mixed (analytic
    plans now default to bf16-main, as capacity does)."""
    if LEGACY_CLI or not argv or argv[0] not in ("plan", "capacity"):
        return argv
    rest, words = list(argv[1:]), {}
    parallel, memory, kept = [], [], [argv[0]]
    keys = {"--tensor-parallel": "tp", "-t": "tp", "--context-parallel": "cp", "--expert-parallel": "ep"}
    keys |= {"--pipeline-depth": "pp", "-p": "pp", "--interleave": "vp"}
    while rest:
        flag = rest.pop(0)
        if flag in keys:
            parallel.append(f"{keys[flag]}={rest.pop(0).replace(',', '/')}")
        elif flag in ("--no-replication", "--replication"):
            parallel.append("replicate=" + ("off" if flag == "--no-replication" else "on"))
        elif flag in ("--memory-per-device", "--memory-reserve", "--zero", "--recompute"):
            value = rest.pop(0)
            memory.append(value if flag == "--memory-per-device" else f"{flag[2:].split('-')[-1]}={value}")
        elif flag in (
            "--optimizer",
            "--hardware-file",
            "--hardware",
            "--precision",
            "--schedule",
            "-s",
            "--devices-per-node",
        ):
            words[flag] = rest.pop(0)
        elif flag == "--allow-async":
            words[flag] = "yes"
        elif flag == "--profile-format":
            rest.pop(0)
        else:
            kept.append(flag)
    if parallel:
        kept += ["--parallel", ",".join(parallel)]
    if memory:
        kept += ["--memory", ",".join(memory)]
    precision = words.get("--precision")
    if precision is None and argv[0] == "plan" and "meta" in argv:
        precision = "bf16-mixed"  # the default of before
    if precision is None and argv[0] == "capacity":
        precision = "bf16-main"
    if precision or "--optimizer" in words:
        kept += ["--precision", ",".join(w for w in (precision, words.get("--optimizer")) if w)]
    if "--hardware" in words:
        file = words.get("--hardware-file")
        kept += ["--hardware", f"{file}:{words['--hardware']}" if file else words["--hardware"]]
    schedule = words.get("--schedule", words.get("-s", "auto"))
    if argv[0] == "capacity" and schedule == "all":
        schedule = SYNCHRONOUS  # capacity's old `all`: every schedule, the asynchronous ones only when allowed
    if "--allow-async" in words and schedule in ("auto", SYNCHRONOUS):
        schedule += ",async"
    kept += ["--schedule", schedule]
    if "--devices-per-node" in words:
        if argv[0] == "capacity":
            kept += ["--devices-per-node", words["--devices-per-node"]]
        else:
            at = kept.index("--devices") + 1
            per_node = int(words["--devices-per-node"])
            kept[at] = f"{int(kept[at]) // per_node}x{per_node}"
    return kept


def _invoke(argv: list[str]) -> tuple[int, str]:
    """The exit code and standard output (a warning on standard error, e.g. a profile's, is not the output)."""
    result = CliRunner().invoke(app, translate(argv))
    return result.exit_code, result.stdout if result.exit_code == 0 else result.output


def make_inputs() -> None:
    INPUTS.mkdir(parents=True, exist_ok=True)
    for name, command in {**PROFILES, **ANALYTIC}.items():
        if not (INPUTS / name).exists():
            code, output = _invoke([*shlex.split(command), "-o", str(INPUTS / name)])
            assert code == 0, f"{command}: {output}"


def _clean(data, workspace: str):
    """`data` without what differs between runs for reasons other than the code's figures."""
    if isinstance(data, dict):
        drop = ("pipeplan_version", "torch_version", "plan_dir")
        return {k: _clean(v, workspace) for k, v in data.items() if k not in drop}
    if isinstance(data, list):
        return [_clean(v, workspace) for v in data]
    if isinstance(data, str):
        return data.replace(workspace, "WS").replace(str(INPUTS), "IN")
    return data


def _output(code: int, output: str, workspace: str, as_json: bool):
    if as_json and code == 0:
        return _clean(json.loads(output), workspace)
    return _clean(output, workspace)


def _predicted_run_ms(plan_path: Path) -> dict[str, float]:
    """What `run` prints as the predicted step with --post-validate and --no-post-validate."""
    Plan = importlib.import_module(f"pipeplan.{'plan' if LEGACY_CLI else 'artifact'}.plan").Plan  # the room of each CLI
    try:
        from pipeplan.runtime.train.loop import predicted_ms
    except ImportError:  # before runtime/ was split into subpackages
        from pipeplan.runtime.train import predicted_ms  # type: ignore[no-redef]
    plan = Plan.load(plan_path)
    return {str(flag): predicted_ms(plan, flag) for flag in (True, False)}


def record_plan(name: str, command: str, workspace: Path) -> dict:
    out = workspace / name
    argv = [*shlex.split(command.format(**{"in": INPUTS})), "-o", str(out)]
    code, output = _invoke([*argv, "--json"])
    found = {"command": command, "exit": code, "json": _output(code, output, str(workspace), True)}
    if code != 0:
        return found
    found["plan"] = _clean(json.loads((out / "plan.json").read_text()), str(workspace))
    found["timeline"] = json.loads((out / "timeline.json").read_text())
    code, output = _invoke(["show", str(out / "plan.json"), "--json"])
    found["show_json"] = _output(code, output, str(workspace), True)
    code, output = _invoke(["show", str(out / "plan.json")])
    found["show_text"] = _output(code, output, str(workspace), False)
    found["run_predicted_ms"] = _predicted_run_ms(out / "plan.json")
    return found


def record_json(command: str, workspace: Path) -> dict:
    code, output = _invoke([*shlex.split(command), "--json"])
    return {"command": command, "exit": code, "json": _output(code, output, str(workspace), True)}


def main() -> None:
    args = ARGS
    only = {n for n in args.only.split(",") if n}
    output = Path(args.output).resolve()
    torch.set_num_threads(1)
    make_inputs()
    results: dict[str, dict] = {}
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="pipeplan-corpus-") as folder:
        workspace = Path(folder)
        (workspace / "tests").symlink_to(ROOT / "tests")
        os.chdir(workspace)
        for group, record in ((PLANS, record_plan), (CAPACITY, None), (SIMULATE, None)):
            for name, command in group.items():
                if only and name not in only:
                    continue
                began = time.perf_counter()
                results[name] = record(name, command, workspace) if record else record_json(command, workspace)
                print(f"{name}: exit {results[name]['exit']} in {time.perf_counter() - began:.1f} s", flush=True)
    output.write_text(json.dumps(results, indent=1, sort_keys=True) + "\n")
    print(f"{len(results)} commands in {time.perf_counter() - start:.0f} s -> {output}")
    if args.against is not None:
        before = json.loads(Path(args.against).read_text())
        found = [path for name in results for path in _differences(before.get(name), results[name], name)]
        print("\n".join(found) + f"\n{len(found)} value(s) differ from {args.against}")


def _differences(before, after, path: str) -> list[str]:
    """The paths (name/key/index...) where `after` differs from `before`."""
    if isinstance(before, dict) and isinstance(after, dict):
        keys = sorted(set(before) | set(after))
        return [p for k in keys for p in _differences(before.get(k), after.get(k), f"{path}/{k}")]
    if isinstance(before, list) and isinstance(after, list) and len(before) == len(after):
        return [p for i, (x, y) in enumerate(zip(before, after)) for p in _differences(x, y, f"{path}[{i}]")]
    return [] if before == after else [path]


if __name__ == "__main__":
    main()
