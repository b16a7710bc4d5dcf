"""`pipeplan capacity`'s options: the flags it shares with `plan` (`search.flags.SearchFlags`) and its own, declared
once and checked before the (slow) analytic profile."""

from __future__ import annotations

import math
from dataclasses import dataclass

from pipeplan.errors import ConfigError
from pipeplan.options import argument, option
from pipeplan.paths import check_output_file
from pipeplan.search.flags import SearchFlags
from pipeplan.units import parse_count

MODEL_HELP = "Built-in model name, path/to/file.py:factory or package.module:factory."
PLOT_HELP = "Write MFU and memory vs devices per tensor-parallel size, and MFU per schedule (PNG)."
DEVICES_PER_NODE = 8  # capacity's nodes: 8 GPUs (DGX / HGX), as the presets' links are measured


@dataclass(frozen=True, kw_only=True)
class CapacityOptions(SearchFlags):
    model: str = argument(help=MODEL_HELP)
    devices: str | None = option(None, "--devices", "-n", help="Device counts to plan for, e.g. 8,64,512.")
    devices_per_node: int = option(DEVICES_PER_NODE, "--devices-per-node", help="Devices per node.")
    seq: int | None = option(None, "--seq", help="Sequence length (replaces the model's seq option).")
    target_tokens: str | None = option(None, "--target-tokens", help="Tokens to train on, e.g. 1T (with --days).")
    days: float | None = option(None, "--days", help="Days the training may take (with --target-tokens).")
    plot: str | None = option(None, "--plot", help=PLOT_HELP)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.hardware is None:
            raise ConfigError("capacity plans for a GPU you name: give --hardware NAME (e.g. h100) or FILE.json[:NAME]")
        if self.devices is None and self.layout is None:
            raise ConfigError("give --devices (counts to plan for, e.g. 8,64) or --layout")
        if self.days is not None and not (math.isfinite(self.days) and self.days > 0):
            raise ConfigError(f"--days must be a finite number > 0, got {self.days}")
        if self.target_tokens is not None and not parse_count(self.target_tokens, option="--target-tokens") > 0:
            raise ConfigError(f"--target-tokens must be > 0, got {self.target_tokens!r}")
        if self.plot is not None:  # checked, and the path kept as it will be written (~ expanded)
            object.__setattr__(self, "plot", str(check_output_file(self.plot, "--plot")))
            if not self.plot.lower().endswith(".png"):
                raise ConfigError(f"--plot {self.plot!r} must name a .png file")
