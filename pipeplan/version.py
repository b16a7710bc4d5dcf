"""pipeplan's version (`pipeplan.__version__`), in a base module of its own: plans record it, and the package's
`__init__` (which names the API lazily) is then imported by no room."""

VERSION = "0.1.0"
