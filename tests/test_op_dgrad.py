"""act_linear_dgrad: d_input = (d_output @ weight) * act'(pre_act) and, on request, its column sums
(the previous layer's bias gradient) and act(pre_act) itself (return_act_out, for checkpoint level 1),
against a float64 reference. For relu, pre_act is the bit-mask linear_act saved.

Op contract and tolerances: docs/contract.md; references in tests/op_checks.py.
"""
import random

import pytest
import torch

from op_checks import (ACTS, CPU_DTYPES, CPU_HEURISTICS, CUDA_HEURISTICS, CUDA_SHAPES, HALF_DTYPES, check_dgrad,
                       check_dgrad_act_out, cpu_shapes)
from fused_dense import tuning


@pytest.mark.parametrize("dtype", CPU_DTYPES, ids=str)
@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("has_d_bias", [False, True])
def test_cpu_act_linear_dgrad(dtype, act, has_d_bias):
    for shape in cpu_shapes():
        check_dgrad("cpu", dtype, act, has_d_bias, random.choice(CPU_HEURISTICS), shape)


@pytest.mark.parametrize("dtype", CPU_DTYPES, ids=str)
@pytest.mark.parametrize("act", ["gelu_approx", "sqrelu"])
@pytest.mark.parametrize("has_d_bias", [False, True])
def test_cpu_act_linear_dgrad_act_out(dtype, act, has_d_bias):
    for shape in cpu_shapes():
        assert check_dgrad_act_out("cpu", dtype, act, has_d_bias, random.choice(CPU_HEURISTICS), shape)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("has_d_bias", [False, True])
def test_cpu_act_linear_dgrad_python_wrapper(dtype, act, has_d_bias):
    """fused_dense.ops.act_linear_dgrad (activation by name, heuristic 'auto')."""
    for shape in cpu_shapes():
        check_dgrad("cpu", dtype, act, has_d_bias, -2, shape, entry="py")


@pytest.mark.cuda
@pytest.mark.parametrize("heuristic", CUDA_HEURISTICS)
@pytest.mark.parametrize("has_d_bias", [False, True])
@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=str)
def test_cuda_act_linear_dgrad(dtype, act, has_d_bias, heuristic):
    for s in CUDA_SHAPES:
        check_dgrad("cuda", dtype, act, has_d_bias, heuristic, s, poison=True)


@pytest.mark.cuda
@pytest.mark.parametrize("heuristic", CUDA_HEURISTICS)
@pytest.mark.parametrize("has_d_bias", [False, True])
@pytest.mark.parametrize("act", ["gelu_approx", "sqrelu"])
@pytest.mark.parametrize("dtype", HALF_DTYPES + [torch.float32], ids=str)
def test_cuda_act_linear_dgrad_act_out(dtype, act, has_d_bias, heuristic):
    """With and without return_act_out the dgrad is one tuning problem (one key), so 'auto' runs the
    same algorithm for both. Unpaced here so that a key's choice is settled at its first call (a
    paced process may replace a provisional choice between two calls: docs/contract.md; the
    deterministic mode never does, tests/test_tuning_determinism.py)."""
    previous = tuning.configure(pace=1.0)
    try:
        ran = [check_dgrad_act_out("cuda", dtype, act, has_d_bias, heuristic, s, poison=True) for s in CUDA_SHAPES]
    finally:
        tuning.configure(**previous)
    if heuristic <= 0:
        assert all(ran)
