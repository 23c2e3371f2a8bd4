"""float32 and float64 on CUDA: the three GEMM ops give float64-reference results at their dtype's
tolerance (docs/contract.md) with TF32 off, and fp32 follows torch.backends.cuda.matmul.allow_tf32
(with it on, the error is TF32-sized, judged at the bf16 tolerance).
"""
import math

import pytest
import torch

from op_checks import ACT_CODE, ACTS, CUDA_SHAPES, OPS, check_dgrad, check_forward, check_wgrad, forward_cases, \
    randn, ref_act, ref_pre, shape_id
from conftest import TOL, assert_close_rel


@pytest.mark.cuda
@pytest.mark.parametrize("s", CUDA_SHAPES[:7], ids=shape_id)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_cuda_fp32_fp64(dtype, s, no_tf32):
    for act, has_bias, save in forward_cases():
        for h in (-2, -1, 0, 1):
            check_forward("cuda", dtype, act, has_bias, save, h, s, poison=True)
    for act in ACTS:
        for h in (-2, -1, 0, 1):
            check_dgrad("cuda", dtype, act, True, h, s, poison=True)
    check_wgrad("cuda", dtype, True, s, poison=True)


@pytest.mark.cuda
def test_cuda_fp32_allow_tf32():
    """fp32 follows torch's allow_tf32 flag; with TF32 on, the error is TF32-sized (bf16 tolerance)."""
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        for s in [(256, 1024, 1024), (17, 136, 33)]:
            B, K, N = s
            x = randn(B, K, dtype=torch.float32, device="cuda")
            w = randn(N, K, dtype=torch.float32, device="cuda", scale=1 / math.sqrt(K))
            out, = OPS.linear_act(x, w, None, ACT_CODE["gelu_approx"], False, -2)
            assert_close_rel(out, ref_act(ref_pre(x, w, None), "gelu_approx"), tol=TOL[torch.bfloat16])
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old
