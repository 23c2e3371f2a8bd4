"""linear_bias_wgrad: d_weight = d_output.T @ input and, on request, d_bias = d_output.sum(0), against
a float64 reference; an empty batch gives zero gradients.

Op contract and tolerances: docs/contract.md; references in tests/op_checks.py.
"""
import pytest
import torch

from op_checks import CPU_DTYPES, CUDA_SHAPES, HALF_DTYPES, check_wgrad, cpu_shapes


@pytest.mark.parametrize("dtype", CPU_DTYPES, ids=str)
@pytest.mark.parametrize("has_d_bias", [False, True])
def test_cpu_linear_bias_wgrad(dtype, has_d_bias):
    for shape in cpu_shapes():
        check_wgrad("cpu", dtype, has_d_bias, shape)


@pytest.mark.parametrize("has_d_bias", [False, True])
def test_cpu_linear_bias_wgrad_python_wrapper(has_d_bias):
    """fused_dense.ops.linear_bias_wgrad always returns (d_weight, d_bias or None)."""
    for shape in cpu_shapes():
        check_wgrad("cpu", torch.float32, has_d_bias, shape, entry="py")


@pytest.mark.cuda
@pytest.mark.parametrize("has_d_bias", [False, True])
@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=str)
def test_cuda_linear_bias_wgrad(dtype, has_d_bias):
    for s in CUDA_SHAPES:
        check_wgrad("cuda", dtype, has_d_bias, s, poison=True)
