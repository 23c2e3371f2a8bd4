"""Empty batches and non-finite inputs through the modules: B=0 gives empty outputs and zero
parameter gradients; NaN / Inf propagate to exactly the output elements plain PyTorch makes
non-finite. CPU in CI; the same checks on CUDA (marked) for fp16 / bf16."""
import pytest
import torch
import torch.nn.functional as F

from fused_dense import FusedDense, FusedMLP

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
