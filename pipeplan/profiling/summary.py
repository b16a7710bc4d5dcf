"""Render a Profile: a rich table per layer (F/I/W/B ms, activations, parameters, cut bytes) and the checks of its
timings (`profiling.consistency`)."""

from __future__ import annotations

from rich import box
from rich.table import Table

from pipeplan.precision import profile_precision
from pipeplan.profiling.consistency import consistency_line
from pipeplan.profiling.profile import Profile
from pipeplan.units import format_bytes, format_count, format_ms


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


def measured_with_line(profile: Profile) -> str | None:
    """A CPU profile's threads and whether sibling processes ran beside it (`--concurrent`, siblings.py)."""
    source = profile.provenance
    if source.threads is None:
        return None
    line = f"measured with {source.threads} CPU thread(s)"
    if source.concurrent:
        siblings = source.concurrent - 1
        ratio = (
            f"; CPU times x {source.wall_over_cpu:.2f}, the slowest process's wall-clock / this one's CPU time per step"
            if source.wall_over_cpu
            else ""
        )
        return (
            f"{line}, beside {siblings} sibling process(es) running the model (--concurrent {source.concurrent}){ratio}"
        )
    return f"{line}, alone (no --concurrent)"


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


def consistency_lines(profile: Profile) -> list[str]:
    """The whole-model references and the checks of the timings (`profiling.consistency`): sums per pass, the
    largest spread, what is out of bounds."""
    if profile.whole_forward_ms is None or profile.whole_backward_ms is None:
        return []
    split = profile.whole_split_backward_ms
    whole = f"whole model: forward {profile.whole_forward_ms:.3f} ms, backward {profile.whole_backward_ms:.3f} ms" + (
        f", split backward (I+W) {split:.3f} ms" if split else ""
    )
    return [line for line in (whole, consistency_line(profile)) if line]
