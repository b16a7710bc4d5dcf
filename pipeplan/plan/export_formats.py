"""The formats `pipeplan export` writes (plan.exports writes them): in a file of their own so that the command's
help (`pipeplan --help`) names them without importing the exporters and the cost model."""

EXPORT_FORMATS = ("torch-csv", "megatron", "torchtitan", "torchtitan-0.3")
TORCHTITAN_FORMATS = {"torchtitan": "0.2", "torchtitan-0.3": "0.3"}  # format -> torchtitan version
