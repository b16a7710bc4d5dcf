"""pipeplan: trace -> profile -> partition -> schedule -> simulate -> choose -> emit plan -> run.

The Python API (README, "Python API"): `pipeplan.profile`, `pipeplan.plan`, `pipeplan.simulate`, `pipeplan.run`,
`Plan` (`save` / `load`), `Profile`, `ModelSpec` and `module_spec`. They load on first use (module `__getattr__`),
so `import pipeplan` does not import torch. (The Plan artifact's room is `pipeplan.artifact`: `pipeplan.plan` is only
ever the API's function.)"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pipeplan.errors import PipeplanError
from pipeplan.version import VERSION

__version__ = VERSION

if TYPE_CHECKING:
    from pipeplan.api import ModelSpec, Plan, Profile, module_spec, plan, profile, run, simulate

_LAZY = ("ModelSpec", "Plan", "Profile", "module_spec", "plan", "profile", "run", "simulate")  # pipeplan.api's
__all__ = [
    "ModelSpec",
    "PipeplanError",
    "Plan",
    "Profile",
    "__version__",
    "module_spec",
    "plan",
    "profile",
    "run",
    "simulate",
]


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'pipeplan' has no attribute {name!r}")
    from pipeplan import api

    value = getattr(api, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
