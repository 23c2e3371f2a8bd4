"""Loads the compiled op library (fused_dense/_C*.so) into torch.ops.fused_dense."""
import glob
import os

import torch

_LOADED = False


def load_library():
    global _LOADED
    if _LOADED:
        return
    here = os.path.dirname(os.path.abspath(__file__))
    candidates = sorted(glob.glob(os.path.join(here, "_C*.so")) + glob.glob(os.path.join(here, "_C*.pyd")))
    if not candidates:
        raise ImportError(
            "fused_dense: the compiled extension fused_dense/_C*.so was not found next to "
            f"{here}; build it with `pip install --no-build-isolation -e .`"
        )
    torch.ops.load_library(candidates[0])
    _LOADED = True


def has_cuda_kernels() -> bool:
    """True when the extension was built with its CUDA kernels (not a CPU-only build)."""
    load_library()
    return torch._C._dispatch_has_kernel_for_dispatch_key("fused_dense::linear_act", "CUDA")


def has_own_gemm() -> bool:
    """True when the build holds fused_dense's own CUTLASS GEMMs for Hopper (sm_90a): the data
    gradient (gelu_approx or no activation) and the forward with gelu_approx, a bias and the saved
    pre-activation, which heuristic='auto' then also measures on compute capability 9.0 GPUs."""
    load_library()
    return bool(torch.ops.fused_dense.own_gemm_compiled())
