"""Profile scaling to another microbatch size is linear in per-microbatch quantities, not in parameters."""

from __future__ import annotations

import pytest
from helpers.search import synthetic_profile

from pipeplan.search.scaling import scale_profile


def test_scaling_is_linear_in_per_microbatch_costs():
    base = synthetic_profile(batch_size=2)
    scaled = scale_profile(base, 6)
    assert scaled.provenance.batch_size == 6
    for before, after in zip(base.layers, scaled.layers):
        assert after.forward_ms == pytest.approx(3 * before.forward_ms)
        assert after.weight_grad_ms == pytest.approx(3 * before.weight_grad_ms)
        assert after.activation_bytes == 3 * before.activation_bytes
        assert after.param_bytes == before.param_bytes and after.param_count == before.param_count
    assert scaled.cut_bytes == tuple(3 * b for b in base.cut_bytes)
    assert scale_profile(base, 2) is base
    assert scale_profile(scaled, 2).layers == base.layers
