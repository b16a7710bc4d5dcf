"""torchtitan's own stage builder on exported stage FQNs, run in a subprocess with one torchtitan version on the path
(`torchtitan_env.environment`): the exported config is parsed by that version's loader, the model is built on the
CPU — torchtitan 0.3's transformers_modeling_backend from a Hugging Face config directory (`--hf_model`, kind
"hf"), or a pipeplan factory's module as it is (kind "own") — each parameter filled with its index, and split by
torchtitan's own `pipeline_module_split` for every pp rank (torch's fake process group, no processes). Prints one
JSON object: per case, per stage index, the whole model's names of the parameters the stage keeps (found by value:
torchtitan renumbers a kept ModuleList's entries; the backend's `model.` prefix removed: the user's own names) and
the top-level children the stage builder left in place."""

from __future__ import annotations

import json
import sys

HF_BACKEND = "transformers_modeling_backend"


def _parse(version: str, case: dict):
    from torchtitan.config import ConfigManager

    if version == "0.2":
        return ConfigManager().parse_args(["--job.config_file", case["config"]])
    with open(case["config"]) as handle:
        args = [word for line in handle if not line.startswith("#") for word in line.split()]
    if case["kind"] == "hf":
        module = ["--module", HF_BACKEND, "--config", f"{HF_BACKEND}_full", "--hf_model", case["hf_model"]]
    else:  # the user's own model: any registered module parses the parallelism section the same way
        module = ["--module", "llama3", "--config", "llama3_debugmodel"]
    return ConfigManager().parse_args([*module, *args])


def _model(version: str, case: dict, config):
    import torch

    if case["kind"] == "hf":
        model_config = config.model_spec.model
        model_config.update_from_config(config=config)
        model = model_config.build()
    else:
        from pipeplan.models.registry import load_model

        model = load_model(case["ref"], case["options"]).build()
    with torch.no_grad():  # each parameter holds its own index: found again in the stage, whatever it is named there
        for index, parameter in enumerate(model.parameters()):
            parameter.fill_(index)
    return model


def _splitter(version: str, kind: str):
    if kind == "hf":
        from torchtitan.experiments.transformers_modeling_backend.pipeline import pipeline_module_split

        return pipeline_module_split
    if version == "0.2":
        from torchtitan.distributed.pipeline_parallel import pipeline_module_split

        return pipeline_module_split
    from torchtitan.distributed.pipeline_parallel import _pipeline_module_split

    return _pipeline_module_split


def _kept(part) -> list[str]:
    """The top-level children a stage kept: not dropped (None or an Identity) nor emptied (a container)."""
    import torch

    kept = []
    for name, child in part.named_children():
        dropped = child is None or type(child).__name__ == "Identity"
        empty = isinstance(child, torch.nn.ModuleList | torch.nn.ModuleDict) and len(child) == 0
        kept += [] if dropped or empty else [name]
    return kept


def _split(version: str, case: dict) -> dict:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    config = _parse(version, case)
    parallelism = config.parallelism
    model, split = _model(version, case, config), _splitter(version, case["kind"])
    prefix = "model." if case["kind"] == "hf" else ""
    original = [name.removeprefix(prefix) for name, _ in model.named_parameters()]
    stages: dict[int, dict] = {}
    pp = parallelism.pipeline_parallel_degree
    for rank in range(pp):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=pp)
        try:
            mesh = init_device_mesh("cpu", (pp,), mesh_dim_names=("pp",))
            built, parts = split(
                model,
                mesh,
                parallelism.pipeline_parallel_schedule,
                torch.device("cpu"),
                parallelism.module_fqns_per_model_part,
            )
            for stage, part in zip(built, parts):
                names = [original[int(parameter.flatten()[0])] for parameter in part.parameters()]
                stages[stage.stage_index] = {"params": names, "children": _kept(part)}
        finally:
            dist.destroy_process_group()
    return {"stages": [stages[index] for index in sorted(stages)], "fqns": parallelism.module_fqns_per_model_part}


def main() -> None:
    version, cases = sys.argv[1], json.loads(sys.argv[2])
    if version == "0.2":  # torchtitan/__init__.py imports its quantization kernels; the split needs none of them
        import importlib.util
        import types

        spec = importlib.util.find_spec("torchtitan")
        package = types.ModuleType("torchtitan")
        package.__path__ = list(spec.submodule_search_locations)
        sys.modules["torchtitan"] = package
    import torchtitan

    results = {"torchtitan": torchtitan.__path__[0]}
    results.update({label: _split(version, case) for label, case in cases.items()})
    print(json.dumps(results))


if __name__ == "__main__":
    main()
