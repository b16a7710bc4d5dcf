"""pipeplan: trace -> profile -> partition -> schedule -> simulate -> choose -> emit plan -> run."""

__version__ = "0.1.0"

from pipeplan.errors import PipeplanError

__all__ = ["PipeplanError", "__version__"]
