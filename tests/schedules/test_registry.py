"""The registry's ScheduleInfo agrees with what each generator emits; unknown names raise one error everywhere;
the modules of pipeplan.schedules import each other without a cycle."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

from pipeplan.costs import numerics
from pipeplan.errors import ConfigError, ScheduleError, UnknownScheduleError
from pipeplan.partition.config import PartitionConfig
from pipeplan.schedules import generate, peak_activation_per_device, stage_device, validate
from pipeplan.schedules.ops import OVERLAP
from pipeplan.schedules.placement import LOOPED, MIRRORED, ONE_PER_DEVICE, V_SHAPED, fixed_chunks
from pipeplan.schedules.registry import (
    SCHEDULE_NAMES,
    clear_schedule_cache,
    default_chunks,
    schedule_info,
    schedule_names,
)
from pipeplan.schedules.replicate import replicate_paced
from pipeplan.schedules.simulate import StageCosts

SCHEDULES_DIR = Path(__file__).resolve().parents[2] / "pipeplan" / "schedules"


def _generate(name: str, p: int, chunks: int | None = None, **kwargs):
    return generate(name, num_devices=p, num_microbatches=4 * p, chunks=chunks, **kwargs)


def _devices(name: str, p: int) -> int:
    """`p`, or the next even count for a mirrored schedule (dualpipe's two directions need an even one)."""
    return p + p % 2 if schedule_info(name).placement == MIRRORED else p


def _expected_device(placement: str, stage: int, p: int) -> int:
    """The published placements, written out independently of pipeplan.schedules.placement (mirrored: the even
    microbatches' device, DualPipe's forward direction)."""
    if placement == V_SHAPED:  # ZB-V / DualPipeV: device d holds stages d and 2p-1-d
        return stage if stage < p else 2 * p - 1 - stage
    return stage % p  # looped (Megatron interleaved); one stage per device when there is one chunk


@pytest.mark.parametrize("name", SCHEDULE_NAMES)
@pytest.mark.parametrize("p", [1, 2, 3, 5])
def test_placement_and_chunks_match_the_generated_op_lists(name, p):
    info = schedule_info(name)
    if p != _devices(name, p):
        with pytest.raises(ScheduleError, match="even --stages"):
            _generate(name, p)
        return
    schedule = _generate(name, p)
    validate(schedule)
    assert schedule.num_chunks == info.default_chunks == default_chunks(name)
    assert schedule.stage_device == info.stage_device(p) == stage_device(name, p)
    assert schedule.stage_device == tuple(_expected_device(info.placement, s, p) for s in range(schedule.num_stages))
    for device, ops in enumerate(schedule.device_ops):
        assert {schedule.op_device(h.stage, h.microbatch) for o in ops for h in o.parts} == {device}
        mirror = {p - 1 - d for d in (device,) if info.placement == MIRRORED}
        assert {h.stage for o in ops for h in o.parts} == {device} | mirror or info.placement != MIRRORED
    if info.placement in (ONE_PER_DEVICE, MIRRORED):
        assert schedule.stage_device == tuple(range(p))


@pytest.mark.parametrize("name", SCHEDULE_NAMES)
def test_allowed_chunks_are_the_ones_the_generator_accepts(name):
    info = schedule_info(name)
    fixed = fixed_chunks(info.placement)  # None: any count
    assert (fixed is None) == (info.placement == LOOPED)
    for chunks in range(1, 5):
        if fixed is None or chunks == fixed:
            schedule = _generate(name, 2, chunks)
            assert schedule.num_chunks == chunks and schedule.stage_device == info.stage_device(2, chunks)
        else:
            with pytest.raises(ScheduleError, match="--chunks"):
                _generate(name, 2, chunks)
    with pytest.raises(ScheduleError, match="--chunks"):
        info.resolve_chunks(0)


@pytest.mark.parametrize("name", SCHEDULE_NAMES)
def test_split_backward_schedules_emit_i_and_w_the_others_b(name):
    kinds = {o.kind for ops in _generate(name, _devices(name, 3)).device_ops for o in ops}
    if schedule_info(name).split_backward:
        assert {"I", "W"} <= kinds
    else:
        assert kinds == {"F", "B"}


@pytest.mark.parametrize("name", SCHEDULE_NAMES)
def test_cost_driven_generators_take_costs_and_fixed_ones_do_not(name):
    info = schedule_info(name)
    parameters = set(inspect.signature(info.generator).parameters)
    assert ({"costs", "memory", "memory_limit"} <= parameters) == info.cost_driven
    p = _devices(name, 3)
    stages = p * info.default_chunks
    skewed = StageCosts(
        forward_ms=[(1, 5, 1)[s % 3] for s in range(stages)],
        input_grad_ms=[(3, 1, 1)[s % 3] for s in range(stages)],
        weight_grad_ms=[(0.1, 2, 4)[s % 3] for s in range(stages)],
        comm_ms=2,
    )
    clear_schedule_cache()  # fixed orders are cached: generate each one afresh
    plain = _generate(name, p)
    clear_schedule_cache()
    steered = _generate(name, p, costs=skewed)
    assert plain is not steered
    # a fixed order: costs cannot change it; a cost-driven one follows these skewed costs away from the unit-cost order
    assert (plain.device_ops == steered.device_ops) == (not info.cost_driven)


@pytest.mark.parametrize("name", SCHEDULE_NAMES)
def test_replicable_schedules_expand_into_replicas(name):
    info = schedule_info(name)
    if not info.replicable:
        assert (
            info.placement != ONE_PER_DEVICE or info.cost_driven or info.asynchronous
        )  # async: tests/schedules/test_async.py
        return
    assert info.placement == ONE_PER_DEVICE and not info.cost_driven
    schedule = generate(name, num_devices=3, num_microbatches=6)
    expanded = replicate_paced(schedule, (2, 1, 2))
    assert expanded.num_devices == 5 and expanded.name == name


@pytest.mark.parametrize("name", SCHEDULE_NAMES)
def test_memory_limit_is_met_by_generation_or_refused_after_it(name):
    p = 4
    peak = max(peak_activation_per_device(_generate(name, p)))
    limit = peak / 2
    if schedule_info(name).within_memory_limit:
        schedule = _generate(name, p, memory_limit=limit)
        assert max(peak_activation_per_device(schedule)) <= limit + 1e-9
    else:
        with pytest.raises(ScheduleError, match="over --memory-limit"):
            _generate(name, p, memory_limit=limit)


def test_properties_match_the_tables_they_replaced():
    assert schedule_names(split_backward=True) == ("zb-h1", "zb-h2", "zb-auto", "zbv", "dualpipev", "dualpipe")
    assert schedule_names(replicable=True) == ("gpipe", "1f1b", "zb-h1", "zb-h2")
    assert schedule_names(capacity_default=True) == tuple(n for n in SCHEDULE_NAMES if n not in ("zb-auto", "dualpipe"))
    assert schedule_names(placement=MIRRORED) == ("dualpipe",)
    assert schedule_names(placement=V_SHAPED) == ("zbv", "dualpipev")
    assert schedule_names(placement=LOOPED) == ("interleaved",)
    assert schedule_names(asynchronous=True) == ("pipedream", "pipedream-2bw")
    assert schedule_names(overlapped_pairs=True) == ("dualpipev", "dualpipe")
    assert schedule_names(torch_builtin=True) == ("gpipe", "1f1b", "interleaved", "zbv", "dualpipev")
    assert schedule_names(megatron="") == ("1f1b", "interleaved")
    assert [schedule_info(n).estimate_with for n in SCHEDULE_NAMES if schedule_info(n).estimate_with] == ["zb-h1"]
    assert schedule_names() == SCHEDULE_NAMES
    with pytest.raises(AssertionError):
        schedule_names(colour="red")


@pytest.mark.parametrize("name", SCHEDULE_NAMES)
@pytest.mark.parametrize("p", [2, 3, 4])
def test_weight_updates_and_pairs_match_the_generated_op_lists(name, p):
    """update_every, weight_versions and overlapped pairs are facts of the registry; the op lists carry the same."""
    info, m = schedule_info(name), 4 * p
    if p != _devices(name, p):
        return  # (dualpipe: an even p; test_placement_and_chunks_match_the_generated_op_lists checks the refusal)
    schedule = generate(name, num_devices=p, num_microbatches=m)
    assert (schedule.update_every, schedule.weight_versions) == (info.update_every(m), info.weight_versions(p))
    paired = any(o.kind == OVERLAP for ops in schedule.device_ops for o in ops)
    assert paired == info.overlapped_pairs


@pytest.mark.parametrize("name", SCHEDULE_NAMES)
def test_the_estimate_stands_in_with_a_fixed_order_of_the_same_shape(name):
    info = schedule_info(name)
    stand_in = schedule_info(info.estimate_with or name)
    assert not stand_in.cost_driven or stand_in is info
    assert (stand_in.placement, stand_in.split_backward) == (info.placement, info.split_backward)


@pytest.mark.parametrize("name", SCHEDULE_NAMES)
def test_torch_names_are_torch_schedules_with_the_same_placement(name):
    schedules = pytest.importorskip("torch.distributed.pipelining.schedules")
    info = schedule_info(name)
    if not info.torch_name:  # torch has no schedule with this placement: every export refuses it
        assert info.not_exportable and not info.torch_builtin and info.placement == MIRRORED
        return
    torch_class = schedules.get_schedule_class(info.torch_name)
    v_shaped = torch_class in (schedules.ScheduleZBVZeroBubble, schedules.ScheduleDualPipeV)
    assert v_shaped == (info.placement == V_SHAPED)
    assert issubclass(torch_class, schedules.PipelineScheduleSingle) == (info.placement == ONE_PER_DEVICE)
    builtin = schedule_names(torch_builtin=True)
    assert len({schedule_info(n).torch_name for n in builtin}) == len(builtin)  # one pipeplan schedule per class


def _unknown_message(call) -> str:
    with pytest.raises(UnknownScheduleError) as info:
        call()
    return str(info.value)


def test_an_unknown_name_raises_one_error_listing_the_valid_ones():
    message = _unknown_message(lambda: schedule_info("chimera"))
    assert message.startswith("unknown --schedule 'chimera'; choose from:") and "\n" not in message
    assert message.endswith(", ".join(SCHEDULE_NAMES))
    assert issubclass(UnknownScheduleError, ScheduleError) and issubclass(UnknownScheduleError, ConfigError)
    for call in (
        lambda: generate("chimera", num_devices=2, num_microbatches=2),
        lambda: stage_device("chimera", 2),
        lambda: default_chunks("chimera"),
        lambda: PartitionConfig(num_microbatches=4, schedule="chimera", numerics=numerics("adamw", "bf16-mixed")),
    ):
        assert _unknown_message(call) == message
    with_auto = _unknown_message(lambda: schedule_info("chimera", also_accepted=("auto",)))
    assert with_auto == message.replace("choose from: ", "choose from: auto, ")


def _schedules_imports(path: Path) -> set[str]:
    """pipeplan.schedules modules `path` imports anywhere in it (function-level imports included)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("pipeplan.schedules"):
            if node.module == "pipeplan.schedules":  # `from pipeplan.schedules import x`: x may be a module
                found |= {
                    f"pipeplan.schedules.{a.name}" for a in node.names if (SCHEDULES_DIR / f"{a.name}.py").exists()
                }
                found.add("pipeplan.schedules")
            else:
                found.add(node.module)
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("pipeplan.schedules")}
    return found


def _module(path: Path) -> str:
    parts = path.relative_to(SCHEDULES_DIR.parent.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def test_the_schedules_import_graph_has_no_cycle():
    graph = {_module(path): _schedules_imports(path) for path in SCHEDULES_DIR.rglob("*.py")}
    assert "pipeplan.schedules.generators.zb_auto" in graph["pipeplan.schedules.registry"]
    state: dict[str, str] = {}

    def visit(module: str, path: tuple[str, ...]) -> None:
        if state.get(module) == "done":
            return
        assert state.get(module) != "open", "import cycle: " + " -> ".join((*path, module))
        state[module] = "open"
        for imported in sorted(graph.get(module, ())):
            visit(imported, (*path, module))
        state[module] = "done"

    for module in sorted(graph):
        visit(module, ())
