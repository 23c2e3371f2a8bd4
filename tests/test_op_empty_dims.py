"""Empty dimensions on CUDA: B = 0 gives empty outputs and zero weight / bias gradients, K = 0 a
zero GEMM (out = act(bias)), N = 0 empty outputs, through every activation and path of the three
GEMM ops (the CPU tests of each op include these shapes; tests/op_checks.py has the references).
"""
import pytest
import torch

from op_checks import ACTS, CUDA_EDGE_SHAPES, HALF_DTYPES, check_dgrad, check_forward, check_wgrad, forward_cases, \
    shape_id


# One test per shape (not a loop inside one): each stays short enough to finish under
# compute-sanitizer's racecheck and synccheck, and a failure names its shape.
@pytest.mark.cuda
@pytest.mark.parametrize("s", CUDA_EDGE_SHAPES, ids=shape_id)
@pytest.mark.parametrize("dtype", HALF_DTYPES + [torch.float32], ids=str)
def test_cuda_edge_shapes(dtype, s, no_tf32):
    """B = 0 gives empty outputs and zero bias gradients; K = 0 and N = 0 are handled."""
    for act, has_bias, save in forward_cases():
        check_forward("cuda", dtype, act, has_bias, save, -2, s, poison=True)
        check_forward("cuda", dtype, act, has_bias, save, -1, s, poison=True)
    for act in ACTS:
        for h in (-2, -1, 0):
            check_dgrad("cuda", dtype, act, True, h, s, poison=True)
    check_wgrad("cuda", dtype, True, s, poison=True)
    check_wgrad("cuda", dtype, False, s, poison=True)
