"""Two gloo ranks train models whose state per-submodule re-initialization got wrong (an RMSNorm ones weight, a
hand-initialized parameter, an `_init_weights` pass, a causal mask and rotary buffers, a tie across ranks) to the
same losses as single-process AdamW on the whole model; and with --init-from a .safetensors file, to the same losses
as the whole model loaded from that file. One launch runs both."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers.runtime import make_plan, reference_losses

from pipeplan.models import load_model
from pipeplan.runtime.launch.local import launch_many
from pipeplan.runtime.train.config import RunConfig
from pipeplan.runtime.weights import materialize as mat

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]  # multi-process runs

save_file = pytest.importorskip("safetensors.torch").save_file  # the [hf] extra
QUIRKY = f"{Path(__file__).with_name('exact_models.py')}:quirky_lm"
STEPS, LR = 6, 3e-3


def test_two_ranks_match_single_process_with_and_without_init_from(tmp_path):
    plain_path, plain = make_plan(tmp_path, "tied", QUIRKY, {"tie": True}, schedule="1f1b", pipeline_devices=2)
    init_path, init_plan = make_plan(tmp_path, "init", QUIRKY, {}, schedule="zb-h1", pipeline_devices=2)
    whole = mat.build_whole(load_model(QUIRKY, {}), seed=123)
    weights = str(tmp_path / "w.safetensors")
    save_file({k: v.contiguous() for k, v in whole.state_dict().items()}, weights)
    common = dict(steps=STEPS, lr=LR, quiet=True, heartbeat_timeout_s=30.0)
    runs = [(plain_path, RunConfig(**common)), (init_path, RunConfig(init_from=weights, **common))]
    results = launch_many(runs, threads=1)
    decay = plain.training.weight_decay
    expected_plain = reference_losses(plain, STEPS, lr=LR, weight_decay=decay)
    expected_init = reference_losses(init_plan, STEPS, lr=LR, weight_decay=decay, init_from=weights)
    assert abs(expected_plain[0] - expected_init[0]) > 1e-3  # the file's weights are not the plan seed's
    for index, expected in ((0, expected_plain), (1, expected_init)):
        losses = results[0][index].losses
        assert losses == results[1][index].losses and len(losses) == STEPS
        torch.testing.assert_close(losses, expected, rtol=1e-5, atol=1e-6)
        assert losses[-1] < losses[0]
