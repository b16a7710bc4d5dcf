"""The formats `pipeplan export` writes (plan.exports writes them): in a file of their own so that the command's
help (`pipeplan --help`) names them without importing the exporters and the cost model."""

EXPORT_FORMATS = ("torch-csv", "megatron", "torchtitan")
