"""Rank side of the torchtitan proof (tests/plan/test_export_torchtitan_run.py): each rank reads an exported
torchtitan 0.2 job config with torchtitan's own ConfigManager, builds torchtitan's own llama3 model (a tiny one, from
its model code), cuts it into the config's stages with torchtitan's `pipeline_module_split` (the exported
`module_fqns_per_model_part`, the placement of `pipeline_parallel_schedule`) and runs one step of the schedule
torchtitan's `build_pipeline_schedule` builds from the config (the exported CSV in torch's `_PipelineScheduleRuntime`,
microbatches from local_batch_size / pipeline_parallel_microbatch_size, each microbatch's loss / their number).
Rank 0 also runs the single-process reference: the whole model on the whole batch. `run_torchtitan_cases` starts
the ranks through torch's elastic launcher (as helpers.torch_csv_ranks does)."""

from __future__ import annotations

import importlib.util
import sys
import types
from datetime import timedelta

import torch
import torch.distributed as dist

MODEL = {"dim": 32, "n_layers": 6, "n_heads": 2, "vocab_size": 64, "multiple_of": 16}  # torchtitan's llama3 args


def import_torchtitan(deps: str) -> None:
    """torchtitan 0.2 (the venv's) importable without its package __init__ (its quantization kernels), with what its
    model and pipeline modules import (`deps`) on the path."""
    if deps not in sys.path:
        sys.path.insert(0, deps)
    if "torchtitan" not in sys.modules:
        spec = importlib.util.find_spec("torchtitan")
        package = types.ModuleType("torchtitan")
        package.__path__ = list(spec.submodule_search_locations)
        sys.modules["torchtitan"] = package


def _model(seq_len: int):
    from torchtitan.models.llama3.model.args import TransformerModelArgs
    from torchtitan.models.llama3.model.model import Transformer

    torch.manual_seed(0)
    model = Transformer(TransformerModelArgs(**MODEL, max_seq_len=seq_len))
    model.init_weights()
    return model


def _config(path: str):
    from torchtitan.config import ConfigManager

    return ConfigManager().parse_args(["--job.config_file", path])


def _batch(config) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    shape = (config.training.local_batch_size, config.training.seq_len + 1)
    tokens = torch.randint(0, MODEL["vocab_size"], shape, generator=generator)
    return tokens[:, :-1], tokens[:, 1:]


def _pipelined(path: str, mesh) -> dict:
    from torchtitan.components.loss import cross_entropy_loss
    from torchtitan.distributed.pipeline_parallel import build_pipeline_schedule, pipeline_module_split

    config = _config(path)
    parallelism = config.parallelism
    stages, parts = pipeline_module_split(
        _model(config.training.seq_len),
        mesh,
        parallelism.pipeline_parallel_schedule,
        torch.device("cpu"),
        parallelism.module_fqns_per_model_part,
    )
    schedule = build_pipeline_schedule(config, stages, cross_entropy_loss)
    inputs, labels = _batch(config)
    losses: list[torch.Tensor] = []
    last = {"target": labels, "losses": losses} if any(stage.is_last for stage in stages) else {}
    if any(stage.is_first for stage in stages):
        schedule.step(inputs, **last)
    else:
        schedule.step(**last)
    grads = {
        name: p.grad.detach().clone() for part in parts for name, p in part.named_parameters() if p.grad is not None
    }
    return {"losses": [float(loss) for loss in losses], "grads": grads}


def _reference(path: str) -> dict:
    from torchtitan.components.loss import cross_entropy_loss

    config = _config(path)
    model = _model(config.training.seq_len)
    inputs, labels = _batch(config)
    loss = cross_entropy_loss(model(inputs), labels)
    loss.backward()
    return {"loss": float(loss), "grads": {name: p.grad.detach().clone() for name, p in model.named_parameters()}}


def _entry(deps: str, cases: list[tuple[str, str]], pipeline_degree: int) -> dict:
    import_torchtitan(deps)
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    try:
        mesh = init_device_mesh("cpu", (pipeline_degree,), mesh_dim_names=("pp",))
        results = {label: _pipelined(path, mesh) for label, path in cases}
        if dist.get_rank() == 0:
            results.update({f"reference {label}": _reference(path) for label, path in cases})
        return results
    finally:
        dist.destroy_process_group()


def run_torchtitan_cases(cases: list[tuple[str, str]], world_size: int, deps: str) -> dict[str, list[dict]]:
    """cases: (label, exported job config); {label: [rank 0's result, ...], "reference LABEL": rank 0's}."""
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from pipeplan.runtime.launch.local import _free_port

    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=world_size,
        run_id="torchtitan-export-test",
        rdzv_backend="c10d",
        rdzv_endpoint=f"127.0.0.1:{_free_port()}",
        max_restarts=0,
        start_method="spawn",
    )
    results = elastic_launch(config, _entry)(deps, cases, world_size)
    found = {label: [results[rank][label] for rank in range(world_size)] for label, _ in cases}
    found.update({f"reference {label}": results[0][f"reference {label}"] for label, _ in cases})
    return found
