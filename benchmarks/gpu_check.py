"""The Python half of benchmarks/gpu_check.sh: what the machine has (`setup`), several pipeplan commands in one
interpreter (`cli`), and the figures each step's files hold, gathered into $OUT/gpu_check.json and a short
$OUT/summary.txt (`summary`). Reads the files the CLI wrote
(profiles, plans, run logs, traces, the calibrate file, the benchmark's JSON, pytest's JUnit XML) as plain JSON
and XML, so a failed step leaves a gap, not a traceback. Runs with whatever Python the script found."""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import platform
import re
import statistics
import sys
import tarfile
import xml.etree.ElementTree as ElementTree
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {  # import name -> distribution name; the first five are needed, the rest skip what needs them
    "torch": "torch",
    "typer": "typer",
    "rich": "rich",
    "scipy": "scipy",
    "numpy": "numpy",
    "pytest": "pytest",
    "pytest_timeout": "pytest-timeout",
    "hypothesis": "hypothesis",
    "transformers": "transformers",
    "safetensors": "safetensors",
    "megatron.core": "megatron-core",
    "tyro": "tyro",
    "torchtitan": "torchtitan",
    "xdist": "pytest-xdist",
}
REQUIRED = ("torch", "typer", "rich", "scipy", "numpy")
MODELS = ("gpt", "llama")
GIB = 2**30


def _version(module: str) -> str | None:
    try:
        if importlib.util.find_spec(module) is None:
            return None
    except (ImportError, ValueError):
        return None
    try:
        return importlib.metadata.version(PACKAGES[module])
    except importlib.metadata.PackageNotFoundError:
        return "present"


def setup(work: Path) -> int:
    """What this machine has: Python, torch and CUDA, the GPUs, the packages, where pipeplan is imported from, and
    the hardware preset the analytic profiles compare against ($WORK/setup.json); exit 1 if a needed one is missing."""
    info: dict = {"python": sys.version.split()[0], "executable": sys.executable, "platform": platform.platform()}
    info["packages"] = {module: _version(module) for module in PACKAGES}
    missing = [module for module in REQUIRED if info["packages"][module] is None]
    info["missing_required"] = missing
    info["preset"] = "h100"
    if "torch" not in missing:
        import torch

        info.update(torch=torch.__version__, cuda_build=torch.version.cuda, cuda=torch.cuda.is_available())
        info["gpus"] = [_gpu(index) for index in range(torch.cuda.device_count())] if info["cuda"] else []
    try:
        import pipeplan
        from pipeplan.calibrate.hardware_file import nearest_preset

        info["pipeplan"] = str(Path(pipeplan.__file__).resolve().parent)
        if info.get("gpus"):
            gpu = info["gpus"][0]
            preset, matched = nearest_preset(gpu["name"], gpu["memory_bytes"])
            info["preset"] = preset.name if matched else "h100"
    except Exception as exc:  # noqa: BLE001 - reported, the step fails
        info["pipeplan_error"] = f"{type(exc).__name__}: {exc}"
        missing.append("pipeplan")
    (work / "setup.json").write_text(json.dumps(info, indent=1))
    print(json.dumps({k: info.get(k) for k in ("python", "torch", "cuda", "gpus", "preset", "missing_required")}))
    return 1 if missing else 0


def _gpu(index: int) -> dict:
    import torch

    props = torch.cuda.get_device_properties(index)
    return dict(name=props.name, memory_bytes=props.total_memory, sm_count=props.multi_processor_count)


def _load(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _layers(profile: dict) -> list[dict]:
    rows = []
    for la in profile["layers"]:
        times = {k: la[f"{k}_ms"] for k in ("forward", "input_grad", "weight_grad", "backward")}
        row = dict(name=la["name"], **{f"{k}_ms": round(v, 4) for k, v in times.items()})
        row.update(activation_bytes=la["activation_bytes"], peak_memory_bytes=la.get("peak_memory_bytes", 0))
        rows.append(row)
    return rows


def profile_figures(profile: dict) -> dict:
    """Per-layer F/I/W/B and memory of a measured profile, and its layer sums over the whole model's run."""
    layers = profile["layers"]
    f = sum(la["forward_ms"] for la in layers)
    iw = sum(la["input_grad_ms"] + la["weight_grad_ms"] for la in layers)
    b = sum(la["backward_ms"] for la in layers)
    whole_f, whole_b = profile.get("whole_forward_ms") or 0.0, profile.get("whole_backward_ms") or 0.0
    return dict(
        device=profile["provenance"]["device"],
        precision=profile["provenance"].get("precision"),
        batch_size=profile["provenance"]["batch_size"],
        layers=_layers(profile),
        sum_forward_ms=f,
        sum_split_backward_ms=iw,
        sum_backward_ms=b,
        whole_forward_ms=whole_f,
        whole_backward_ms=whole_b,
        forward_sum_over_whole=f / whole_f if whole_f else None,
        split_backward_sum_over_whole=iw / whole_b if whole_b else None,
        backward_sum_over_whole=b / whole_b if whole_b else None,
        peak_memory_bytes=max((la.get("peak_memory_bytes", 0) for la in layers), default=0),
        activation_bytes=sum(la["activation_bytes"] for la in layers),
    )


def _idle_between_ops(trace: dict) -> dict | None:
    """Per step of rank 0: ops, their summed time and the gaps between the first op's start and the last's end."""
    try:
        steps = trace["pipeplan_measured"]["ranks"][0]["steps"]
    except (KeyError, IndexError, TypeError):
        return None
    rows = []
    for step in steps[1:] or steps:  # the first step warms up
        ops = step["ops"]
        busy = sum(end - start for _, start, end in ops)
        span = ops[-1][2] - ops[0][1] if ops else 0.0
        rows.append((len(ops), busy, span - busy))
    if not rows:
        return None
    ops = rows[0][0]
    idle = statistics.median(r[2] for r in rows)
    return dict(
        ops_per_step=ops, busy_ms=statistics.median(r[1] for r in rows), idle_ms=idle, idle_per_op_ms=idle / ops
    )


def run_figures(work: Path, key: str) -> dict:
    """A 1-device plan and its run: predicted and measured step and peak memory, and the gaps between ops."""
    plan = _load(work / f"plan-{key}" / "plan.json")
    if plan is None:
        return {}
    found: dict = dict(
        predicted_step_ms=plan["predicted"]["step_ms"],
        predicted_peak_bytes=plan["predicted"]["peak_memory_bytes"][0],
        schedule=plan["schedule"],
        microbatches=plan["training"]["num_microbatches"],
        microbatch_size=plan["training"]["microbatch_size"],
    )
    lines = [json.loads(line) for line in _text(work / f"log-{key}.jsonl").splitlines() if line.startswith("{")]
    if len(lines) > 1:
        found["measured_step_ms"] = statistics.median(line["step_ms"] for line in lines[1:])
        found["steps"] = len(lines)
    output = _text(work / "logs" / f"run-{key}.log")
    if match := re.search(r"measured/predicted ([0-9.]+)", output):
        found["measured_over_predicted"] = float(match.group(1))
    if match := re.search(r"rank 0: peak memory ([0-9.]+) GiB.*?predicted ([0-9.]+) GiB", output):
        found["measured_peak_gib"], found["predicted_peak_gib"] = float(match.group(1)), float(match.group(2))
        found["peak_measured_over_predicted"] = float(match.group(1)) / float(match.group(2))
    if (trace := _load(work / f"trace-{key}.json")) is not None:
        found["between_ops"] = _idle_between_ops(trace)
    return found


def _text(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


def _sum_fb(profile: dict) -> float:
    return sum(la["forward_ms"] + la["backward_ms"] for la in profile["layers"])


def analytic_figures(work: Path, key: str) -> dict:
    """The measured bf16-mixed profile against the analytic one (datasheet preset) and the calibrated one: F+B
    summed over layers, per layer, and the saved activation bytes."""
    measured = _load(work / f"{key}-measured.json")
    found: dict = {}
    for name, suffix in (("preset", "analytic"), ("calibrated", "analytic-calibrated")):
        analytic = _load(work / f"{key}-{suffix}.json")
        if analytic is None or measured is None:
            continue
        row: dict = dict(hardware=analytic["provenance"].get("hardware"), analytic_fb_ms=_sum_fb(analytic))
        row["measured_over_analytic_fb"] = _sum_fb(measured) / row["analytic_fb_ms"]
        whole = (measured.get("whole_forward_ms") or 0.0) + (measured.get("whole_backward_ms") or 0.0)
        row["measured_whole_over_analytic_fb"] = whole / row["analytic_fb_ms"] if whole else None
        pairs = zip(measured["layers"], analytic["layers"], strict=False)
        row["per_layer_fb"] = {m["name"]: _ratio(m["forward_ms"] + m["backward_ms"], _fb(a)) for m, a in pairs}
        acts = [(m["activation_bytes"], a["activation_bytes"]) for m, a in zip(measured["layers"], analytic["layers"])]
        row["measured_over_analytic_activation_bytes"] = _ratio(sum(m for m, _ in acts), sum(a for _, a in acts))
        row["cut_bytes_equal"] = measured.get("cut_bytes") == analytic.get("cut_bytes")
        found[name] = row
    if measured is not None:
        found["measured_fb_ms"] = _sum_fb(measured)
    return found


def _fb(layer: dict) -> float:
    return layer["forward_ms"] + layer["backward_ms"]


def _ratio(a: float, b: float) -> float | None:
    return round(a / b, 4) if b else None


def _junit(path: Path) -> dict:
    found: dict = {}
    try:
        suite = ElementTree.parse(path).getroot()
        suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
        for field in ("tests", "failures", "errors", "skipped"):
            found[field] = int(suite.get(field, 0))
        found["passed"] = found["tests"] - found["failures"] - found["errors"] - found["skipped"]
    except (OSError, ElementTree.ParseError, AttributeError, ValueError):
        pass
    return found


def _failed(log: str) -> list[str]:
    return re.findall(r"^(?:FAILED|ERROR) (\S+)", log, re.MULTILINE)[:40]


def pytest_figures(work: Path, name: str) -> dict:
    """Counts (JUnit XML), the failed tests and pytest's last line; for tests-suite the serial rerun's too."""
    found = _junit(work / f"{name}.xml")
    log, _, rerun = _text(work / "logs" / f"{name}.log").partition("--- rerun:")
    found["failed_tests"] = _failed(log)
    lines = re.findall(r"^=*\s*(\d+ (?:passed|failed|skipped|errors?|deselected)\b.* in [0-9.]+s.*?)\s*=*$", log, re.M)
    if lines:  # pytest's last line, e.g. "9 skipped, 52 deselected in 1.65s"
        found["pytest_line"] = lines[-1]
    if rerun:
        found["rerun"] = {**_junit(work / f"{name}-rerun.xml"), "failed_tests": _failed(rerun)}
    return found


def calibrate_figures(work: Path) -> dict:
    """The calibrate file's entry: its scalar fields, and what it says this machine achieves (a GPU's fitted
    efficiencies times the datasheet peaks; a CPU's measurements)."""
    hardware = _load(work / "hw.json") or {}
    entry = (hardware.get("hardware") or {}).get("calibrated") or {}
    found = {k: v for k, v in entry.items() if isinstance(v, int | float | str) and k != "sources"}
    if entry:
        peak, memory = entry.get("peak_bf16_tflops", 0.0), entry.get("hbm_tb_per_s", 0.0)
        found["achieved_bf16_tflops"] = entry.get("measured_bf16_tflops") or peak * entry.get("matmul_efficiency", 1)
        found["achieved_tb_per_s"] = entry.get("measured_hbm_tb_per_s") or memory * entry.get("memory_efficiency", 1)
    return found


def split_figures(work: Path) -> dict:
    found = _load(work / "split_backward.json") or {}
    return {k: found[k] for k in ("device", "device_name", "precision", "timer", "results") if k in found}


def step_figures(work: Path, name: str) -> dict:
    """The figures of one step, read from the files it wrote."""
    if name == "setup":
        return _load(work / "setup.json") or {}
    kind, _, key = name.partition("-")
    if kind == "profile":
        profile = _load(work / f"{key}-measured.json")
        return profile_figures(profile) if profile is not None else {}
    if kind == "run":
        return run_figures(work, key)
    if name == "calibrate":
        return calibrate_figures(work)
    if name == "analytic":
        return {key: analytic_figures(work, key) for key in MODELS}
    if name == "split-backward":
        return split_figures(work)
    if kind == "tests":
        return pytest_figures(work, name)
    return {}


def _f(value, spec: str = ".2f") -> str:
    return "-" if value is None else format(value, spec)


def headline(name: str, figures: dict) -> str:
    """One line of a step's main figures (the summary's table)."""
    kind = name.partition("-")[0]
    if name == "setup" and figures:
        gpus = ", ".join(g["name"] for g in figures.get("gpus", [])) or "no CUDA"
        missing = [m for m, v in figures.get("packages", {}).items() if v is None]
        return f"python {figures.get('python')}, torch {figures.get('torch')}, {gpus}; missing: {missing or 'none'}"
    if kind == "profile" and figures:
        blocks = [row for row in figures["layers"] if row["name"].startswith(("blocks.", "model.layers."))]
        block = blocks[0] if blocks else figures["layers"][0]
        return (
            f"layer sums / whole F {_f(figures['forward_sum_over_whole'])} I+W "
            f"{_f(figures['split_backward_sum_over_whole'])} B {_f(figures['backward_sum_over_whole'])}; "
            f"{block['name']} F/I/W/B {block['forward_ms']:.3f}/{block['input_grad_ms']:.3f}/"
            f"{block['weight_grad_ms']:.3f}/{block['backward_ms']:.3f} ms; "
            f"peak {figures['peak_memory_bytes'] / GIB:.2f} GiB"
        )
    if kind == "run" and figures:
        gaps = figures.get("between_ops") or {}
        return (
            f"step {_f(figures.get('measured_step_ms'), '.1f')} ms / predicted {figures['predicted_step_ms']:.1f} = "
            f"{_f(figures.get('measured_over_predicted'))}; peak {_f(figures.get('measured_peak_gib'))} / "
            f"{figures['predicted_peak_bytes'] / GIB:.2f} GiB; idle between ops {_f(gaps.get('idle_per_op_ms'), '.3f')}"
            " ms/op"
        )
    if name == "calibrate" and figures:
        return (
            f"bf16 matmul {_f(figures.get('achieved_bf16_tflops'), '.4g')} TFLOP/s (efficiency "
            f"{_f(figures.get('matmul_efficiency'), '.3f')}), memory {_f(figures.get('achieved_tb_per_s'), '.4g')} "
            f"TB/s, launch {_f(figures.get('kernel_launch_us'), '.3g')} us"
        )
    if name == "analytic":
        parts = []
        for key, found in figures.items():
            for which in ("preset", "calibrated"):
                if which in found:
                    row = found[which]
                    parts.append(
                        f"{key} {row['hardware']}: F+B measured/analytic {_f(row['measured_over_analytic_fb'])},"
                        f" saved bytes {_f(row['measured_over_analytic_activation_bytes'])}"
                    )
        return "; ".join(parts)
    if name == "split-backward" and figures.get("results"):
        rows = figures["results"]
        ratios = ", ".join(f"{r['width']}: {r['iw_over_b']:.2f} (host {_host_share(r):.2f})" for r in rows)
        cached = ", ".join(f"{r['I_host_cached_over_uncached']:.2f}" for r in rows)
        return f"(I+W)/B {ratios}; I host time cached/plain {cached}"
    if kind == "tests" and figures:
        counts = figures.get("pytest_line") or _counts(figures)
        failed = figures.get("failed_tests") or []
        text = counts + (f"; failed: {', '.join(failed[:5])}" + (" ..." if len(failed) > 5 else "") if failed else "")
        if "rerun" in figures:
            text += f"; again in one process: {len(figures['rerun']['failed_tests'])} of them failed"
        return text
    return ""


def _host_share(row: dict) -> float:
    """Host time issuing I and W over their device time (about 1 or more: the GPU waits for the host)."""
    return (row["I_host_ms_cached"] + row["W_host_ms_cached"]) / (row["I_ms_cached"] + row["W_ms_cached"])


def _counts(figures: dict) -> str:
    return ", ".join(f"{k} {figures[k]}" for k in ("passed", "failures", "errors", "skipped") if k in figures)


def _statuses(work: Path) -> list[dict]:
    rows = []
    for line in _text(work / "status.tsv").splitlines():
        name, status, rc, seconds, note = (line.split("\t") + [""] * 5)[:5]
        rows.append(dict(name=name, status=status, rc=int(rc) if rc else None, seconds=int(seconds or 0), note=note))
    return rows


def summary(work: Path, out: Path, mode: str, wall_s: int, budget_s: int) -> int:
    """$OUT/gpu_check.json (every step's status and figures), $OUT/summary.txt, $OUT/logs.txt (each step's log,
    its last 300 lines) and $OUT/artifacts.tar.gz (the profiles, plans, traces and other files the steps wrote)."""
    steps = _statuses(work)
    for step in steps:
        step["figures"] = step_figures(work, step["name"]) if step["status"] != "skipped" else {}
    setup_info = _load(work / "setup.json") or {}
    gpus = setup_info.get("gpus") or []
    report = dict(
        schema_version=1,
        mode=mode,
        device=gpus[0]["name"] if gpus else "cpu (no CUDA)",
        torch=setup_info.get("torch"),
        wall_s=wall_s,
        budget_s=budget_s,
        steps=steps,
    )
    (out / "gpu_check.json").write_text(json.dumps(report, indent=1))
    ran = sum(step["status"] != "skipped" for step in steps)
    lines = [
        f"pipeplan GPU check: {report['device']}, torch {report['torch']}, mode {mode}, "
        f"{wall_s} s of a {budget_s} s budget; {ran} of {len(steps)} steps ran",
        f"{'step':<15} {'status':<10} {'s':>4}  figures",
    ]
    for step in steps:
        text = step["note"] if step["status"] == "skipped" else headline(step["name"], step["figures"])
        status = step["status"] + (f" {step['rc']}" if step["status"] == "failed" else "")
        lines.append(f"{step['name']:<15} {status:<10} {step['seconds']:>4}  {text}")
    (out / "summary.txt").write_text("\n".join(lines) + "\n")
    logs = []
    for step in steps:
        tail = _text(work / "logs" / f"{step['name']}.log").splitlines()[-300:]
        logs.append(f"===== {step['name']} ({step['status']}, rc {step['rc']}) =====\n" + "\n".join(tail))
    (out / "logs.txt").write_text("\n\n".join(logs) + "\n")
    with tarfile.open(out / "artifacts.tar.gz", "w:gz") as archive:
        for path in sorted(work.rglob("*")):
            if path.is_file() and path.suffix in (".json", ".jsonl", ".xml", ".txt", ".log", ".tsv", ".sh"):
                archive.add(path, arcname=str(path.relative_to(work)))
    print("\n".join(lines))
    return 0


def cli(argv: list[str]) -> int:
    """`cli [--keep-going] ARGS [:: ARGS ...]`: pipeplan commands one after another in this interpreter, each
    through the CLI's own entry point with its arguments (`pipeplan.cli.main`, as `pipeplan ARGS`), so the
    interpreter start and the imports (torch, transformers) are paid once. Stops at the first that fails, unless
    --keep-going; the exit status is the first failure's."""
    from pipeplan.cli import main as pipeplan_main

    keep_going = argv[:1] == ["--keep-going"]
    segments: list[list[str]] = [[]]
    for arg in argv[1:] if keep_going else argv:
        segments.append([]) if arg == "::" else segments[-1].append(arg)
    status = 0
    for segment in segments:
        print(f"$ pipeplan {' '.join(segment)}", flush=True)
        sys.argv = ["pipeplan", *segment]
        try:
            pipeplan_main()
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else int(exc.code is not None)
        status = status or code
        if code and not keep_going:
            break
    return status


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["cli"]:
        return cli(argv[1:])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=("setup", "summary", "cli"))
    parser.add_argument("--work", required=True, type=Path)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--mode", default="cuda")
    parser.add_argument("--wall", type=int, default=0)
    parser.add_argument("--budget", type=int, default=0)
    args = parser.parse_args(argv)
    if args.command == "setup":
        return setup(args.work)
    return summary(args.work, args.out, args.mode, args.wall, args.budget)


if __name__ == "__main__":
    sys.exit(main())
