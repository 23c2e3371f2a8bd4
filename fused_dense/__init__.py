"""fused_dense: fused GEMM + bias + activation dense layers for PyTorch training."""
from ._loader import has_cuda_kernels, load_library

load_library()

from . import ops  # noqa: E402
from .functional import FusedDenseFunc, FusedMLPFunc, fused_dense_func, fused_mlp_func  # noqa: E402
from .modules import FusedDense, FusedMLP  # noqa: E402

__version__ = "0.1.0"
__all__ = [
    "ops",
    "has_cuda_kernels",
    "FusedDenseFunc",
    "FusedMLPFunc",
    "fused_dense_func",
    "fused_mlp_func",
    "FusedDense",
    "FusedMLP",
]
