"""The loss's saved tensors are the last layer's: cross-entropy keeps its log-softmax (N·V values, N the tokens it
scores) plus its target (N int64) and total weight (one value), all freed by the input-gradient pass. Expected
bytes are computed here from the shapes, for both profilers, the built-in gpt and Hugging Face GPT-2 (from a tiny
config), and under a mixed precision (the GPU runs the loss in fp32); a model output computed before the last layer
reaches the loss through it; profiles say they count the loss, and loading an older one warns."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from pipeplan.models import load_model
from pipeplan.models.spec import ModelSpec
from pipeplan.profiling.analytic import profile_analytic
from pipeplan.profiling.measure import profile_model
from pipeplan.profiling.profile import Profile

BATCH, SEQ, HIDDEN, VOCAB = 2, 16, 32, 64
GPT = dict(layers=2, hidden=HIDDEN, heads=2, seq=SEQ, vocab=VOCAB)
TINY_GPT2 = {"n_layer": "2", "n_embd": str(HIDDEN), "n_head": "2", "vocab_size": str(VOCAB), "seq_len": str(SEQ)}
TINY_GPT2 |= {"resid_pdrop": "0", "embd_pdrop": "0", "attn_pdrop": "0"}


def cross_entropy_bytes(tokens: int, itemsize: int) -> int:
    """log-softmax (tokens x VOCAB) + int64 target + the total weight, in the loss's dtype."""
    return tokens * VOCAB * itemsize + tokens * 8 + itemsize


def _measured(spec):
    return profile_model(spec, batch_size=BATCH, warmup=0, repeats=1, progress=False, precision="fp32")


def _analytic(spec, precision):
    return profile_analytic(spec, batch_size=BATCH, hardware="h100", precision=precision)


@pytest.mark.parametrize("how", ["measured", "analytic fp32", "analytic bf16-mixed", "analytic bf16"])
def test_gpt_head_counts_the_log_softmax(how):
    spec = load_model("gpt", GPT)
    profile = _measured(spec) if how == "measured" else _analytic(spec, how.split()[1])
    head = profile.layers[-1]
    assert head.name == "head"
    tokens = BATCH * SEQ
    loss_itemsize = 2 if how == "analytic bf16" else 4  # mixed precision: autocast computes the loss in fp32
    loss = cross_entropy_bytes(tokens, loss_itemsize)
    assert head.activation_freed_by_input_grad_bytes == loss  # the norm's and the matmul's are kept for W
    if how in ("measured", "analytic fp32"):
        # LayerNorm: its input, mean and rstd (fp32); the LM head matmul: its input (the normed values)
        layer = tokens * HIDDEN * 4 + 2 * tokens * 4 + tokens * HIDDEN * 4
        assert head.activation_bytes == layer + loss == head.selective_activation_bytes
        assert head.full_activation_bytes == tokens * HIDDEN * 4  # full recompute re-runs the loss too
        assert loss > layer  # at V = 2h the loss already keeps more than the layer itself


def test_hugging_face_lm_head_counts_the_log_softmax():
    pytest.importorskip("transformers")
    spec = load_model("hf:gpt2", TINY_GPT2)
    tokens = BATCH * SEQ  # the log-softmax covers every position (the last one's label is ignored: no next token)
    for profile in (_measured(spec), _analytic(spec, "fp32")):
        head = profile.layers[-1]
        assert head.name == "lm_head"
        assert head.activation_bytes == BATCH * SEQ * HIDDEN * 4 + cross_entropy_bytes(tokens, 4)
        assert head.activation_freed_by_input_grad_bytes == cross_entropy_bytes(tokens, 4)


class _EarlyOutput(nn.Module):
    """Returns the last layer's output and an earlier one; the loss reads both."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        self.c = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.a(x)
        return self.c(self.b(h)), h


def _pair_loss(output, target: torch.Tensor) -> torch.Tensor:
    y, h = output
    return nn.functional.mse_loss(y, target) + (h * h).mean()


def test_a_model_output_from_an_earlier_layer_reaches_the_loss_through_the_last_layer():
    spec = ModelSpec(
        name="early",
        build=_EarlyOutput,
        loss_fn=_pair_loss,
        sample_batch=lambda b, generator=None: ((torch.randn(b, 4, generator=generator),), torch.randn(b, 4)),
    )
    tensor = BATCH * 4 * 4
    for profile in (_measured(spec), _analytic(spec, "fp32")):
        last = profile.layers[-1]
        assert last.name == "c"
        # c's input (kept for W); mse_loss's y and target; h*h's h (passed through, as the runtime's last stage)
        assert last.activation_bytes == 4 * tensor
        assert last.activation_freed_by_input_grad_bytes == 3 * tensor
        assert last.full_activation_bytes == 2 * tensor  # full recompute keeps c's input and h


def test_profiles_say_they_count_the_loss_and_older_files_warn_on_loading(tmp_path, console_warnings):
    spec = load_model("gpt", GPT)
    for profile in (_measured(spec), _analytic(spec, "bf16-mixed")):
        assert profile.provenance.loss_in_last_layer
        path = tmp_path / f"{profile.provenance.source}.json"
        profile.save(path)
        assert Profile.load(path) == profile and console_warnings() == []
        old = json.loads(path.read_text())
        del old["provenance"]["loss_in_last_layer"]  # as written before the field existed (schema 2 still)
        path.write_text(json.dumps(old))
        assert Profile.load(path).provenance.loss_in_last_layer is False
        (line,) = console_warnings()
        assert str(path) in line and "re-profile" in line


@pytest.mark.gpu
def test_cuda_autocast_keeps_the_fp32_log_softmax_the_analytic_profile_counts():
    """Real CUDA autocast (bf16-mixed) computes cross-entropy's log-softmax in fp32: the measured head frees what
    the analytic one (fp32 copies of the logits on the meta device) says."""
    spec = load_model("gpt", GPT)
    measured = profile_model(
        spec, batch_size=BATCH, device="cuda", warmup=0, repeats=1, progress=False, precision="bf16-mixed"
    )
    analytic = _analytic(spec, "bf16-mixed")
    loss = cross_entropy_bytes(BATCH * SEQ, 4)
    assert measured.layers[-1].activation_freed_by_input_grad_bytes == loss
    assert analytic.layers[-1].activation_freed_by_input_grad_bytes == loss
