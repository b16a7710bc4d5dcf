"""Render a Profile: a rich table per layer (F/I/W/B ms, activations, parameters, cut bytes) and fidelity ratios."""

from __future__ import annotations

from rich import box
from rich.table import Table

from pipeplan.precision import profile_precision
from pipeplan.profiling.profile import Profile
from pipeplan.units import format_bytes, format_count, format_ms


def fidelity(profile: Profile) -> dict[str, float | None]:
    """Per-layer sums over whole-model timings (1.0 = the layer profile adds up exactly)."""
    forward = sum(layer.forward_ms for layer in profile.layers)
    split = sum(layer.input_grad_ms + layer.weight_grad_ms for layer in profile.layers)
    fused = sum(layer.backward_ms for layer in profile.layers)
    whole_f, whole_b = profile.whole_forward_ms, profile.whole_backward_ms
    return {
        "forward_sum_over_whole": forward / whole_f if whole_f else None,
        "split_backward_sum_over_whole": split / whole_b if whole_b else None,
        "fused_backward_sum_over_whole": fused / whole_b if whole_b else None,
    }


def profile_table(profile: Profile) -> Table:
    source = profile.provenance
    title = (
        f"{source.model} ({source.source}, {source.device}, {profile_precision(source)}, batch {source.batch_size}, "
        f"{profile.num_layers} layers)"
    )
    table = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False)
    table.add_column("layer", no_wrap=True)
    for column in ("F ms", "I ms", "W ms", "B ms", "act", "to W", "params", "cut"):
        table.add_column(column, justify="right", no_wrap=True)
    for i, layer in enumerate(profile.layers):
        cut = format_bytes(profile.cut_bytes[i], compact=True) if i < len(profile.cut_bytes) else "-"
        table.add_row(
            layer.name,
            format_ms(layer.forward_ms),
            format_ms(layer.input_grad_ms),
            format_ms(layer.weight_grad_ms),
            format_ms(layer.backward_ms),
            format_bytes(layer.activation_bytes, compact=True),
            format_bytes(layer.activation_kept_until_weight_grad_bytes, compact=True),
            format_count(layer.param_count),
            cut,
        )
    layers = profile.layers
    table.add_section()
    table.add_row(
        "total",
        format_ms(sum(x.forward_ms for x in layers)),
        format_ms(sum(x.input_grad_ms for x in layers)),
        format_ms(sum(x.weight_grad_ms for x in layers)),
        format_ms(sum(x.backward_ms for x in layers)),
        format_bytes(sum(x.activation_bytes for x in layers), compact=True),
        format_bytes(sum(x.activation_kept_until_weight_grad_bytes for x in layers), compact=True),
        format_count(sum(x.param_count for x in layers)),
        "",
    )
    return table


def options_line(profile: Profile) -> str | None:
    """The options the model was built with (a Hugging Face model's effective config: the fields that define its
    shapes as built, derived ones included)."""
    options = profile.provenance.spec_options
    if not options:
        return None
    return "model built with: " + ", ".join(f"{key}={value}" for key, value in options.items())


def routing_lines(profile: Profile) -> list[str]:
    """How each mixture-of-experts layer routed the profiled batch, and which modules ran eagerly."""
    source = profile.provenance
    lines = []
    if source.eager_modules:
        shown = ", ".join(source.eager_modules[:4]) + (
            f" (+{len(source.eager_modules) - 4})" if len(source.eager_modules) > 4 else ""
        )
        lines.append(f"run eagerly inside their layers (data-dependent code): {shown}")
    for routed in source.expert_routing:
        counts = routed.tokens_per_expert
        lines.append(
            f"{routed.module}: {routed.experts} experts{f' top-{routed.top_k}' if routed.top_k else ''}, "
            f"{routed.tokens} tokens; per expert min/mean/max {min(counts)}/{sum(counts) / len(counts):.1f}/"
            f"{max(counts)} (max/mean {routed.imbalance:.2f})"
        )
    return lines


def fidelity_line(profile: Profile) -> str | None:
    ratios = fidelity(profile)
    if ratios["forward_sum_over_whole"] is None or ratios["split_backward_sum_over_whole"] is None:
        return None
    return (
        f"whole model: forward {profile.whole_forward_ms:.3f} ms, backward {profile.whole_backward_ms:.3f} ms; "
        f"layer sums / whole: F {ratios['forward_sum_over_whole']:.2f}, I+W "
        f"{ratios['split_backward_sum_over_whole']:.2f}, B {ratios['fused_backward_sum_over_whole']:.2f}"
    )
