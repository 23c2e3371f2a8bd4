"""fused_dense: fused GEMM + bias + activation dense layers for PyTorch training."""
from ._version import __version__
from ._abi import check_torch_version

check_torch_version()

from ._loader import has_cuda_kernels, has_cutlass_gemms, has_own_gemm, load_library  # noqa: E402

load_library()

from . import ops, tuning  # noqa: E402
from .fp8 import Float8Recipe, convert_to_fp8, fp8_autocast  # noqa: E402
from .functional import (FusedDenseFunc, FusedMLPFunc, fused_dense_func, fused_gated_mlp_func,  # noqa: E402
                         fused_mlp_func)
from .modules import (FusedDense, FusedGatedMLP, FusedMLP, FusedQKV, QKVPart, fuse_qkv_projections,  # noqa: E402
                      replace_llama_mlps)
from .convert import ConversionReport, convert_model  # noqa: E402
from .loss import FusedLinearCrossEntropyLoss, linear_cross_entropy  # noqa: E402
from .norm import FusedLayerNorm, FusedRMSNorm  # noqa: E402
from .causal_lm import use_fused_linear_cross_entropy  # noqa: E402

import torch.distributed as _dist  # noqa: E402

if _dist.is_available():  # tensor / sequence parallel layers (flash-attn exports them alongside)
    from .parallel import (ColumnParallelLinear, ParallelFusedGatedMLP, ParallelFusedMLP,  # noqa: E402
                           RowParallelLinear)

__all__ = [
    "ops",
    "tuning",
    "has_cuda_kernels",
    "has_cutlass_gemms",
    "FusedDenseFunc",
    "FusedMLPFunc",
    "fused_dense_func",
    "fused_mlp_func",
    "fused_gated_mlp_func",
    "FusedDense",
    "FusedMLP",
    "FusedGatedMLP",
    "FusedQKV",
    "QKVPart",
    "fuse_qkv_projections",
    "replace_llama_mlps",
    "convert_model",
    "ConversionReport",
    "linear_cross_entropy",
    "FusedLinearCrossEntropyLoss",
    "FusedLayerNorm",
    "FusedRMSNorm",
    "use_fused_linear_cross_entropy",
    "Float8Recipe",
    "fp8_autocast",
    "convert_to_fp8",
]
if _dist.is_available():
    __all__ += ["ColumnParallelLinear", "RowParallelLinear", "ParallelFusedMLP", "ParallelFusedGatedMLP"]
