"""`profile --concurrent N` (issue 37): a CPU profile measured beside N - 1 sibling processes running the model, as
N ranks share the machine in a run: layers timed in CPU time, scaled by the wall / CPU ratio measured beside the
siblings, an AdamW update rate measured there too; all recorded in the provenance and the summary. Checked: the
bookkeeping (what is scaled, what is recorded, what is refused), not timings."""

from __future__ import annotations

import json
import os
import queue

import pytest

import pipeplan
from pipeplan.cluster import cpu_core_blocks
from pipeplan.costs.optimizer import numerics, static_split
from pipeplan.costs.overlap import optimizer_bytes_per_param, update_bytes_per_param
from pipeplan.errors import ConfigError
from pipeplan.profiling import profile_job
from pipeplan.profiling.siblings import (
    ADAMW_FP32_BYTES,
    SiblingModel,
    _reported_step_walls,
    sibling_load,
    slowest_share,
    under_concurrency,
)

TINY = {"layers": 2, "hidden": 8}


def _affinity() -> set[int] | None:
    return set(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None


def test_adamw_bytes_are_the_cost_models():
    fp32_adamw = numerics("adamw", "fp32")
    assert (
        ADAMW_FP32_BYTES
        == update_bytes_per_param(fp32_adamw)
        == optimizer_bytes_per_param(static_split(fp32_adamw), True)
    )


def test_every_time_is_scaled_and_the_conditions_recorded():
    profile = pipeplan.profile("mlp", assignments=TINY, repeats=3, threads=1)
    scaled = under_concurrency(profile, 2, 1.5, 2e9)
    for before, after in zip(profile.layers, scaled.layers, strict=True):
        for name in ("forward_ms", "input_grad_ms", "weight_grad_ms", "backward_ms", "selective_recompute_ms"):
            assert getattr(after, name) == pytest.approx(getattr(before, name) * 1.5)
        full = before.forward_ms if before.full_recompute_ms is None else before.full_recompute_ms
        assert (after.full_recompute_ms or after.forward_ms) == pytest.approx(full * 1.5)
        assert (after.param_count, after.activation_bytes) == (before.param_count, before.activation_bytes)
    assert scaled.whole_forward_ms == pytest.approx(profile.whole_forward_ms * 1.5)
    prov = scaled.provenance
    assert (prov.concurrent, prov.wall_over_cpu, prov.update_bytes_per_s) == (2, 1.5, pytest.approx(2e9 / 1.5))
    assert pipeplan.Profile.from_dict(json.loads(json.dumps(scaled.to_dict()))).provenance == prov
    assert "concurrent" not in profile.to_dict()["provenance"]  # alone: the file is as before


def test_the_slowest_process_time_for_the_work_scales_the_profile():
    """A synchronized run goes at its slowest rank's pace: the slowest process's wall-clock per training step (this
    one's or a sibling's) over this process's CPU time per step; below one where this process's threads ran in
    parallel (its CPU time is theirs summed), so that its layers' CPU times come back to wall-clock."""
    assert slowest_share((0.012, 0.010), [0.016, 0.011]) == pytest.approx(1.6)  # a sibling shared a core
    assert slowest_share((0.020, 0.010), [0.016]) == pytest.approx(2.0)  # this process did
    assert slowest_share((0.005, 0.020), [0.006]) == pytest.approx(0.3)  # 4 threads: 20 ms of CPU in 5 ms
    assert slowest_share((0.010, 0.0), [0.02]) == 1.0  # no CPU time measured: nothing to scale by
    reported: queue.Queue = queue.Queue()
    for wall_steps in ((3.0, 200), (1.0, 0), (4.0, 100)):  # a sibling that stepped nothing reports no time
        reported.put(wall_steps)
    assert _reported_step_walls(reported, 3) == [0.015, 0.04]


@pytest.mark.parametrize("flags", [{"concurrent": 0}, {"concurrent": 2, "device": "meta", "hardware": "h100"}])
def test_concurrent_refused_or_ignored_in_one_line(flags, console_warnings):
    if flags["concurrent"] == 0:
        with pytest.raises(ConfigError, match="--concurrent must be >= 1"):
            pipeplan.profile("mlp", assignments=TINY, **flags)
        return
    pipeplan.profile("mlp", assignments=TINY, **flags)
    assert any("--concurrent are ignored with --device meta" in w for w in console_warnings())


def test_a_model_that_does_not_fit_once_per_process_is_refused_before_any_sibling_starts(monkeypatch):
    """Every sibling builds the model too: --concurrent N needs N copies of the weights, gradients and inputs, and
    is refused in one line before a sibling could build a model the machine cannot hold."""
    from pipeplan.graph.host_memory import HOST_MEMORY_ENV
    from pipeplan.models.registry import load_model
    from pipeplan.profiling import siblings

    def no_sibling(*args, **kwargs):
        raise AssertionError("a sibling was started")

    monkeypatch.setattr(siblings, "sibling_load", no_sibling)
    monkeypatch.setattr(profile_job, "sibling_load", no_sibling)
    one = 2 * sum(p.numel() * 4 for p in load_model("mlp", TINY).build().parameters())
    monkeypatch.setenv(HOST_MEMORY_ENV, str(one * 2))  # room for one process, not for three
    with pytest.raises(ConfigError, match=r"inputs in each of --concurrent 3 processes\) but cpu has"):
        pipeplan.profile("mlp", assignments=TINY, concurrent=3, threads=1)


@pytest.mark.slow  # starts a sibling process (imports torch)
def test_cli_profile_beside_a_sibling(tmp_path, capsys, monkeypatch):
    from pipeplan.cli import app

    shares: list = []

    def recorded(own: tuple[float, float], siblings: list[float]) -> float:
        shares.append((own, list(siblings)))
        return slowest_share(own, siblings)

    monkeypatch.setattr(profile_job, "slowest_share", recorded)

    out = tmp_path / "p.json"
    with pytest.raises(SystemExit) as done:
        app(
            [
                "profile",
                "mlp",
                "-a",
                "layers=2",
                "-a",
                "hidden=8",
                "--repeats",
                "3",
                "--concurrent",
                "2",
                "--threads",
                "1",
                "-o",
                str(out),
            ]
        )
    assert done.value.code in (0, None)
    printed = " ".join(capsys.readouterr().out.split())
    assert "beside 1 sibling process(es) running the model (--concurrent 2)" in printed
    prov = json.loads(out.read_text())["provenance"]
    assert prov["concurrent"] == 2 and prov["update_bytes_per_s"] > 0
    (((wall, cpu), siblings),) = shares  # the sibling reported its time per step as it stopped; the slowest scales
    assert len(siblings) == 1 and siblings[0] > 0 and wall > 0 and cpu > 0
    assert prov["wall_over_cpu"] == pytest.approx(max([wall, *siblings]) / cpu)
    assert "timer=cpu" in prov["notes"]  # layers in CPU time, then x the measured ratio


@pytest.mark.slow  # starts a sibling process
def test_a_sibling_that_cannot_build_the_model_is_one_line():
    model = SiblingModel(model="no-such-model", threads=1)
    with (
        pytest.raises(ConfigError, match=r"--concurrent: a sibling process could not build the model .*--concurrent 1"),
        sibling_load(model, 1),
    ):
        pass


@pytest.mark.slow  # starts a sibling process
def test_this_process_measures_on_its_block_and_a_silent_sibling_is_warned_of(monkeypatch, console_warnings):
    from pipeplan.profiling import siblings

    monkeypatch.setattr(siblings, "_reported_step_walls", lambda reported, count: [])
    machine, blocks = _affinity(), cpu_core_blocks(2, 1)
    with sibling_load(SiblingModel(model="mlp", options=TINY, threads=1), 1) as shares:
        # this process measures on the first block of cores, as a 2-rank run's rank 0 runs (the sibling: rank 1's)
        assert _affinity() == (set(blocks[0]) if blocks else machine)
    assert _affinity() == machine  # given back
    assert shares.step_walls_s == []
    assert any("1 of 1 sibling process(es) reported no step time" in w for w in console_warnings())
