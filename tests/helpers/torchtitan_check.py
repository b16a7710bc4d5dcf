"""torchtitan's own checks of exported configs, run in a subprocess with one torchtitan version on the path
(`torchtitan_env.run_check`): its config loader (0.2: ConfigManager with --job.config_file; 0.3: ConfigManager with
--module / --config and the exported arguments) parses each config, and its ParallelDims validates the degrees and
builds the device mesh at the plan's world size on torch's fake process group (no processes: the mesh's sizes are
checked as a real run's would be). 0.2's parallelize_llama refuses DDP on a mesh of more than one dimension: that
is checked on the mesh built. Prints one JSON object: per case, what torchtitan read."""

from __future__ import annotations

import json
import sys


def _parse(version: str, case: dict):
    from torchtitan.config import ConfigManager

    if version == "0.2":
        return ConfigManager().parse_args(["--job.config_file", case["config"]])
    with open(case["config"]) as handle:
        args = [word for line in handle if not line.startswith("#") for word in line.split()]
    return ConfigManager().parse_args(["--module", case["module"], "--config", case["base"], *args])


def _mesh(version: str, parallelism, world_size: int) -> dict:
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from torchtitan.distributed.parallel_dims import ParallelDims

    if version == "0.2":
        dims = ParallelDims(
            dp_replicate=parallelism.data_parallel_replicate_degree,
            dp_shard=parallelism.data_parallel_shard_degree,
            cp=parallelism.context_parallel_degree,
            tp=parallelism.tensor_parallel_degree,
            pp=parallelism.pipeline_parallel_degree,
            ep=parallelism.expert_parallel_degree,
            etp=parallelism.expert_tensor_parallel_degree,
            world_size=world_size,
        )
    else:
        dims = ParallelDims.from_config(parallelism, world_size)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        mesh = dims.world_mesh
        ddp_only = dims.dp_replicate > 1 and not dims.fsdp_enabled  # 0.2: DDP, which needs a 1-D mesh
        return {"mesh_built": True, "ddp_on_many_dims": version == "0.2" and ddp_only and mesh.ndim > 1}
    finally:
        dist.destroy_process_group()


def _read(version: str, case: dict) -> dict:
    config = _parse(version, case)
    parallelism = config.parallelism
    read = {
        "parallelism": {name: getattr(parallelism, name) for name in case["fields"]},
        "local_batch_size": config.training.local_batch_size,
        "global_batch_size": config.training.global_batch_size,
        **_mesh(version, parallelism, case["world_size"]),
    }
    if version == "0.2":
        read["checkpoint"] = config.activation_checkpoint.mode
        read["lr"], read["weight_decay"] = config.optimizer.lr, config.optimizer.weight_decay
        read["model"] = config.model.name
    else:
        ac = config.activation_checkpoint
        read["checkpoint"] = "none" if ac is None else type(ac).__qualname__.split(".")[0]
        kwargs = config.optimizer.param_groups[0].optimizer_kwargs
        read["lr"], read["weight_decay"] = kwargs["lr"], kwargs["weight_decay"]
    return read


def main() -> None:
    version, cases = sys.argv[1], json.loads(sys.argv[2])
    if version == "0.2":  # torchtitan/__init__.py imports its quantization kernels; the loader needs none of them
        import importlib.util
        import types

        spec = importlib.util.find_spec("torchtitan")
        package = types.ModuleType("torchtitan")
        package.__path__ = list(spec.submodule_search_locations)
        sys.modules["torchtitan"] = package
    import torchtitan

    results = {"torchtitan": torchtitan.__path__[0]}
    results.update({label: _read(version, case) for label, case in cases.items()})
    print(json.dumps(results))


if __name__ == "__main__":
    main()
