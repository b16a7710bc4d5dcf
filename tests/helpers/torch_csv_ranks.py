"""Rank side of test_torch_csv_run: each rank builds its stage of a plan exactly as `pipeplan run` does
(runtime.stages.build_pipeline_model), wraps it in torch.distributed.pipelining's PipelineStage and runs one step
of the exported CSV schedule in torch's own `_PipelineScheduleRuntime` (what torchtitan runs for
`pipeline_parallel_schedule_csv`). `run_csv_cases` starts the ranks through torch's elastic launcher and returns,
per case, what each rank saw: its microbatch losses (last stage) and its parameters' gradients."""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist


def _run_case(plan_path: str, csv_path: str, rank: int) -> dict:
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import _PipelineScheduleRuntime

    from pipeplan.plan.plan import Plan
    from pipeplan.runtime.step.stages import build_pipeline_model

    plan = Plan.load(plan_path)
    model = build_pipeline_model(plan, rank, torch.device("cpu"))
    (stage_index,) = plan.ranks[rank].stages
    module = model.modules[stage_index]
    if stage_index > 0:  # torch passes a stage's outputs positionally to the next stage
        assert model.stage_io[stage_index].inputs == model.stage_io[stage_index - 1].outputs
    stage = PipelineStage(module, stage_index, len(plan.stages), torch.device("cpu"))
    outputs = model.stage_io[-1].outputs

    def loss_fn(output, target):
        values = output if isinstance(output, tuple) else (output,)
        return model.spec.loss_fn(model.build_output(dict(zip(outputs, values))), target)

    schedule = _PipelineScheduleRuntime([stage], plan.training.num_microbatches, loss_fn=loss_fn)
    schedule._load_csv(csv_path)
    inputs, target = next(model.spec.batches(plan.training.global_batch_size, plan.training.seed))
    losses: list[torch.Tensor] = []
    if stage_index == 0:
        schedule.step(*inputs)
    else:
        schedule.step(target=target, losses=losses)
    grads = {name: p.grad.clone() for name, p in model.params.items() if p.grad is not None}
    return {"losses": [float(loss) for loss in losses], "grads": grads}


def _entry(cases: list[tuple[str, str, str]]) -> dict:
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    try:
        return {label: _run_case(plan, csv, dist.get_rank()) for label, plan, csv in cases}
    finally:
        dist.destroy_process_group()


def run_csv_cases(cases: list[tuple[str, str, str]], world_size: int) -> dict[str, list[dict]]:
    """cases: (label, plan.json, exported CSV); {label: [rank 0's result, rank 1's, ...]}."""
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from pipeplan.runtime.launch.local import _free_port

    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=world_size,
        run_id="torch-csv-test",
        rdzv_backend="c10d",
        rdzv_endpoint=f"127.0.0.1:{_free_port()}",
        max_restarts=0,
        start_method="spawn",
    )
    results = elastic_launch(config, _entry)(cases)
    return {label: [results[rank][label] for rank in range(world_size)] for label, _, _ in cases}
