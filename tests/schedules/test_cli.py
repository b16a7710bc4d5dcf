"""`pipeplan simulate` through typer's CliRunner."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from pipeplan.cli import app

runner = CliRunner()


def test_simulate_table_and_gantt():
    result = runner.invoke(app, ["simulate", "--schedule", "zb-h1", "--stages", "4", "--microbatches", "8"])
    assert result.exit_code == 0, result.output
    assert "zb-h1" in result.output and "dev 3" in result.output


def test_simulate_json():
    args = [
        "simulate",
        "--schedule",
        "1f1b",
        "--stages",
        "2",
        "--microbatches",
        "3",
        "--f",
        "2",
        "--b",
        "1",
        "--w",
        "1",
        "--comm",
        "0.5",
        "--json",
    ]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    # by hand: dev1 B2 ends at 15.5, +0.5 hop, dev0 B2 [16, 18]
    assert data["makespan_ms"] == 18.0
    assert data["device_ops"][1][:2] == ["1F0", "1B0"]
    assert data["schedule"] == "1f1b"


def test_simulate_trace_file(tmp_path):
    path = tmp_path / "trace.json"
    args = ["simulate", "-s", "zbv", "--stages", "2", "--microbatches", "4", "--trace", str(path), "--json"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    assert any(e["ph"] == "X" for e in json.loads(path.read_text())["traceEvents"])


def test_compare_ranks_all():
    args = ["simulate", "--compare", "--stages", "4", "--microbatches", "8", "--json"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    spans = [row["makespan_ms"] for row in data["results"]]
    assert spans == sorted(spans)
    assert {row["schedule"] for row in data["results"]} | {row["schedule"] for row in data["skipped"]} >= {
        "gpipe",
        "1f1b",
        "zb-h1",
        "zb-h2",
        "zb-auto",
        "zbv",
        "dualpipev",
        "interleaved",
    }
    plain = runner.invoke(app, ["simulate", "--compare", "--stages", "4", "--microbatches", "8"])
    assert plain.exit_code == 0 and "ranked by makespan" in plain.output


def test_unknown_schedule_exits_1_with_one_line():
    result = runner.invoke(app, ["simulate", "--schedule", "nope", "--stages", "2", "--microbatches", "2"])
    assert result.exit_code == 1
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and "unknown --schedule 'nope'" in lines[0] and "zb-h1" in lines[0]


def test_unsupported_combination_exits_1():
    args = ["simulate", "--schedule", "dualpipev", "--stages", "4", "--microbatches", "4"]
    result = runner.invoke(app, args)
    assert result.exit_code == 1 and "--microbatches" in result.output


def test_no_schedule_ranks_every_one_and_a_trace_of_a_ranking_is_refused(tmp_path):
    ranked = runner.invoke(app, ["simulate", "--stages", "4", "--microbatches", "8", "--json"])
    compared = runner.invoke(app, ["simulate", "--compare", "--stages", "4", "--microbatches", "8", "--json"])
    assert ranked.exit_code == 0 and json.loads(ranked.output) == json.loads(compared.output)
    traced = runner.invoke(app, ["simulate", "-p", "4", "-m", "8", "--trace", str(tmp_path / "t.json")])
    assert traced.exit_code == 1 and "pass --schedule NAME" in traced.output
    assert not (tmp_path / "t.json").exists()


def test_compare_with_post_validate_ranks_by_the_period():
    args = ["simulate", "--compare", "-p", "4", "-m", "8", "--w", "0.5", "--post-validate", "--json"]
    rows = json.loads(runner.invoke(app, args).output)["results"]
    periods = [row["period_ms"] for row in rows]
    assert periods == sorted(periods) and any(row["period_ms"] < row["makespan_ms"] for row in rows)


def test_help_ends_with_example():
    result = runner.invoke(app, ["simulate", "--help"])
    assert result.exit_code == 0 and "Example: pipeplan simulate" in result.output


def _json(args):
    result = runner.invoke(app, ["simulate", *args, "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_simulate_unit_memory_options():
    base = ["-s", "zb-auto", "--stages", "4", "--microbatches", "8"]
    one_p = _json(base)
    two_p = _json([*base, "--memory-limit", "8"])
    assert one_p["peak_activations"] <= 4 and two_p["peak_activations"] <= 8
    assert two_p["max_span_ms"] == 24 and one_p["max_span_ms"] == 27  # the paper's ZB-2p / ZB-1p
    # I frees nothing: W frees all; a fixed schedule over the limit is one clear line
    assert (
        _json(["-s", "zb-h1", "--stages", "4", "--microbatches", "8", "--input-grad-frees", "0"])["peak_activations"]
        == 4
    )
    result = runner.invoke(app, ["simulate", "-s", "zb-h2", "-p", "4", "-m", "8", "--memory-limit", "4"])
    assert result.exit_code == 1 and "--memory-limit" in result.output


def test_simulate_generates_once(monkeypatch):
    import pipeplan.schedules.uniform as commands

    calls = []
    real = commands.generate
    monkeypatch.setattr(commands, "generate", lambda *a, **k: calls.append(a) or real(*a, **k))
    _json(["-s", "zb-auto", "--stages", "3", "--microbatches", "6"])
    assert len(calls) == 1


def test_simulate_dualpipev_overlap():
    base = ["-s", "dualpipev", "--stages", "2", "--microbatches", "4"]
    halves = _json(base)
    fused = _json([*base, "--overlap-ms", "1.0"])
    assert fused["makespan_ms"] < halves["makespan_ms"]
    result = runner.invoke(app, ["simulate", "-s", "1f1b", "-p", "2", "-m", "4", "--overlap-ms", "1"])
    assert result.exit_code == 1 and "--overlap-ms" in result.output
