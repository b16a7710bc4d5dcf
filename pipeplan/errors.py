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


def user_code_location(exc: BaseException) -> str | None:
    """`file.py:LINE` of the innermost traceback frame in the user's own code (not pipeplan, not the Python
    installation or its site-packages, not generated code), or None: where a user's factory or model raised."""
    import os
    import sys
    import traceback

    package = os.path.dirname(os.path.abspath(__file__))
    installed = {os.path.abspath(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix) if p}
    found = None
    for frame in traceback.extract_tb(exc.__traceback__):
        path = os.path.abspath(frame.filename)
        if frame.filename.startswith("<") or path.startswith(package + os.sep):
            continue
        if any(path.startswith(root + os.sep) for root in installed) or "site-packages" in path.split(os.sep):
            continue
        found = frame
    if found is None:
        return None
    shown = os.path.relpath(found.filename) if not os.path.relpath(found.filename).startswith("..") else found.filename
    return f"{shown}:{found.lineno}"
