"""Large problems on the GPU: 2^20 token rows at d=1024 and tensors past 2^31 elements, for the
GELU / ReLU ops and the MLP, the gated ops and FP8 quantization and GEMM.

An [2^20, 4096] hidden activation holds 2^32 elements, so every index into it (the elementwise
kernels, the bit-mask, the bias-gradient reduction, cuBLASLt's leading dimensions times rows)
must be 64-bit. Each test compares the whole result with a float32 reference computed in row
chunks, so an element written to the wrong place (a wrapped 32-bit index) or never written
(outputs start NaN-poisoned) fails it. About 60 GiB of GPU memory at peak; skipped on cards with
less than 80 GiB. The FP8 tests skip below compute capability 8.9 (no FP8 there).
"""
import math

import pytest
import torch
import torch.nn.functional as F

import mlp_reference as R
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


fp8_gpu = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                             reason="FP8 needs a GPU of compute capability 8.9+")


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


# ---- the gated ops and FP8 past 2^31 elements ----

GATED_HIDDEN = 2056  # ROWS * GATED_HIDDEN = 2^31 + 2^23 elements; not a multiple of 16 units (a short
#                      interleave block at the end of each row)


def test_gated_ops_past_2_31_elements():
    """gated_linear (the packed gu [2^20, 4112] saved, act(g) * u [2^20, 2056]: 4.3e9 and 2.2e9
    elements) and gated_linear_dgrad (the packed d_gu and the rebuilt act(g) * u) against float32
    references over row chunks, the packed columns from tests/mlp_reference.py. About 40 GiB."""
    torch.manual_seed(3)
    dtype, k, n, h = torch.bfloat16, 64, 64, GATED_HIDDEN
    x = torch.randn(ROWS, k, device="cuda", dtype=dtype)
    w1 = torch.randn(2 * h, k, device="cuda", dtype=dtype) / math.sqrt(k)
    poison_cuda_cache(large_bytes=20 << 30)
    out, gu = ops.gated_linear(x, w1, "swiglu", True, "auto")
    torch.cuda.synchronize()
    assert out.numel() == ROWS * h > 2**31 and gu.shape == (ROWS, 2 * h)
    w2 = torch.randn(n, h, device="cuda", dtype=dtype) / math.sqrt(h)
    d_out = torch.randn(ROWS, n, device="cuda", dtype=dtype)
    poison_cuda_cache(large_bytes=20 << 30)
    d_gu, act_out = torch.ops.fused_dense.gated_linear_dgrad(w2, d_out, gu, 4, -2, True)
    torch.cuda.synchronize()
    gate, up = (torch.tensor(c, device="cuda") for c in R.gated_columns(h))
    errs = {name: _ErrAccumulator() for name in ("gu", "out", "d_gu", "act_out")}
    w1f, w2f = w1.float(), w2.float()
    for r0 in range(0, ROWS, CHUNK):
        rows = slice(r0, r0 + CHUNK)
        gu_ref = x[rows].float() @ w1f.t()
        errs["gu"].add(gu[rows], gu_ref)
        errs["out"].add(out[rows], R.act(gu_ref[:, gate], "swiglu") * gu_ref[:, up])
        # the backward from the saved (rounded) gu, as the op computes it
        g = gu[rows][:, gate].float().requires_grad_()
        u = gu[rows][:, up].float().requires_grad_()
        hidden = R.act(g, "swiglu") * u
        d_g, d_u = torch.autograd.grad(hidden, [g, u], d_out[rows].float() @ w2f)
        d_ref = torch.empty_like(gu_ref)
        d_ref[:, gate], d_ref[:, up] = d_g, d_u
        errs["d_gu"].add(d_gu[rows], d_ref)
        errs["act_out"].add(act_out[rows], hidden.detach())
    for name, e in errs.items():
        assert e.rel() <= TOL[dtype], f"{name}: relative error {e.rel():.3e}"


@fp8_gpu
def test_fp8_quantize_past_2_31_elements():
    """fp8_quantize of a bf16 [2^20 + 48, 2056] tensor (2.2e9 elements), current scaling, row- and
    column-wise: amax exact, the column-wise copy the row-wise bytes transposed, and the bytes
    within e4m3's rounding (unit roundoff 2^-4) of the scaled input. About 10 GiB."""
    torch.manual_seed(4)
    rows, cols = ROWS + 48, 2056
    assert rows * cols > 2**31
    x = torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16)
    poison_cuda_cache(large_bytes=8 << 30)
    data, data_t, scale, scale_inv, amax, _ = torch.ops.fused_dense.fp8_quantize(
        x, None, 0, False, 0, None, True, True, False)
    torch.cuda.synchronize()
    assert data.shape == (rows, cols) and data_t.shape[0] == cols and data_t.shape[1] >= rows
    assert amax.item() == x.abs().max().float().item()
    err = _ErrAccumulator()
    for r0 in range(0, rows, CHUNK):
        r = slice(r0, r0 + CHUNK)
        assert torch.equal(data_t[:, r].view(torch.uint8), data[r].t().view(torch.uint8)), f"rows {r0}: data_t"
        err.add(data[r].float(), x[r].float() * scale.float())
    assert err.rel() <= 2.0 ** -4, f"data: relative error {err.rel():.3e} > e4m3's unit roundoff"


@fp8_gpu
def test_fp8_linear_and_gated_quantize_past_2_31_elements():
    """fp8_linear writing a bf16 [2^20, 2064] output (2.2e9 elements) and fp8_quantize of the swiglu
    gating of a packed gu [2^20, 4112] (act(g) * u quantized, [2^20, 2056] bytes), against float32
    references over row chunks. About 30 GiB."""
    torch.manual_seed(5)
    q = torch.ops.fused_dense.fp8_quantize
    k, n = 64, 2064
    xq, _, _, x_si, _, _ = q(torch.randn(ROWS, k, device="cuda"), None, 0, False, 0, None, True, False, False)
    wq, _, _, w_si, _, _ = q(torch.randn(n, k, device="cuda") / math.sqrt(k), None, 0, False, 0, None, True, False,
                             False)
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    poison_cuda_cache(large_bytes=20 << 30)
    out = torch.ops.fused_dense.fp8_linear(xq, wq, x_si, w_si, bias, torch.bfloat16, False, -2)
    torch.cuda.synchronize()
    assert out.shape == (ROWS, n) and out.numel() > 2**31
    err = _ErrAccumulator()
    wf = wq.float() * w_si
    for r0 in range(0, ROWS, CHUNK):
        r = slice(r0, r0 + CHUNK)
        err.add(out[r], (xq[r].float() * x_si) @ wf.t() + bias.float())
    assert err.rel() <= TOL[torch.bfloat16], f"fp8_linear: relative error {err.rel():.3e}"
    del out

    h = GATED_HIDDEN
    gu = torch.randn(ROWS, 2 * h, device="cuda", dtype=torch.bfloat16)
    poison_cuda_cache(large_bytes=8 << 30)
    data, _, scale, _, amax, _ = q(gu, None, 4, False, 0, None, True, False, False)
    torch.cuda.synchronize()
    assert data.shape == (ROWS, h) and data.numel() > 2**31
    gate, up = (torch.tensor(c, device="cuda") for c in R.gated_columns(h))
    err, ref_amax = _ErrAccumulator(), 0.0
    for r0 in range(0, ROWS, CHUNK):
        r = slice(r0, r0 + CHUNK)
        gated = R.act(gu[r][:, gate].float(), "swiglu") * gu[r][:, up].float()
        ref_amax = max(ref_amax, gated.abs().max().item())
        err.add(data[r].float(), gated * scale.float())
    assert err.rel() <= 2.0 ** -4, f"gated fp8_quantize: relative error {err.rel():.3e} > e4m3's unit roundoff"
    assert abs(amax.item() - ref_amax) <= 1e-5 * ref_amax, (amax.item(), ref_amax)
