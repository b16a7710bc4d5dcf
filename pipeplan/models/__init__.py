"""Built-in models and model loading. `load_model(ref, options)` returns a ModelSpec."""

from pipeplan.models.builtins import BUILTINS, register
from pipeplan.models.gpt import gpt
from pipeplan.models.llama import llama
from pipeplan.models.mlp import mlp
from pipeplan.models.registry import load_model, parse_assignments
from pipeplan.models.resnet import resnet
from pipeplan.models.spec import ModelSpec

__all__ = ["BUILTINS", "ModelSpec", "gpt", "llama", "load_model", "mlp", "parse_assignments", "register", "resnet"]
