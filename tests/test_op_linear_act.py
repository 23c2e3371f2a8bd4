"""linear_act (torch.ops.fused_dense.linear_act and fused_dense.ops.linear_act): out = act(x @ w.T + b),
optionally with the pre-activation saved (a ReLU bit-mask for relu), against a float64 reference.

Op contract and tolerances: docs/contract.md. CUDA tests poison the allocator before each call, so an
output element the op never writes shows up as NaN (tests/op_checks.py has the references).
"""
import random

import pytest
import torch

from op_checks import (ACT_CODE, CPU_DTYPES, CPU_HEURISTICS, CUDA_HEURISTICS, CUDA_SHAPES, HALF_DTYPES, OPS,
                       check_forward, cpu_shapes, forward_cases, randn)


@pytest.mark.parametrize("dtype", CPU_DTYPES, ids=str)
@pytest.mark.parametrize("act,has_bias,save", list(forward_cases()))
def test_cpu_linear_act(dtype, act, has_bias, save):
    for shape in cpu_shapes():
        check_forward("cpu", dtype, act, has_bias, save, random.choice(CPU_HEURISTICS), shape)


@pytest.mark.parametrize("dtype", CPU_DTYPES, ids=str)
@pytest.mark.parametrize("act", ["gelu_approx", "relu"])
@pytest.mark.parametrize("save", [False, True])
@pytest.mark.parametrize("has_bias", [False, True])
def test_cpu_linear_act_python_wrapper(dtype, act, save, has_bias):
    """fused_dense.ops.linear_act (activation by name) returns what the op returns."""
    for shape in cpu_shapes():
        check_forward("cpu", dtype, act, has_bias, save, random.choice([-1, 0, 1]), shape, entry="py")


def test_cpu_outputs_are_fresh_tensors():
    """Outputs never alias inputs or each other (the autograd layer saves them)."""
    x, w, b = randn(4, 8, dtype=torch.float32), randn(6, 8, dtype=torch.float32), randn(6, dtype=torch.float32)
    out, pre = OPS.linear_act(x, w, b, ACT_CODE["gelu_approx"], True, -1)
    assert out.data_ptr() != pre.data_ptr()
    for act in ("gelu_approx", "relu", "sqrelu"):
        assert OPS.act_forward(pre, ACT_CODE[act]).data_ptr() != pre.data_ptr()
    y = OPS.act_forward(pre.half(), ACT_CODE["none"])
    assert torch.equal(y, pre.half())


@pytest.mark.cuda
@pytest.mark.parametrize("heuristic", CUDA_HEURISTICS)
@pytest.mark.parametrize("act,has_bias,save", list(forward_cases()))
@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=str)
def test_cuda_linear_act(dtype, act, has_bias, save, heuristic):
    ran = [check_forward("cuda", dtype, act, has_bias, save, heuristic, s, poison=True) for s in CUDA_SHAPES]
    if heuristic <= 0:
        assert all(ran)
