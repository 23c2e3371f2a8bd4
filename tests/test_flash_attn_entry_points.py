"""The flash-attn compatible entry points: torch.ops.fused_dense.linear_act_forward and
bias_act_linear_dgrad_bgrad (GELU when is_gelu, else ReLU with a bit-mask; the dgrad always returns
the bias gradient), and the fused_dense_lib module (linear_act_forward, linear_bias_wgrad,
bias_act_linear_dgrad_bgrad) with flash-attn's fused_dense_lib signatures. Each must give what the
general ops give, against the same float64 references (tests/op_checks.py; docs/contract.md).
"""
import random

import pytest
import torch

import fused_dense
import fused_dense_lib
from fused_dense import ops

from op_checks import CPU_DTYPES, CUDA_HEURISTICS, CUDA_SHAPES, HALF_DTYPES, check_dgrad, check_forward, \
    check_wgrad, cpu_shapes


@pytest.mark.parametrize("dtype", CPU_DTYPES, ids=str)
@pytest.mark.parametrize("is_gelu", [True, False])
@pytest.mark.parametrize("save", [False, True])
@pytest.mark.parametrize("has_bias", [False, True])
@pytest.mark.parametrize("entry", ["flash_attn", "lib"])
def test_cpu_flash_attn_forward(dtype, is_gelu, save, has_bias, entry):
    act = "gelu_approx" if is_gelu else "relu"
    for shape in cpu_shapes():
        check_forward("cpu", dtype, act, has_bias, save, random.choice([-1, 0, 1]), shape, entry=entry)


@pytest.mark.parametrize("dtype", CPU_DTYPES, ids=str)
@pytest.mark.parametrize("act", ["gelu_approx", "relu"])
@pytest.mark.parametrize("entry", ["flash_attn", "lib"])
def test_cpu_flash_attn_dgrad(dtype, act, entry):
    for shape in cpu_shapes():
        check_dgrad("cpu", dtype, act, True, random.choice([-1, 0, 1]), shape, entry=entry)


@pytest.mark.parametrize("has_d_bias", [False, True])
def test_cpu_fused_dense_lib_wgrad(has_d_bias):
    """fused_dense_lib.linear_bias_wgrad always returns (d_weight, d_bias or None)."""
    for shape in cpu_shapes():
        check_wgrad("cpu", torch.float32, has_d_bias, shape, entry="lib")


def test_library_surface():
    assert fused_dense_lib.__all__ == ["linear_act_forward", "linear_bias_wgrad", "bias_act_linear_dgrad_bgrad"]
    assert ops.activation_code("gelu_approx") == 1 and ops.heuristic_code("auto") == -2
    assert ops.heuristic_code(-1) == -1 and ops.heuristic_code(4) == 4
    assert ops.relu_mask_row_bytes(0) == 0 and ops.relu_mask_row_bytes(9) == 2
    assert isinstance(fused_dense.has_cuda_kernels(), bool)


@pytest.mark.cuda
@pytest.mark.parametrize("heuristic", CUDA_HEURISTICS)
@pytest.mark.parametrize("save", [False, True])
@pytest.mark.parametrize("is_gelu", [True, False])
@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=str)
def test_cuda_flash_attn_entry_points(dtype, is_gelu, save, heuristic):
    act = "gelu_approx" if is_gelu else "relu"
    for i, s in enumerate(CUDA_SHAPES[:6]):
        entry = ("flash_attn", "lib")[i % 2]
        check_forward("cuda", dtype, act, i % 3 != 0, save, heuristic, s, entry=entry, poison=True)
        check_dgrad("cuda", dtype, act, True, heuristic, s, entry=entry, poison=True)
    for s in CUDA_SHAPES[:4]:
        check_wgrad("cuda", dtype, True, s, entry="lib", poison=True)
        check_wgrad("cuda", dtype, False, s, entry="lib", poison=True)
