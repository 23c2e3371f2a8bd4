"""act_forward: the activation alone, elementwise, on a tensor of any shape (what checkpoint level 1
recomputes from the saved pre-activation), against the float64 activation.

Op contract and tolerances: docs/contract.md; references in tests/op_checks.py.
"""
import pytest
import torch

from op_checks import ACT_CODE, ACT_FORWARD_SHAPES, ACTS, CPU_DTYPES, OPS, check_act_forward, randn


@pytest.mark.parametrize("dtype", CPU_DTYPES, ids=str)
@pytest.mark.parametrize("act", ACTS)
def test_cpu_act_forward(dtype, act):
    for shape in ACT_FORWARD_SHAPES:
        check_act_forward("cpu", dtype, act, shape)


@pytest.mark.parametrize("act", ACTS)
def test_cpu_act_forward_python_wrapper(act):
    for shape in ACT_FORWARD_SHAPES:
        check_act_forward("cpu", torch.float32, act, shape, entry="py")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_cpu_act_forward_none_is_fresh(dtype):
    """act_forward(x, 0) is the identity but, as its schema says, returns a new tensor."""
    pre = randn(3, 4, dtype=dtype)
    y = OPS.act_forward(pre, ACT_CODE["none"])
    assert torch.equal(y, pre)
    assert y.data_ptr() != pre.data_ptr(), "act_forward(pre, 0) returned pre_act itself"


@pytest.mark.cuda
@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
def test_cuda_act_forward(dtype, act):
    for shape in ACT_FORWARD_SHAPES + [(1000, 1024), (17, 136), (3, 1, 33), (1 << 20,)]:
        for offset in (0, 1, 3):  # storage offsets break 16-byte alignment of the vectorized kernel
            check_act_forward("cuda", dtype, act, shape, poison=True, offset=offset)
