"""torch.autocast as CUDA runs it, on meta tensors: the analytic profile's forward under bf16-/fp16-mixed.

Autocast has no meta-device kernels, and CPU autocast's op lists differ from CUDA's (the CPU keeps layer_norm,
softmax, rms_norm, exp, pow, sum at their input dtype; CUDA runs them in fp32), so the analytic profiler, which
describes a GPU run, applies CUDA's lists itself. They are PyTorch's (`aten/src/ATen/autocast_mode.cpp`, listed in
the AMP docs' "CUDA Ops that can autocast to float16 / to float32 / that promote to the widest input type",
https://pytorch.org/docs/stable/amp.html); tests/profiling/test_cuda_autocast.py checks them against torch's own
AutocastCUDA kernels, which a CPU build runs on fake CUDA tensors, op by op and node by node over whole models.

`CudaAutocast` is a TorchFunctionMode: a call to an op with a policy casts its floating-point tensor arguments as
autocast does and runs the op with the mode off inside (autocast excludes itself below an op it handled):

- lower precision (matmuls, linear, convolutions, attention): to the autocast dtype; an fp32 leaf that requires a
  gradient (a parameter, a stage's input) is cast once per forward (autocast's cache), and the copy each matmul
  saves for its backward is an activation like any other (2 bytes per weight);
- fp32 (layer_norm, rms_norm, group_norm, exp, log, pow, rsqrt, losses, ...): to fp32, so the norms save fp32
  inputs and return fp32;
- fp32 output (softmax, log_softmax, sum, cumsum, prod, norms): the op called with dtype=float32 unless given;
- promote (addcmul, index_put, ...): to the widest of the autocast dtype and the arguments' floating-point dtypes.

Everything else runs at its inputs' dtypes (a bf16 matmul output plus the fp32 residual stream is fp32). Ops are
matched by name: an aten overload (torch.export graphs) by its schema's name, a torch function or Tensor method
(torch.fx graphs) by its `__name__`. A Python-level composite with no policy of its own (e.g.
`F.multi_head_attention_forward`) runs with the mode off inside, as `GpuSemantics` treats it.
"""

from __future__ import annotations

import contextlib

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map

from pipeplan.profiling.gpu_ops import GpuSemantics

# (names as one string each, split: the lists read as PyTorch's source has them)
LOWER = frozenset(
    (  # noqa: SIM905
        "_convolution conv1d conv2d conv3d conv_tbc conv_transpose1d conv_transpose2d conv_transpose3d convolution "
        "cudnn_convolution cudnn_convolution_transpose prelu addmm addmv addr matmul einsum mm mv linalg_vecdot "
        "linear addbmm baddbmm bmm chain_matmul linalg_multi_dot _thnn_fused_lstm_cell _thnn_fused_gru_cell "
        "lstm_cell gru_cell rnn_tanh_cell rnn_relu_cell _scaled_dot_product_flash_attention "
        "scaled_dot_product_attention"
    ).split()
)
FP32 = frozenset(
    (  # noqa: SIM905
        "acos asin cosh erfinv exp expm1 log log10 log2 log1p reciprocal rsqrt sinh tan pow softplus layer_norm "
        "native_layer_norm group_norm frobenius_norm nuclear_norm cosine_similarity poisson_nll_loss "
        "cosine_embedding_loss nll_loss nll_loss2d hinge_embedding_loss kl_div l1_loss smooth_l1_loss huber_loss "
        "mse_loss margin_ranking_loss multilabel_margin_loss soft_margin_loss triplet_margin_loss multi_margin_loss "
        "binary_cross_entropy_with_logits dist pdist cdist renorm logsumexp upsample_nearest1d upsample_nearest2d "
        "upsample_nearest3d _upsample_nearest_exact1d _upsample_nearest_exact2d _upsample_nearest_exact3d "
        "upsample_linear1d upsample_bilinear2d _upsample_bilinear2d_aa upsample_trilinear3d upsample_bicubic2d "
        "_upsample_bicubic2d_aa rms_norm norm"
    ).split()
    # Python-level composites made of fp32 ops: cross_entropy (log_softmax + nll_loss), interpolate (upsample_*)
    + ["cross_entropy", "cross_entropy_loss", "interpolate"]
)
FP32_OUTPUT = frozenset(
    "prod softmax log_softmax cumprod cumsum linalg_vector_norm linalg_matrix_norm sum".split()  # noqa: SIM905
)  # autocast's fp32_set_opt_dtype: the op's own dtype argument set to float32 (`norm` is cast: FP32)
PROMOTE = frozenset(
    "addcdiv addcmul atan2 bilinear cross dot vdot grid_sampler index_put scatter_add tensordot".split()  # noqa: SIM905
)
_ALIASES = {"__matmul__": "matmul", "__rmatmul__": "matmul", "__pow__": "pow", "__rpow__": "pow"}


def op_name(func) -> str:
    """The aten name a torch-function-level call stands for (an overload's schema name; a function's name)."""
    schema = getattr(func, "_schema", None)
    if schema is not None:
        return schema.name.partition("::")[2]
    name = getattr(func, "__name__", "")
    return _ALIASES.get(name, name)


def _eligible(value) -> bool:
    return isinstance(value, torch.Tensor) and value.is_floating_point() and value.dtype != torch.float64


def _dtype_given(func, args: tuple, kwargs: dict) -> bool:
    if kwargs.get("dtype") is not None:
        return True
    schema = getattr(func, "_schema", None)
    if schema is not None:
        names = [a.name for a in schema.arguments]
        return "dtype" in names and names.index("dtype") < len(args) and args[names.index("dtype")] is not None
    return any(isinstance(a, torch.dtype) for a in args)


class CudaAutocast(TorchFunctionMode):
    """CUDA's autocast to `dtype` (bfloat16 or float16) for the calls made under it (see the module docstring)."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.dtype = dtype
        self._cache: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id(leaf) -> (leaf, its low copy)

    def __exit__(self, *exc):
        self._cache.clear()  # autocast drops its weight copies when the autocast region ends
        return super().__exit__(*exc)

    def _cast(self, value, dtype: torch.dtype):
        if not _eligible(value) or value.dtype == dtype:
            return value
        cached = dtype == self.dtype and value.dtype == torch.float32 and value.requires_grad and value.is_leaf
        if cached and not value._is_view():
            found = self._cache.get(id(value))
            if found is None or found[0] is not value:
                found = self._cache[id(value)] = (value, value.to(dtype))
            return found[1]
        return value.to(dtype)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = op_name(func)
        if name in LOWER:
            args, kwargs = tree_map(lambda v: self._cast(v, self.dtype), (args, kwargs))
        elif name in FP32:
            args, kwargs = tree_map(lambda v: self._cast(v, torch.float32), (args, kwargs))
        elif name in FP32_OUTPUT:
            first = next((v for v in tree_flatten((args, kwargs))[0] if isinstance(v, torch.Tensor)), None)
            if _eligible(first) and not _dtype_given(func, args, kwargs):
                kwargs = {**kwargs, "dtype": torch.float32}
        elif name in PROMOTE:
            widest = self.dtype  # autocast starts from its own dtype
            for value in tree_flatten((args, kwargs))[0]:
                widest = torch.promote_types(widest, value.dtype) if _eligible(value) else widest
            args, kwargs = tree_map(lambda v: self._cast(v, widest), (args, kwargs))
        return func(*args, **kwargs)


@contextlib.contextmanager
def gpu_forward(semantics: GpuSemantics, autocast_dtype: torch.dtype | None):
    """What the analytic profiler runs a layer's forward under: CUDA's kernels where meta differs (`semantics`, a
    `GpuSemantics`) and, for the mixed precisions, CUDA's autocast (`CudaAutocast`, handling each call first)."""
    with semantics:
        if autocast_dtype is None:
            yield
        else:
            with CudaAutocast(autocast_dtype):
                yield
