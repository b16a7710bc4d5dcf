"""`export-weights` on checkpoints written here by the runtime's own stage building and checkpoint writer (no
launch): a buffer no stage holds (used only through a torch.fx constant) gets the run's initial value — the
recorded --init-from file's, else the plan-seed build's; a checkpoint without plan.json needs --plan; a removed
--init-from file that is needed is one line; shards follow transformers' layout."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers.runtime import build_reference_model, make_plan

from pipeplan.errors import RunError
from pipeplan.runtime.export_weights import export_weights
from pipeplan.runtime.step.stages import build_pipeline_model
from pipeplan.runtime.weights import checkpoint
from pipeplan.runtime.weights.weights_output import shards

safetensors = pytest.importorskip("safetensors.torch")
QUIRKY = f"{Path(__file__).with_name('exact_models.py')}:quirky_lm"
MASK = "blocks.0.mask"  # a persistent buffer the model uses only through a torch.fx constant


def _write_checkpoint(root: Path, plan, init_from: str | None, *, with_plan: bool = True) -> None:
    """Step 1 of a 2-stage run, each stage file from that rank's own materialized stage (as Trainer.save)."""
    for rank in range(plan.world_size):
        model = build_pipeline_model(plan, rank, torch.device("cpu"), init_from=init_from)
        for stage in plan.ranks[rank].stages:
            checkpoint.save_stage(
                root,
                step=1,
                stage=stage,
                names=model.stage_params[stage],
                params=model.params,
                buffers=dict(model.modules[stage].named_buffers()),
                optimizer_states={},
                fingerprint=model.traced.layer_graph.fingerprint,
                partition=checkpoint.partition_key(plan),
                num_stages=len(plan.stages),
            )
    checkpoint.mark_latest(root, 1, plan if with_plan else None, init_from)


def test_untrained_buffers_come_from_the_runs_initial_weights(tmp_path):
    plan_path, plan = make_plan(tmp_path, "p", QUIRKY, {"layers": 2}, schedule="1f1b", pipeline_devices=2)
    _, whole = build_reference_model(plan)
    state = {k: v.detach() + 0.5 if v.is_floating_point() else v.clone() for k, v in whole.state_dict().items()}
    state[MASK] = ~state[MASK]
    init = str(tmp_path / "init.safetensors")
    safetensors.save_file(state, init)
    _write_checkpoint(tmp_path / "ck", plan, init)
    done = export_weights(tmp_path / "ck", str(tmp_path / "w.safetensors"))
    assert MASK in done.initial and all(key.endswith(".mask") for key in done.initial) and done.step == 1
    exported = safetensors.load_file(str(tmp_path / "w.safetensors"))
    assert exported.keys() == state.keys()
    for key, value in state.items():
        assert torch.equal(exported[key], value), key  # never trained: the file's values, the mask included
    Path(init).unlink()
    with pytest.raises(RunError, match="no longer exists"):
        export_weights(tmp_path / "ck", str(tmp_path / "x.safetensors"))

    _write_checkpoint(tmp_path / "seeded", plan, None, with_plan=False)  # an older checkpoint: no plan.json
    with pytest.raises(RunError, match="--plan PLAN"):
        export_weights(tmp_path / "seeded", str(tmp_path / "y.safetensors"))
    export_weights(tmp_path / "seeded", str(tmp_path / "dir"), plan_file=plan_path, shard_gb=1e-6)
    index = (tmp_path / "dir" / "model.safetensors.index.json").read_text()
    assert index.count(".safetensors") > 2 and not (tmp_path / "dir" / "config.json").exists()
    exported = {}
    for shard in (tmp_path / "dir").glob("model-*.safetensors"):
        exported |= safetensors.load_file(str(shard))
    for key, value in whole.state_dict().items():
        assert torch.equal(exported[key], value), key  # the plan-seed build


def test_shards_keep_order_and_size():
    tensors = {name: torch.zeros(n) for name, n in [("a", 4), ("b", 4), ("c", 16), ("d", 1)]}
    assert shards(tensors, 32) == [["a", "b"], ["c"], ["d"]]  # float32: 16, 16, 64 (alone, over the limit), 4
    assert shards(tensors, 10**9) == [["a", "b", "c", "d"]]
