"""Built-in models and model loading. `load_model(ref, options)` returns a ModelSpec."""

from pipeplan.models.gpt import gpt
from pipeplan.models.mlp import mlp
from pipeplan.models.registry import BUILTINS, load_model, parse_assignments, register
from pipeplan.models.resnet import resnet
from pipeplan.models.spec import ModelSpec

register("gpt", gpt, "decoder-only transformer (embedding, pre-LN blocks, LM head)")
register("mlp", mlp, "stack of Linear + activation layers (a chain)")
register("resnet", resnet, "small residual CNN with skip connections (a DAG)")

__all__ = ["BUILTINS", "ModelSpec", "gpt", "load_model", "mlp", "parse_assignments", "register", "resnet"]
