"""Large problems on the GPU: 2^20 token rows at d=1024 and tensors past 2^31 elements.

An [2^20, 4096] hidden activation holds 2^32 elements, so every index into it (the elementwise
kernels, the bit-mask, the bias-gradient reduction, cuBLASLt's leading dimensions times rows)
must be 64-bit. Each test compares the whole result with a float32 reference computed in row
chunks, so an element written to the wrong place (a wrapped 32-bit index) or never written
(outputs start NaN-poisoned) fails it. About 60 GiB of GPU memory at peak; skipped on cards with
less than 80 GiB.
"""
import math

import pytest
import torch
import torch.nn.functional as F

from conftest import TOL, poison_cuda_cache
from fused_dense import ops
from fused_dense.functional import fused_mlp_func

pytestmark = pytest.mark.cuda

ROWS = 1 << 20
D = 1024
HIDDEN = 4096  # ROWS * HIDDEN = 2^32 elements
CHUNK = 1 << 16


@pytest.fixture(autouse=True)
def _needs_big_gpu():
    free, total = torch.cuda.mem_get_info()
    if total < (80 << 30):
        pytest.skip(f"needs a GPU with >= 80 GiB (this one has {total / 2**30:.0f} GiB)")
    yield
    torch.cuda.empty_cache()


def _act(h, activation):
    return F.gelu(h, approximate="tanh") if activation == "gelu_approx" else F.relu(h)


class _ErrAccumulator:
    """||out - ref||^2 and ||ref||^2 summed over chunks, in float64."""

    def __init__(self):
        self.num = 0.0
        self.den = 0.0

    def add(self, out, ref):
        o = out.double()
        r = ref.double()
        assert torch.isfinite(o).all(), "non-finite element (unwritten / poisoned output?)"
        self.num += torch.sum((o - r) ** 2).item()
        self.den += torch.sum(r * r).item()

    def rel(self):
        return math.sqrt(self.num / self.den)


@pytest.mark.parametrize("activation", ["gelu_approx", "relu"])
@pytest.mark.parametrize("heuristic", [-1, 0, "auto"])
def test_linear_act_forward_past_2_31_elements(activation, heuristic):
    torch.manual_seed(0)
    dtype = torch.bfloat16
    x = torch.randn(ROWS, D, device="cuda", dtype=dtype)
    w = torch.randn(HIDDEN, D, device="cuda", dtype=dtype) / math.sqrt(D)
    b = torch.randn(HIDDEN, device="cuda", dtype=dtype)
    poison_cuda_cache(large_bytes=20 << 30)
    out, pre = ops.linear_act(x, w, b, activation, True, heuristic)
    torch.cuda.synchronize()
    assert out.numel() == ROWS * HIDDEN > 2**31
    err_out, err_pre, mask_bad = _ErrAccumulator(), _ErrAccumulator(), 0
    w32, b32 = w.float(), b.float()
    for r0 in range(0, ROWS, CHUNK):
        h = torch.addmm(b32, x[r0:r0 + CHUNK].float(), w32.t())
        err_out.add(out[r0:r0 + CHUNK], _act(h, activation))
        if activation == "gelu_approx":
            err_pre.add(pre[r0:r0 + CHUNK], h)
        else:
            # the bit-mask: bit set iff pre_act >= 0; compare only where the reference sign is
            # clear of bf16 rounding of the fp32 accumulator
            bits = torch.arange(8, device="cuda", dtype=torch.uint8)
            unpacked = ((pre[r0:r0 + CHUNK].unsqueeze(-1) >> bits) & 1).reshape(CHUNK, -1)[:, :HIDDEN]
            clear = h.abs() > 1e-2 * h.abs().mean()
            mask_bad += int(((unpacked.bool() != (h >= 0)) & clear).sum().item())
    assert err_out.rel() <= TOL[dtype], f"out: relative error {err_out.rel():.3e}"
    if activation == "gelu_approx":
        assert err_pre.rel() <= TOL[dtype], f"pre_act: relative error {err_pre.rel():.3e}"
    else:
        assert pre.shape == (ROWS, HIDDEN // 8) and pre.dtype == torch.uint8
        assert mask_bad == 0, f"{mask_bad} ReLU mask bits disagree with the reference sign"


def test_act_forward_past_2_31_elements():
    """The elementwise kernel alone on 2^31 + 3 * 2^20 + 5 elements (odd tail)."""
    torch.manual_seed(1)
    rows, cols = (1 << 20) + 1537, 2051  # rows * cols > 2^31, neither a multiple of 8
    assert rows * cols > 2**31
    pre = torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16)
    poison_cuda_cache(large_bytes=8 << 30)
    out = ops.act_forward(pre, "gelu_approx")
    torch.cuda.synchronize()
    err = _ErrAccumulator()
    for r0 in range(0, rows, CHUNK):
        p = pre[r0:r0 + CHUNK].float()
        err.add(out[r0:r0 + CHUNK], F.gelu(p, approximate="tanh"))
    assert err.rel() <= TOL[torch.bfloat16], f"relative error {err.rel():.3e}"


@pytest.mark.parametrize("activation", ["gelu_approx", "relu"])
def test_fused_mlp_forward_backward_2_20_tokens(activation):
    """FusedMLP's function, d=1024, hidden 4096, 2^20 tokens: output and all five gradients
    against a float32 reference accumulated over row chunks."""
    torch.manual_seed(2)
    dtype = torch.bfloat16
    x = torch.randn(ROWS, D, device="cuda", dtype=dtype, requires_grad=True)
    w1 = (torch.randn(HIDDEN, D, device="cuda", dtype=dtype) / math.sqrt(D)).requires_grad_()
    b1 = torch.randn(HIDDEN, device="cuda", dtype=dtype, requires_grad=True)
    w2 = (torch.randn(D, HIDDEN, device="cuda", dtype=dtype) / math.sqrt(HIDDEN)).requires_grad_()
    b2 = torch.randn(D, device="cuda", dtype=dtype, requires_grad=True)
    g = torch.randn(ROWS, D, device="cuda", dtype=dtype)
    out = fused_mlp_func(x, w1, w2, b1, b2, activation=activation, heuristic="auto")
    out.backward(g)
    torch.cuda.synchronize()

    w1f, b1f, w2f, b2f = w1.detach().float(), b1.detach().float(), w2.detach().float(), b2.detach().float()
    gw1 = torch.zeros_like(w1f)
    gb1 = torch.zeros_like(b1f)
    gw2 = torch.zeros_like(w2f)
    gb2 = torch.zeros_like(b2f)
    e_out, e_dx = _ErrAccumulator(), _ErrAccumulator()
    for r0 in range(0, ROWS, CHUNK):
        xc = x.detach()[r0:r0 + CHUNK].float().requires_grad_()
        gc = g[r0:r0 + CHUNK].float()
        h = torch.addmm(b1f, xc, w1f.t())
        hr = h.detach().requires_grad_()
        a = _act(hr, activation)
        y = torch.addmm(b2f, a, w2f.t())
        e_out.add(out.detach()[r0:r0 + CHUNK], y)
        gb2 += gc.sum(0)
        gw2 += gc.t() @ a.detach()
        (dh,) = torch.autograd.grad(a, hr, gc @ w2f)
        gb1 += dh.sum(0)
        gw1 += dh.t() @ xc.detach()
        e_dx.add(x.grad[r0:r0 + CHUNK], dh @ w1f)
    tol = TOL[dtype]
    assert e_out.rel() <= tol, f"out: relative error {e_out.rel():.3e}"
    assert e_dx.rel() <= tol, f"grad x: relative error {e_dx.rel():.3e}"
    for name, got, ref in (("w1", w1.grad, gw1), ("b1", b1.grad, gb1), ("w2", w2.grad, gw2), ("b2", b2.grad, gb2)):
        e = _ErrAccumulator()
        e.add(got, ref)
        assert e.rel() <= tol, f"grad {name}: relative error {e.rel():.3e}"
