"""Loads the compiled op library (fused_dense/_C*.so) into torch.ops.fused_dense."""
import glob
import os
import warnings

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


def has_cutlass_gemms() -> bool:
    """True when the build holds the library's cutlass_sm90 kernels for Hopper (sm_90a): the data
    gradient (gelu_approx or no activation) and the forward with gelu_approx, a bias and the saved
    pre-activation, which heuristic='auto' then also measures on compute capability 9.0 GPUs, and
    the FP8 fc1 forward (fp8_linear_act, both recipes)."""
    load_library()
    return bool(torch.ops.fused_dense.cutlass_gemms_compiled())


def has_own_gemm() -> bool:
    """Deprecated alias of :func:`has_cutlass_gemms`."""
    warnings.warn("fused_dense.has_own_gemm() is deprecated; use fused_dense.has_cutlass_gemms()",
                  DeprecationWarning, stacklevel=2)
    return has_cutlass_gemms()
