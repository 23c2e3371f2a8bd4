"""Empty batches and non-finite inputs through the modules: B=0 gives empty outputs and zero
parameter gradients; NaN / Inf propagate to exactly the output elements plain PyTorch makes
non-finite. CPU in CI; the same checks on CUDA (marked) for fp16 / bf16."""
import math

import pytest
import torch
import torch.nn.functional as F

from fused_dense import FusedDense, FusedMLP, ops

from conftest import TOL

ACTS = {"gelu_approx": lambda t: F.gelu(t, approximate="tanh"), "relu": F.relu, "sqrelu": lambda t: F.relu(t).square()}


def plain_mlp(m, x, activation):
    """The same MLP in float64 from m's parameters."""
    def lin(layer, t):
        return F.linear(t, layer.weight.double(), layer.bias.double())
    return lin(m.fc2, ACTS[activation](lin(m.fc1, x.double())))


def check_empty_batch(device, dtype, activation):
    m = FusedMLP(16, 64, activation=activation, device=device, dtype=dtype)
    x = torch.randn(0, 16, device=device, dtype=dtype, requires_grad=True)
    y = m(x)
    assert y.shape == (0, 16)
    y.sum().backward()
    assert x.grad.shape == (0, 16)
    for name, p in m.named_parameters():
        assert p.grad is not None and torch.count_nonzero(p.grad) == 0, f"{name}.grad must be zero for an empty batch"
    d = FusedDense(16, 8, device=device, dtype=dtype)
    z = d(torch.randn(2, 0, 16, device=device, dtype=dtype))
    assert z.shape == (2, 0, 8)


def check_non_finite(device, dtype, activation):
    m = FusedMLP(16, 64, activation=activation, device=device, dtype=dtype)
    x = torch.randn(4, 16, device=device, dtype=dtype)
    x[0, 3] = float("nan")
    x[2, 5] = float("inf")
    y = m(x)
    with torch.no_grad():
        ref = plain_mlp(m, x, activation)
    assert torch.equal(torch.isnan(y), torch.isnan(ref)), "NaN pattern differs from plain PyTorch"
    assert torch.equal(torch.isfinite(y), torch.isfinite(ref)), "finite pattern differs from plain PyTorch"
    assert torch.isfinite(y[1]).all() and torch.isfinite(y[3]).all(), "rows without NaN/Inf must stay finite"


def gelu_derivative_limits(p):
    """GELU (tanh) derivative in float64 with its limits 1 and 0 beyond |p| = 20 (the plain formula
    takes 0 * inf there); NaN stays NaN."""
    k, c = math.sqrt(2 / math.pi), 0.044715
    q = p.clamp(-20, 20)
    t = torch.tanh(k * (q + c * q ** 3))
    return 0.5 * (1 + t) + 0.5 * q * (1 - t * t) * k * (1 + 3 * c * q * q)


FAR_PRE_ACTS = [12.0, -12.0, 1e4, -1e4, 1e30, -1e30, float("inf"), float("-inf")]


def check_gelu_dgrad_far_pre_acts(device, dtype, heuristic):
    """The GELU data gradient at pre-activations where the derivative's factors saturate gives the
    limits (d_input = d_act there, or 0), and a NaN pre-activation makes exactly its own element of
    d_input and its column of the bias gradient NaN."""
    B, N, K = 64, 32, 48  # d_output [B, N], weight [N, K], pre_act [B, K]
    w = torch.randn(N, K, device=device, dtype=dtype) / N ** 0.5
    dy = torch.randn(B, N, device=device, dtype=dtype)
    pre = torch.randn(B, K, device=device, dtype=dtype)
    flat = pre.view(-1)
    for i, v in enumerate(FAR_PRE_ACTS * 4):
        flat[37 * i + 3] = v  # spread over rows and columns
    pre[5, 7] = float("nan")
    d_in, d_b = ops.act_linear_dgrad(w, dy, pre, "gelu_approx", True, heuristic)
    ref = (dy.double() @ w.double()) * gelu_derivative_limits(pre.double())
    nan_expected = torch.zeros(B, K, dtype=torch.bool, device=device)
    nan_expected[5, 7] = True
    assert torch.equal(torch.isnan(d_in), nan_expected), "NaN must appear exactly where the pre-activation is NaN"
    assert torch.isfinite(d_in[~nan_expected]).all(), "far pre-activations must give the finite limits"
    ok = ~nan_expected
    err = ((d_in.double() - ref)[ok].norm() / ref[ok].norm()).item()
    assert err <= TOL[dtype], f"d_input relative error {err:.2e} > {TOL[dtype]:.0e}"
    far = torch.isinf(pre) | (pre.abs() > 20)
    assert far.sum() >= 16
    # far above 0, d_input is the GEMM result (up to its rounding); far below, 0 (fp64: ~1e-60)
    d_act = dy.double() @ w.double()
    eps = torch.finfo(dtype).eps
    up, down = far & (pre > 0), far & (pre < 0)
    torch.testing.assert_close(d_in.double()[up], d_act[up], rtol=2 * eps, atol=4 * eps * d_act.abs().max().item())
    assert d_in[down].abs().max().item() <= 1e-30, "the limit far below 0 is 0"
    col_nan = torch.isnan(d_b)
    assert col_nan[7] and col_nan.sum() == 1, "only the NaN's column of the bias gradient is NaN"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_gelu_dgrad_far_pre_acts_cpu(dtype):
    check_gelu_dgrad_far_pre_acts("cpu", dtype, -1)


@pytest.mark.parametrize("activation", list(ACTS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_empty_batch_cpu(dtype, activation):
    check_empty_batch("cpu", dtype, activation)


@pytest.mark.parametrize("activation", list(ACTS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_non_finite_cpu(dtype, activation):
    check_non_finite("cpu", dtype, activation)


@pytest.mark.cuda
@pytest.mark.parametrize("activation", list(ACTS))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_empty_batch_cuda(dtype, activation):
    check_empty_batch("cuda", dtype, activation)


@pytest.mark.cuda
@pytest.mark.parametrize("activation", list(ACTS))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_non_finite_cuda(dtype, activation):
    check_non_finite("cuda", dtype, activation)


# -1: the elementwise kernel after the GEMM (the derivative the cutlass_sm90 data-gradient epilogue
# shares); the cuBLASLt DGELU epilogue (heuristic >= 0) is NVIDIA's formula and not covered here.
@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_gelu_dgrad_far_pre_acts_cuda(dtype):
    check_gelu_dgrad_far_pre_acts("cuda", dtype, -1)
