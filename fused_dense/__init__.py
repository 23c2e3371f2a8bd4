"""fused_dense: fused GEMM + bias + activation dense layers for PyTorch training."""
from ._loader import has_cuda_kernels, has_own_gemm, load_library

load_library()

from . import ops  # noqa: E402
from .functional import FusedDenseFunc, FusedMLPFunc, fused_dense_func, fused_mlp_func  # noqa: E402
from .modules import FusedDense, FusedMLP  # noqa: E402

import torch.distributed as _dist  # noqa: E402

if _dist.is_available():  # tensor / sequence parallel layers (flash-attn exports them alongside)
    from .parallel import ColumnParallelLinear, ParallelFusedMLP, RowParallelLinear  # noqa: E402

__version__ = "0.1.0"
__all__ = [
    "ops",
    "has_cuda_kernels",
    "has_own_gemm",
    "FusedDenseFunc",
    "FusedMLPFunc",
    "fused_dense_func",
    "fused_mlp_func",
    "FusedDense",
    "FusedMLP",
]
if _dist.is_available():
    __all__ += ["ColumnParallelLinear", "RowParallelLinear", "ParallelFusedMLP"]
