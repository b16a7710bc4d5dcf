"""Errors a user can cause. Each message names the option or input to change; the CLI prints it as one line."""

DEBUG_ENV = "PIPEPLAN_DEBUG"  # set to 1 to see the traceback of an unexpected error (and of a failed rank's error)


class PipeplanError(Exception):
    """Base class for every user-fixable error (CLI exit code 1)."""


class ConfigError(PipeplanError):
    """A bad option value or an impossible combination of options."""


class ModelError(PipeplanError):
    """A model reference that cannot be resolved or built, or a bad model option."""


class TraceError(PipeplanError):
    """torch.fx could not trace the model."""


class FormatError(PipeplanError):
    """A file (profile, plan, schedule CSV, checkpoint) with a bad schema or missing fields."""


class ScheduleError(PipeplanError):
    """An unknown schedule, an unsupported (devices, microbatches, chunks) combination or an invalid op list."""


class InfeasibleError(PipeplanError):
    """No partition or plan fits the constraints; the message names the binding one and what would fit."""


class RunError(PipeplanError):
    """A failure while executing a plan (a rank died, a mismatched model, a bad checkpoint)."""


class OutputError(PipeplanError):
    """A file or directory pipeplan must write cannot be written (a directory in the way, a full disk, ...)."""


class UnknownScheduleError(ScheduleError, ConfigError):
    """A schedule name that is not in the registry (a bad option value, hence also a ConfigError)."""
