"""Planning the asynchronous schedules: considered only when named or with `-s all` / `-s auto,async`, predicted
from the stream's steady state (no flush) with stashed weight copies in memory, staleness in the summary, plan
files that `show` reproduces and `run` checks, and refusals for what they cannot run with."""

from __future__ import annotations

import json

import pytest
from helpers.search import make_cluster, plan_step_ms, synthetic_profile
from typer.testing import CliRunner

from pipeplan.artifact.manual import manual_plan
from pipeplan.artifact.plan import ModelRef, Plan
from pipeplan.artifact.summary import summary_dict
from pipeplan.artifact.timing import plan_timeline
from pipeplan.cli import app
from pipeplan.costs import numerics
from pipeplan.errors import ConfigError, FormatError, ScheduleError
from pipeplan.schedules.simulate import stream_step_ms
from pipeplan.search.candidate import Layout
from pipeplan.search.config import SearchConfig
from pipeplan.search.emit import build_plan
from pipeplan.search.evaluate import evaluate
from pipeplan.search.search import search_plans

runner = CliRunner()
TINY_MLP = {"layers": "4", "hidden": "16"}


def _evaluate(schedule: str, p: int = 4, m: int = 8):
    layout = Layout(schedule=schedule, microbatch_size=1, data_parallel=1, pipeline_devices=p, num_microbatches=m)
    profile = synthetic_profile(num_layers=8, cut_bytes=0)
    config = SearchConfig(global_batch_size=m, numerics=numerics(16.0, "bf16-mixed"), post_validate="off")
    return evaluate(layout, profile, make_cluster(p, memory=2**34), config, memory_limit=2**34)


def test_prediction_is_the_steady_state_and_memory_counts_stashed_copies():
    """Balanced synthetic stages (2 layers of F 1 ms, B 2 ms each, 1M params): a stream step is m x (F + B) of a
    stage, a flushed 1F1B step (m + p - 1) x that; 2BW holds one more weight copy per device, pipedream p - 1 - d."""
    sync, two, dream = _evaluate("1f1b"), _evaluate("pipedream-2bw"), _evaluate("pipedream")
    assert two.partition.stages == sync.partition.stages == dream.partition.stages
    stage = 2 * (1.0 + 2.0)
    assert sync.step_ms == pytest.approx((8 + 3) * stage)
    assert two.step_ms == pytest.approx(8 * stage) == dream.step_ms
    assert two.step_ms == pytest.approx(stream_step_ms(two.timeline, 8))
    assert two.timeline.bubble_rate == pytest.approx(0.0)  # the steady state's idle share
    copy = 2 * 1_000_000 * 4  # a stage's 2M parameters in the profile's precision's (fp32) parameter dtype
    assert [b - a for a, b in zip(sync.device_memory_bytes, two.device_memory_bytes)] == [copy] * 4
    assert [b - a for a, b in zip(sync.device_memory_bytes, dream.device_memory_bytes)] == [
        (4 - 1 - d) * copy for d in range(4)
    ]


def test_search_considers_async_schedules_only_when_allowed():
    profile, cluster = synthetic_profile(num_layers=8), make_cluster(4, memory=2**34)
    plain = search_plans(profile, cluster, SearchConfig(global_batch_size=16, numerics=numerics("adamw", "bf16-mixed")))
    assert not {e.layout.schedule for e in plain.ranked} & {"pipedream", "pipedream-2bw"}
    allowed = search_plans(
        profile, cluster, SearchConfig(global_batch_size=16, allow_async=True, numerics=numerics("adamw", "bf16-mixed"))
    )
    assert {"pipedream", "pipedream-2bw"} <= {e.layout.schedule for e in allowed.ranked}
    with pytest.raises(ConfigError, match="allow it"):
        search_plans(
            profile,
            cluster,
            SearchConfig(global_batch_size=16, numerics=numerics("adamw", "bf16-mixed")),
            ["pipedream"],
        )
    with pytest.raises(ConfigError, match="--memory zero=0"):
        search_plans(
            profile,
            cluster,
            SearchConfig(global_batch_size=16, zero=1, allow_async=True, numerics=numerics("adamw", "bf16-mixed")),
            ["pipedream"],
        )


def test_plan_file_states_staleness_and_reproduces_the_prediction(tmp_path):
    profile, cluster = synthetic_profile(num_layers=8), make_cluster(4, memory=2**34)
    result = search_plans(
        profile,
        cluster,
        SearchConfig(global_batch_size=16, allow_async=True, numerics=numerics("adamw", "bf16-mixed")),
        ["pipedream-2bw"],
    )
    plan = build_plan(result, model=ModelRef(ref="synthetic"))
    plan.save(tmp_path / "plan.json")
    loaded = Plan.load(tmp_path / "plan.json")
    assert loaded == plan and loaded.num_op_microbatches > plan.training.num_microbatches  # the simulated stream
    timeline = plan_timeline(loaded)
    assert timeline.entries == result.best.timeline.entries
    assert plan_step_ms(loaded) == pytest.approx(plan.predicted.step_ms, rel=1e-12)
    assert max(timeline.peak_memory_bytes) == max(plan.predicted.peak_memory_bytes)
    stale = summary_dict(loaded)["staleness"]
    assert stale == "pipedream-2bw: weights 1 step stale; 2 weight versions per stage"
    assert (
        summary_dict(manual_plan("mlp", TINY_MLP, schedule="1f1b", pipeline_devices=2, num_microbatches=2))["staleness"]
        is None
    )
    shown = runner.invoke(app, ["show", str(tmp_path / "plan.json")])
    assert shown.exit_code == 0 and "Staleness: pipedream-2bw: weights 1 step stale" in " ".join(shown.output.split())


def test_cli_plans_a_named_async_schedule_refuses_it_with_zero1_and_exports_none(tmp_path):
    path = tmp_path / "profile.json"
    synthetic_profile().save(path)
    base = ["plan", "--profile", str(path), "--devices", "4", "-o", str(tmp_path / "p")]
    refused = runner.invoke(app, [*base, "--memory", "1GiB,zero=1", "--schedule", "pipedream"])
    assert refused.exit_code == 1 and "--memory zero=0" in refused.output
    assert len(refused.output.strip().splitlines()) == 1
    base += ["--memory", "1GiB"]
    done = runner.invoke(app, [*base, "--schedule", "pipedream", "--json"])
    assert done.exit_code == 0, done.output
    summary = json.loads(done.output)
    assert summary["schedule"] == "pipedream" and "4 weight versions on the first stage" in summary["staleness"]
    exported = runner.invoke(app, ["export", str(tmp_path / "p" / "plan.json"), "-o", str(tmp_path / "x.csv")])
    assert exported.exit_code == 1 and "no asynchronous schedules" in exported.output


def test_capacity_shows_async_schedules_when_allowed():
    args = ["capacity", "gpt2-124m", "--hardware", "h100", "--devices", "8", "-B", "64", "--json"]
    shown = runner.invoke(app, [*args, "--schedule", "pipedream-2bw"])
    assert shown.exit_code == 0, shown.output
    assert json.loads(shown.output)["rows"][0]["schedule"] == "pipedream-2bw"
    refused = runner.invoke(app, [*args, "--schedule", "pipedream-2bw", "--memory", "zero=1"])
    assert refused.exit_code == 1 and "--memory zero=0" in refused.output
    auto = runner.invoke(app, args)  # auto: the synchronous schedules
    assert json.loads(auto.output)["rows"][0]["schedule"] not in ("pipedream", "pipedream-2bw")


def test_plans_refuse_what_async_schedules_cannot_run_with():
    layout = dict(schedule="pipedream", pipeline_devices=2, num_microbatches=2)
    with pytest.raises(ScheduleError, match="without replicas"):
        manual_plan("mlp", TINY_MLP, replicas=(2, 1), **layout)
    with pytest.raises(FormatError, match="ZeRO-1"):
        manual_plan("mlp", TINY_MLP, zero=1, **layout)
    with pytest.raises(FormatError, match="fp16-mixed"):
        manual_plan("mlp", TINY_MLP, precision="fp16-mixed", **layout)
    from pipeplan.runtime.train.asynchronous import check_async_run
    from pipeplan.runtime.train.config import RunConfig
    from pipeplan.runtime.train.post_validate import check_post_validate

    plan = manual_plan("mlp", TINY_MLP, **layout)
    with pytest.raises(ConfigError, match="drop --clip-grad-norm"):
        check_async_run(plan, RunConfig(clip_grad_norm=1.0))
    with pytest.raises(ConfigError, match="drop --post-validate"):
        check_post_validate(plan, True)


def test_run_refuses_op_lists_that_are_not_the_generators_stream():
    from pipeplan.runtime.train.asynchronous import check_stream

    plan = manual_plan("mlp", TINY_MLP, schedule="pipedream-2bw", pipeline_devices=2, num_microbatches=2)
    check_stream(plan)
    rows = [list(ops) for ops in plan.rank_ops]
    rows[0][0], rows[0][1] = rows[0][1], rows[0][0]  # still complete, another order
    with pytest.raises(FormatError, match="not schedule pipedream-2bw's"):  # refused when the plan loads
        Plan.from_dict({**plan.to_dict(), "rank_ops": rows})
