"""FP8: the ops fp8_quantize, fp8_linear and fp8_linear_act, the FP8 autograd of FusedMLP and FusedDense, the
recipes and the ways in (fused_dense/fp8.py).

References are float64 computations of the same quantized computation: the same scale rule
(fp8_max / max(amax, 1e-12) in float32), the same FP8 rounding of the same values, the GEMM
outputs rounded to the model dtype where the op rounds them (fc1's pre-activation, fc2's data
gradient). What still differs is where a value lies within rounding distance of an FP8 or bf16
rounding boundary: the op's accumulation rounds some pre-activations to the neighbouring bf16
value, and a sixteenth of those (the bf16 / e4m3 spacing ratio, 2^-8 / 2^-4) then quantize to the
neighbouring FP8 value, 12.5% (e4m3) or 25% (e5m2) off for that element.

* CUDA (the forward GEMMs use Hopper's fast FP8 accumulation, which moves many pre-activations):
  measured over repeated runs with fresh data on the H200, up to 2.3e-2 for outputs and e4m3
  gradients (a ReLU MLP's output), 3.0e-2 for e5m2 gradients (one row of 64 units, where one flip
  is a visible share of the norm); FP8_TOL = 4e-2 and FP8_TOL_E5M2 = 6e-2 leave a factor of about 2.
* CPU (float32 accumulation, float64 here): the results' own rounding to bf16 (2^-9 relative at
  most) and the rare flip; FP8_CPU_TOL below. A skipped quantization moves a result by 1.6e-2 or
  more (test_fp8_numerics.py's negative controls), so the CPU tolerance sees it; the CUDA ones
  do not, and the CPU run is what judges the computation.

The ops' own roundings are checked bit for bit where they are deterministic (the quantized
bytes, the scales, the amax: here and in test_fp8_numerics.py).
"""
import gc
import math
import weakref

import pytest
import torch

import fused_dense
from conftest import poison_cuda_cache, rel_err, saved_tensors
from fused_dense import Float8Recipe, FusedDense, FusedGatedMLP, FusedMLP

FP8_TOL = 4e-2
# A gradient quantized to e5m2 (2 mantissa bits, twice e4m3's spacing) is off by 25% where it
# flips; at one row of 64 units a single flip is a few percent of the norm (measured 3.0e-2).
FP8_TOL_E5M2 = 6e-2
# CPU: relative error of the MLP / gated MLP steps' outputs and gradients (bf16, K = 64 for fc1,
# 96 or 128 for fc2, e4m3 or e5m2 gradients) against ref_mlp / ref_gated_mlp, measured as the
# max over 4 seeds x 5 activations x 2 gradient formats x 1 / 77 / 256 rows: 2.1e-3, mostly the
# bf16 rounding of the results (RMS 1.7e-3). 5e-3 leaves a factor 2.4.
FP8_CPU_TOL = 5e-3
FMAX = {0: 448.0, 1: 57344.0}
F8 = {0: torch.float8_e4m3fn, 1: torch.float8_e5m2}
ACTS = {"gelu_approx": 1, "relu": 2, "sqrelu": 3}

cuda = pytest.mark.cuda
fp8_gpu = pytest.mark.skipif(
    not (torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)),
    reason="FP8 needs a GPU of compute capability 8.9+")


def devices():
    return ["cpu", pytest.param("cuda", marks=[cuda, fp8_gpu])]


def randn(*shape, dtype=torch.bfloat16, device="cpu", scale=1.0):
    return (torch.randn(*shape, dtype=torch.float64) * scale).to(device=device, dtype=dtype)


# ---- float64 reference of the quantized computation ----

def ref_scale(amax, fmt):
    return torch.tensor(FMAX[fmt], dtype=torch.float32) / torch.clamp(amax.float().cpu(), min=1e-12)


def fake_quant(v, fmt, scale=None):
    """(dequantized v, scale): v quantized per tensor in `fmt` as the op does, in float64."""
    v = v.detach().double().cpu()
    amax = v.abs().max() if v.numel() else torch.zeros((), dtype=torch.float64)
    s = ref_scale(amax, fmt) if scale is None else scale.float().cpu().reshape(())
    q = torch.clamp(v.float() * s, -FMAX[fmt], FMAX[fmt]).to(F8[fmt])
    return q.double() / s.double(), s


def ref_act(pre, act):
    if act == "gelu_approx":
        return torch.nn.functional.gelu(pre, approximate="tanh")
    if act == "relu":
        return torch.relu(pre)
    return torch.relu(pre) ** 2


def ref_act_grad(pre, act):
    if act == "gelu_approx":
        p = pre.clone().requires_grad_(True)
        torch.nn.functional.gelu(p, approximate="tanh").backward(torch.ones_like(p))
        return p.grad
    if act == "relu":
        return (pre > 0).double()
    return 2 * torch.relu(pre)


# The quantizations of an MLP step, by the name a reference's `skip` leaves them out under: the
# four scaled tensors (delayed scaling's slots, in the op's order), then the two weights.
QUANTIZED = ("x", "act", "grad_out", "grad_pre", "w1", "w2")


class StepQuantizer:
    """q(name, v, fmt): v quantized (dequantized, float64) as the step quantizes the tensor `name`,
    with delayed scaling's scale of that name in `scales` ({name: scale}) or else its own amax's;
    v itself for the names in `skip`. q.amax[name]: the amax of what it was given."""

    def __init__(self, scales=None, skip=()):
        assert set(skip) <= set(QUANTIZED), skip
        self.scales, self.skip, self.amax = scales or {}, set(skip), {}

    def __call__(self, name, v, fmt):
        self.amax[name] = v.abs().max()
        return v if name in self.skip else fake_quant(v, fmt, self.scales.get(name))[0]


def ref_mlp(x, w1, b1, w2, b2, g, act, grad_fmt, dtype, scales=None, skip=(), pre_fp8=False):
    """Outputs and gradients of the FP8 MLP step, float64, with the op's roundings to `dtype`, and
    'amax': the amaxes of the step's scaled tensors; scales: delayed scaling's [x, act, grad_out,
    grad_pre] (else current scaling); skip: the quantizations (QUANTIZED) left out, for the
    references a correct step must miss; pre_fp8: the activation's derivative taken at the
    pre-activation's e4m3 copy (its own amax), dequantized and rounded to `dtype` (save_pre_fp8)."""
    d = lambda t: None if t is None else t.detach().double().cpu()  # noqa: E731
    x, w1, b1, w2, b2, g = map(d, (x, w1, b1, w2, b2, g))
    q = StepQuantizer(None if scales is None else dict(zip(QUANTIZED, scales)), skip)
    xq, w1q, w2q = q("x", x, 0), q("w1", w1, 0), q("w2", w2, 0)
    pre = xq @ w1q.T + (b1 if b1 is not None else 0)
    pre = pre.to(dtype).double()
    aq = q("act", ref_act(pre, act), 0)
    out = aq @ w2q.T + (b2 if b2 is not None else 0)
    gq = q("grad_out", g, grad_fmt)
    d_act = (gq @ w2q).to(dtype).double()
    kept = fake_quant(pre, 0)[0].to(dtype).double() if pre_fp8 else pre
    d_pre = d_act * ref_act_grad(kept, act)
    dq = q("grad_pre", d_pre, grad_fmt)
    return {"out": out, "x": dq @ w1q, "w1": dq.T @ xq, "b1": d_pre.sum(0), "w2": gq.T @ aq, "b2": g.sum(0),
            "amax": torch.stack([q.amax[k] for k in QUANTIZED[:4]])}


def fp8_tol(device, grad_format="e4m3"):
    """The tolerance of an FP8 result on `device` (grad_format: of the gradient it derives from)."""
    if torch.device(device).type == "cpu":
        return FP8_CPU_TOL
    return FP8_TOL_E5M2 if grad_format == "e5m2" else FP8_TOL


def assert_fp8_close(out, ref, what, tol=FP8_TOL):
    err = rel_err(out, ref)
    assert err <= tol, f"{what}: relative error {err:.3e} > {tol}"


# ---- fp8_quantize ----

@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("fmt", [0, 1])
@pytest.mark.parametrize("mode", ["plain", "gelu_approx", "relu", "sqrelu", "d_gelu_approx", "d_relu", "d_sqrelu"])
@pytest.mark.parametrize("rows,cols", [(1, 8), (37, 24), (130, 200), (64, 64)])
def test_quantize_matches_reference(device, fmt, mode, rows, cols):
    if device == "cuda":
        poison_cuda_cache()
    x = randn(rows, cols, device=device, scale=3.0)
    pre = randn(rows, cols, device=device) if mode.startswith("d_") else None
    act = 0 if mode == "plain" else ACTS[mode.removeprefix("d_")]
    backward = mode.startswith("d_")
    data, data_t, scale, scale_inv, amax, sums = torch.ops.fused_dense.fp8_quantize(
        x, pre, act, backward, fmt, None, True, True, True)
    v = x.double().cpu()
    if backward:
        v = v * ref_act_grad(pre.double().cpu(), mode[2:])
    elif act:
        v = ref_act(v, mode)
    deq, s = fake_quant(v, fmt)
    assert data.dtype == F8[fmt] and data.shape == (rows, cols)
    pad = (rows + 15) // 16 * 16
    assert data_t.shape == (cols, pad)
    # amax and scale: the rule in float32, from an fp32 v (rel 1e-6 of the float64 one)
    assert math.isclose(amax.item(), v.abs().max().item(), rel_tol=1e-5)
    assert math.isclose(scale.item(), s.item(), rel_tol=1e-5)
    assert scale_inv.item() == pytest.approx(1.0 / scale.item(), rel=1e-6)
    got = data.cpu().double() / scale.item()
    assert_fp8_close(got, deq, "data", fp8_tol(device))
    # the transposed copy holds the same bytes; its padding columns are zeros
    assert torch.equal(data_t[:, :rows].cpu().view(torch.uint8), data.cpu().t().contiguous().view(torch.uint8))
    assert torch.all(data_t[:, rows:].cpu().view(torch.uint8) == 0)
    assert rel_err(sums.double().cpu(), v.sum(0)) <= 1e-2
    assert sums.dtype == x.dtype


@pytest.mark.parametrize("device", devices())
def test_quantize_cpu_and_cuda_agree_bit_for_bit_mostly(device):
    """The CUDA kernel and the CPU reference compute v, the scale and the rounding alike: their
    bytes agree except where fp32 math of a fast-approximated GELU lands on the other side of a
    rounding boundary (measured: < 0.1% of the elements)."""
    x = randn(300, 96, device=device, scale=2.0)
    res = torch.ops.fused_dense.fp8_quantize(x, None, 1, False, 0, None, True, False, False)
    ref = torch.ops.fused_dense.fp8_quantize(x.cpu(), None, 1, False, 0, None, True, False, False)
    differ = (res[0].cpu().view(torch.uint8) != ref[0].view(torch.uint8)).double().mean().item()
    assert differ <= 1e-3
    assert math.isclose(res[2].item(), ref[2].item(), rel_tol=1e-6)


@pytest.mark.parametrize("device", devices())
def test_quantize_delayed_scale_saturates_and_records_amax(device):
    x = randn(64, 32, device=device)
    x[3, 5] = 1000.0
    scale = torch.tensor(1.0, device=device)
    data, _, s, s_inv, amax, _ = torch.ops.fused_dense.fp8_quantize(x, None, 0, False, 0, scale, True, False, False)
    assert s.item() == 1.0 and s_inv.item() == 1.0
    assert amax.item() == 1000.0  # recorded, not used: the scale was given
    assert data[3, 5].float().item() == 448.0  # saturated to e4m3's largest finite value, not inf / NaN
    assert torch.isfinite(data.float()).all()


@pytest.mark.parametrize("device", devices())
def test_quantize_nan_propagates(device):
    x = randn(32, 16, device=device)
    x[1, 2] = float("nan")
    data, _, s, _, amax, _ = torch.ops.fused_dense.fp8_quantize(x, None, 0, False, 0, None, True, False, False)
    assert math.isnan(amax.item()) and math.isnan(s.item())
    assert torch.isnan(data.float()).all()  # the whole tensor, through its scale
    scale = torch.tensor(2.0, device=device)
    data, _, _, _, amax, _ = torch.ops.fused_dense.fp8_quantize(x, None, 0, False, 0, scale, True, False, False)
    assert torch.isnan(data[1, 2].float()) and torch.isfinite(data.float()).sum() == x.numel() - 1
    assert math.isnan(amax.item())


@pytest.mark.parametrize("device", devices())
def test_quantize_zeros_and_empty(device):
    x = torch.zeros(5, 16, dtype=torch.bfloat16, device=device)
    data, data_t, s, _, amax, sums = torch.ops.fused_dense.fp8_quantize(x, None, 0, False, 0, None, True, True, True)
    assert amax.item() == 0.0 and s.item() == pytest.approx(448.0 / 1e-12, rel=1e-6)
    assert torch.all(data.float() == 0) and torch.all(data_t.float() == 0) and torch.all(sums == 0)
    e = torch.zeros(0, 16, dtype=torch.bfloat16, device=device)
    data, data_t, s, _, amax, sums = torch.ops.fused_dense.fp8_quantize(e, None, 0, False, 1, None, True, True, True)
    assert data.shape == (0, 16) and data_t.shape == (16, 0) and amax.item() == 0.0 and torch.all(sums == 0)
    # The backward of an empty batch (an empty tensor's data pointer may be null): plain and gated,
    # pre in the model's dtype and as its e4m3 copy.
    for act, cols, out_cols in ((1, 16, 16), (4, 32, 64)):  # gated: d_h [B, h], gu and the result [B, 2h]
        g, pre = torch.zeros(0, cols, dtype=torch.bfloat16, device=device), torch.zeros(0, out_cols, device=device)
        for pre_act, psi in ((pre.bfloat16(), None), (pre.to(torch.float8_e4m3fn), torch.tensor(1.0, device=device))):
            data, data_t, s, _, amax, sums = torch.ops.fused_dense.fp8_quantize(g, pre_act, act, True, 1, None, True,
                                                                                True, True, psi)
            assert data.shape == (0, out_cols) and data_t.shape == (out_cols, 0) and amax.item() == 0.0
            assert sums.shape == (out_cols,) and torch.all(sums == 0)


def test_quantize_errors():
    q = torch.ops.fused_dense.fp8_quantize
    x = randn(4, 16)
    with pytest.raises(ValueError, match="cols.*multiple of 8, got 12"):
        q(randn(4, 12), None, 0, False, 0, None, True, False, False)
    with pytest.raises(ValueError, match="fp8_format must be 0 .* got 2"):
        q(x, None, 0, False, 2, None, True, False, False)
    with pytest.raises(ValueError, match="backward=True needs pre_act"):
        q(x, None, 1, True, 0, None, True, False, False)
    with pytest.raises(ValueError, match="activation must be .* got 6"):
        q(x, None, 6, False, 0, None, True, False, False)
    with pytest.raises(ValueError, match="scale must be float32"):
        q(x, None, 0, False, 0, torch.tensor(1.0, dtype=torch.float64), True, False, False)
    with pytest.raises(ValueError, match="input must be contiguous"):
        q(randn(16, 8).t(), None, 0, False, 0, None, True, False, False)


def amaxes_to_sweep():
    """float32 amaxes over many binades (and 3.421875, whose scale 448 / amax PyTorch's reciprocal
    and product round one ulp below the division), zero, the smallest amax, inf and NaN."""
    g = torch.Generator().manual_seed(7)
    a = torch.exp(torch.empty(300, dtype=torch.float64).uniform_(-14, 12, generator=g)).float()
    return torch.cat([a, torch.tensor([3.421875, 0.0, 1e-12, 1e-30, float("inf"), float("nan")])])


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("fmt", [0, 1])
def test_scales_are_fp8_quantizes_bits(device, fmt):
    """fp8_scales(amax, False) is the scale and scale_inv fp8_quantize returns for a tensor of that
    amax (current scaling), fp8_scales(s, True) those it returns at the delayed scale s: bit for bit
    (a NaN amax gives NaN scales)."""
    q, scales = torch.ops.fused_dense.fp8_quantize, torch.ops.fused_dense.fp8_scales
    for a in amaxes_to_sweep().tolist():
        x = torch.zeros(16, 16, dtype=torch.float32, device=device)
        x[5, 9] = -a
        want = q(x, None, 0, False, fmt, None, True, False, False)
        got = scales(torch.tensor(a, device=device), False, fmt)
        assert same_bits(got[0], want[2]) and same_bits(got[1], want[3]), (a, got, want[2:4])
        if a == a and 0 < a < float("inf"):
            s = torch.tensor([FMAX[fmt] / a * 0.7], device=device)
            want = q(x, None, 0, False, fmt, s, True, False, False)
            got = scales(s, True, fmt)
            assert same_bits(got[0], want[2]) and same_bits(got[1], want[3]), (a, got, want[2:4])


def same_bits(a, b):
    """Two float32 tensors hold the same bits, or NaN where both are NaN (whatever its sign)."""
    a, b = a.cpu(), b.cpu()
    nan = torch.isnan(a) & torch.isnan(b)
    return a.shape == b.shape and torch.equal(torch.where(nan, 0, a.view(torch.int32)), torch.where(nan, 0, b.view(torch.int32)))


def test_scales_errors_and_meta():
    scales = torch.ops.fused_dense.fp8_scales
    one = torch.tensor(2.0)
    with pytest.raises(ValueError, match="value \\(the amax, delayed=False\\) must be float32, got BFloat16"):
        scales(one.bfloat16(), False, 0)
    with pytest.raises(ValueError, match="value \\(the scale, delayed=True\\) must hold one element, got shape \\[2\\]"):
        scales(torch.ones(2), True, 0)
    with pytest.raises(ValueError, match="fp8_format must be 0 .* got 3"):
        scales(one, False, 3)
    s, si = scales(torch.empty((), device="meta"), False, 1)
    assert s.device.type == "meta" and s.shape == () and si.dtype == torch.float32
    torch.library.opcheck(scales.default, (torch.tensor(3.0), False, 0))
    torch.library.opcheck(scales.default, (torch.tensor([130.0]), True, 1))


def assert_same_outputs(got, want, what):
    """Two calls' outputs are the same bytes, output by output (FP8 ones compared as bytes)."""
    for i, (a, b) in enumerate(zip(got, want)):
        a, b = a.cpu(), b.cpu()
        if a.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            a, b = a.view(torch.uint8), b.view(torch.uint8)
        assert torch.equal(a, b), f"output {i} differs ({what})"


def e4m3_copy(t):
    """t's e4m3 copy at its own amax, as fp8_quantize makes it, and that copy's scale_inv."""
    data, _, _, scale_inv, _, _ = torch.ops.fused_dense.fp8_quantize(t, None, 0, False, 0, None, True, False, False)
    return data, scale_inv


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("act", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("scaling", ["current", "delayed"])
def test_quantize_reads_an_e4m3_pre_act(device, act, dtype, scaling):
    """pre_scale_inv: the backward's pre_act given as e4m3 bytes is read as its dequantized value
    rounded to the input's dtype, so every output's bytes equal those of the same call with that
    dequantization done in plain PyTorch (rows not a multiple of the kernels' 128-row tile)."""
    if device == "cuda":
        poison_cuda_cache()
    gated = act >= 4
    rows, cols = 150, 96
    x = randn(rows, cols, dtype=dtype, device=device, scale=2.0)
    pre = randn(rows, 2 * cols if gated else cols, dtype=dtype, device=device, scale=1.5)
    pre8, pre_si = e4m3_copy(pre)
    pre_deq = (pre8.float() * pre_si).to(dtype)  # the model dtype's rounding of the dequantized copy
    assert not torch.equal(pre_deq, pre)  # the e4m3 copy is not pre: the test sees which one is read
    scale = None if scaling == "current" else torch.tensor(5.0, device=device)
    for fmt in (0, 1):
        got = torch.ops.fused_dense.fp8_quantize(x, pre8, act, True, fmt, scale, True, True, True, pre_si)
        want = torch.ops.fused_dense.fp8_quantize(x, pre_deq, act, True, fmt, scale, True, True, True)
        assert_same_outputs(got, want, f"act {act}, {dtype}, fmt {fmt}")


def test_quantize_e4m3_pre_act_errors():
    q = torch.ops.fused_dense.fp8_quantize
    x, pre = randn(4, 16), randn(4, 16)
    pre8, si = e4m3_copy(pre)
    with pytest.raises(ValueError, match="pre_scale_inv .* only with backward=True"):
        q(x, None, 1, False, 0, None, True, False, False, si)
    with pytest.raises(ValueError, match="pre_act must be float8_e4m3fn, got BFloat16"):
        q(x, pre, 1, True, 0, None, True, False, False, si)
    with pytest.raises(ValueError, match="pre_scale_inv must be float32"):
        q(x, pre8, 1, True, 0, None, True, False, False, si.double())
    with pytest.raises(ValueError, match="pre_scale_inv must hold one element"):
        q(x, pre8, 1, True, 0, None, True, False, False, torch.ones(2))
    with pytest.raises(ValueError, match=r"pre_act must have input's dtype .* \(or be float8_e4m3fn with pre_scale_inv\)"):
        q(x, pre8, 1, True, 0, None, True, False, False)



@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("act", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("scaling", ["current", "delayed"])
@pytest.mark.parametrize("rows", [150, 1000])
@pytest.mark.parametrize("cols", [96, 328])
def test_quantize_grad_in_place_writes_fp8_quantizes_bytes(device, act, dtype, scaling, rows, cols):
    """fp8_quantize_grad_ writes the backward quantize's row-major bytes over the e4m3 pre_act it
    reads (the gated modes: two lanes read each 16-byte block before either writes its half), and
    returns its scale, scale_inv, amax and column sums: the bytes of the out-of-place call on an
    untouched copy (1000 rows: several row tiles and blocks a column). On CUDA in place runs
    128-column blocks and out of place 64-column ones: 96 columns are part of one block, 328 (656
    gated) several and a part."""
    if device == "cuda":
        poison_cuda_cache()
    gated = act >= 4
    x = randn(rows, cols, dtype=dtype, device=device, scale=2.0)
    pre8, pre_si = e4m3_copy(randn(rows, 2 * cols if gated else cols, dtype=dtype, device=device, scale=1.5))
    scale = None if scaling == "current" else torch.tensor(5.0, device=device)
    for fmt in (0, 1):
        want = torch.ops.fused_dense.fp8_quantize(x, pre8, act, True, fmt, scale, True, False, True, pre_si)
        target = pre8.clone()
        got = torch.ops.fused_dense.fp8_quantize_grad_(target, x, act, fmt, scale, True, pre_si)
        assert not torch.equal(target.view(torch.uint8), pre8.view(torch.uint8))
        assert_same_outputs((target.view(F8[fmt]), *got), (want[0], *want[2:]), f"act {act}, {dtype}, fmt {fmt}")
        none = torch.ops.fused_dense.fp8_quantize_grad_(pre8.clone(), x, act, fmt, scale, False, pre_si)
        assert none[3].numel() == 0


def test_quantize_grad_in_place_errors():
    op = torch.ops.fused_dense.fp8_quantize_grad_
    x = randn(4, 16)
    pre8, si = e4m3_copy(randn(4, 16))
    with pytest.raises(ValueError, match="pre_act must be float8_e4m3fn .* got BFloat16"):
        op(randn(4, 16), x, 1, 0, None, False, si)
    with pytest.raises(ValueError, match="must not share memory with input"):
        op(x.view(torch.float8_e4m3fn), x, 1, 0, None, False, si)
    with pytest.raises(ValueError, match=r"pre_act must have input's shape \[4, 16\], got \[4, 32\]"):
        op(torch.cat([pre8.view(torch.uint8)] * 2, 1).view(torch.float8_e4m3fn), x, 1, 0, None, False, si)
    with pytest.raises(ValueError, match="a gated backward's pre_act must be the packed gu"):
        op(pre8.clone(), x, 4, 0, None, False, si)
    with pytest.raises(ValueError, match="pre_scale_inv must be float32"):
        op(pre8.clone(), x, 1, 0, None, False, si.double())
    before = pre8.view(torch.uint8).clone()
    with pytest.raises(ValueError, match=r"fp8_format must be 0 \(e4m3\) or 1 \(e5m2\), got 2"):
        op(pre8, x, 1, 2, None, False, si)
    assert torch.equal(pre8.view(torch.uint8), before)  # a refused call writes nothing


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("fmt", [0, 1])
@pytest.mark.parametrize("rows,cols", [(1, 16), (37, 48), (130, 208), (300, 64), (0, 32)])
def test_transpose_is_quantizes_transposed_copy(device, fmt, rows, cols):
    """fp8_transpose of the row-major bytes is the quantize pass's data_t of the same values, padding
    columns (zeros up to a multiple of 16 rows) included, and the plain byte transpose."""
    if device == "cuda":
        poison_cuda_cache()
    x = randn(rows, cols, device=device, scale=3.0)
    data, data_t = torch.ops.fused_dense.fp8_quantize(x, None, 0, False, fmt, None, True, True, False)[:2]
    got = torch.ops.fused_dense.fp8_transpose(data)
    assert got.dtype == F8[fmt] and got.shape == data_t.shape == (cols, (rows + 15) // 16 * 16)
    assert torch.equal(got.view(torch.uint8).cpu(), data_t.view(torch.uint8).cpu())
    plain = torch.zeros(cols, (rows + 15) // 16 * 16, dtype=torch.uint8)
    plain[:, :rows] = data.view(torch.uint8).cpu().T
    assert torch.equal(got.view(torch.uint8).cpu(), plain)


def test_transpose_errors():
    op = torch.ops.fused_dense.fp8_transpose
    with pytest.raises(ValueError, match="data must be float8_e4m3fn or float8_e5m2, got BFloat16"):
        op(randn(4, 16))
    with pytest.raises(ValueError, match=r"data.size\(1\) \(cols\) must be a multiple of 16, got 24"):
        op(torch.zeros(4, 24).to(torch.float8_e4m3fn))
    with pytest.raises(ValueError, match="data must be 2-D"):
        op(torch.zeros(64).to(torch.float8_e4m3fn))
    with pytest.raises(ValueError, match="data must be contiguous"):
        op(torch.zeros(32, 16).to(torch.float8_e5m2).t())



def e4m3_of(t):
    """t's e4m3 bytes at its own amax and that scale's inverse, in plain PyTorch (float32 scale
    fp8_max / max(amax, 1e-12), saturating cast, round to nearest even)."""
    v = t.detach().float().cpu()
    s = ref_scale(v.abs().max(), 0)
    return torch.clamp(v * s, -FMAX[0], FMAX[0]).to(F8[0]).view(torch.uint8), torch.reciprocal(s)


def poisoned_e4m3_copy(shape, device):
    """An e4m3 output and a scale_inv for an op to write into, filled with NaN (0x7f): a byte the
    op leaves unwritten stays NaN."""
    return (torch.full(shape, 0x7F, dtype=torch.uint8, device=device).view(torch.float8_e4m3fn),
            torch.tensor(float("nan"), device=device))


def assert_e4m3_copy_of(t, copy, scale_inv, what):
    want, want_si = e4m3_of(t)
    got = copy.view(torch.uint8).cpu()
    assert torch.equal(got, want), f"{what}: {(got != want).sum().item()} of {got.numel()} bytes differ"
    # the kernel's 1 / scale and PyTorch's reciprocal are both the correctly rounded quotient
    assert torch.equal(scale_inv.cpu().reshape(()), want_si), (what, scale_inv.item(), want_si.item())


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("act", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("scaling", ["current", "delayed"])
def test_quantize_writes_the_inputs_e4m3_copy(device, act, dtype, scaling):
    """input_fp8 / input_scale_inv: the forward's input (pre, or the packed gu) quantized to e4m3 at
    its own amax, whatever the scaling of v, from the same passes: its bytes are plain PyTorch's,
    and the op's six outputs are those of the call without the copy (rows not a multiple of the
    kernels' 128-row tile; pre and act(pre) have different amaxes)."""
    if device == "cuda":
        poison_cuda_cache()
    gated = act >= 4
    rows, cols = 150, 96
    x = randn(rows, 2 * cols if gated else cols, dtype=dtype, device=device, scale=2.0)
    scale = None if scaling == "current" else torch.tensor(5.0, device=device)
    copy, si = poisoned_e4m3_copy(x.shape, device)
    got = torch.ops.fused_dense.fp8_quantize(x, None, act, False, 0, scale, True, True, False, None, copy, si)
    want = torch.ops.fused_dense.fp8_quantize(x, None, act, False, 0, scale, True, True, False)
    assert_same_outputs(got, want, f"with the copy, act {act}, {dtype}")
    assert_e4m3_copy_of(x, copy, si, f"act {act}, {dtype}, {scaling}")


@pytest.mark.parametrize("device", devices())
def test_input_copy_of_no_rows(device):
    """An empty input's copy: nothing to write, and its scale_inv from an amax of 0 (the scale
    rule's floor), as the same call on one row of zeros gives; fp8_linear_act with no tokens alike."""
    x = torch.zeros(0, 32, dtype=torch.bfloat16, device=device)
    copy = torch.empty(0, 32, dtype=torch.float8_e4m3fn, device=device)
    si = torch.tensor(float("nan"), device=device)
    torch.ops.fused_dense.fp8_quantize(x, None, 1, False, 0, None, True, True, False, None, copy, si)
    zero_row = torch.zeros(1, 32, dtype=torch.bfloat16, device=device)
    want_si = torch.ops.fused_dense.fp8_quantize(zero_row, None, 0, False, 0, None, True, False, False)[3]
    assert torch.equal(si.cpu(), want_si.cpu()), (si.item(), want_si.item())
    args = linear_act_inputs(device, 16, 32, 48, scale=None)
    copy, si = torch.empty(0, 48, dtype=torch.float8_e4m3fn, device=device), torch.tensor(float("nan"), device=device)
    torch.ops.fused_dense.fp8_linear_act(args[0][:0], *args[1:5], torch.bfloat16, 1, None, True, copy, si)
    assert torch.equal(si.cpu(), want_si.cpu())


def test_quantize_input_copy_errors():
    q = torch.ops.fused_dense.fp8_quantize
    x = randn(4, 16)
    copy, si = poisoned_e4m3_copy((4, 16), "cpu")
    with pytest.raises(ValueError, match="input_fp8 and input_scale_inv go together: pass both or neither, got "
                                         "input_fp8 and no input_scale_inv"):
        q(x, None, 1, False, 0, None, True, False, False, None, copy, None)
    with pytest.raises(ValueError, match=r"input_fp8 .* is written by the forward with an activation .* got "
                                         r"backward=False, activation 0"):
        q(x, None, 0, False, 0, None, True, False, False, None, copy, si)
    with pytest.raises(ValueError, match=r"got backward=True, activation 1"):
        q(x, x, 1, True, 0, None, True, False, False, None, copy, si)
    with pytest.raises(ValueError, match=r"input_fp8 must have shape \[4, 16\], got \[4, 8\]"):
        q(x, None, 1, False, 0, None, True, False, False, None, copy[:, :8], si)
    with pytest.raises(ValueError, match="input_fp8 must be float8_e4m3fn, got Float8_e5m2"):
        q(x, None, 1, False, 0, None, True, False, False, None, copy.view(torch.uint8).view(torch.float8_e5m2), si)
    with pytest.raises(ValueError, match="input_scale_inv must be float32"):
        q(x, None, 1, False, 0, None, True, False, False, None, copy, si.double())
    with pytest.raises(ValueError, match="input_fp8 must be contiguous"):
        q(x, None, 1, False, 0, None, True, False, False, None,
          copy.view(torch.uint8).repeat(1, 2)[:, ::2].view(torch.float8_e4m3fn), si)


# ---- fp8_linear ----

@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("formats", [(0, 0), (1, 0), (0, 1)])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_matches_reference(device, formats, out_dtype, bias):
    if device == "cuda":
        poison_cuda_cache()
    B, K, N = 50, 64, 48
    xi = torch.ops.fused_dense.fp8_quantize(randn(B, K, device=device), None, 0, False, formats[0], None, True,
                                            False, False)
    wi = torch.ops.fused_dense.fp8_quantize(randn(N, K, device=device), None, 0, False, formats[1], None, True,
                                            False, False)
    b = randn(N, dtype=out_dtype, device=device) if bias else None
    out = torch.ops.fused_dense.fp8_linear(xi[0], wi[0], xi[3], wi[3], b, out_dtype, False, -2)
    assert out.dtype == out_dtype and out.shape == (B, N)
    ref = (xi[0].double().cpu() * xi[3].item()) @ (wi[0].double().cpu() * wi[3].item()).T
    if bias:
        ref = ref + b.double().cpu()
    # fp32 out: Hopper's FP8 tensor cores add products in fewer bits than fp32 between promotions to
    # the fp32 accumulator (measured 7.5e-5 on the H200 with the precise accumulation), so 5e-4.
    tol = {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 5e-4 if device == "cuda" else 1e-5}[out_dtype]
    assert rel_err(out.double().cpu(), ref) <= tol


def test_linear_errors():
    lin = torch.ops.fused_dense.fp8_linear
    e5 = torch.zeros(16, 32).to(torch.float8_e5m2)
    e4 = torch.zeros(16, 32).to(torch.float8_e4m3fn)
    one = torch.tensor(1.0)
    with pytest.raises(ValueError, match="cannot both be float8_e5m2"):
        lin(e5, e5, one, one, None, torch.bfloat16, False, -2)
    with pytest.raises(ValueError, match="in_features must be a multiple of 16, got 24"):
        lin(torch.zeros(4, 24).to(torch.float8_e4m3fn), torch.zeros(16, 24).to(torch.float8_e4m3fn), one, one, None,
            torch.bfloat16, False, -2)
    with pytest.raises(ValueError, match="input must be float8"):
        lin(torch.zeros(16, 32), e4, one, one, None, torch.bfloat16, False, -2)
    with pytest.raises(ValueError, match="bias must have out_dtype"):
        lin(e4, e4, one, one, torch.zeros(16), torch.bfloat16, False, -2)
    with pytest.raises(ValueError, match="input_scale_inv must be float32"):
        lin(e4, e4, one.double(), one, None, torch.bfloat16, False, -2)


@cuda
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() >= (8, 9),
                    reason="needs a GPU without FP8")
def test_linear_refuses_gpu_without_fp8():
    e4 = torch.zeros(16, 32, device="cuda").to(torch.float8_e4m3fn)
    one = torch.tensor(1.0, device="cuda")
    with pytest.raises(NotImplementedError, match="compute capability 8.9"):
        torch.ops.fused_dense.fp8_linear(e4, e4, one, one, None, torch.bfloat16, False, -2)


@pytest.mark.parametrize("device", devices())
def test_opcheck(device):
    x = randn(40, 32, device=device)
    pre = randn(40, 32, device=device)
    scale = torch.tensor(3.0, device=device)
    for args in [(x, None, 1, False, 0, None, True, True, True), (x, pre, 1, True, 1, scale, True, True, True)]:
        torch.library.opcheck(torch.ops.fused_dense.fp8_quantize.default, args)
    # an e4m3 pre_act: opcheck's schema test multiplies inputs, which float8 tensors do not support
    pre8, si = e4m3_copy(pre)
    torch.library.opcheck(torch.ops.fused_dense.fp8_quantize.default, (x, pre8, 1, True, 1, scale, True, True, True, si),
                          test_utils=("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic"))
    # the input's e4m3 copy, written in place
    copy, copy_si = poisoned_e4m3_copy(x.shape, device)
    torch.library.opcheck(torch.ops.fused_dense.fp8_quantize.default,
                          (x, None, 1, False, 0, scale, True, True, False, None, copy, copy_si),
                          test_utils=("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic"))
    # the gradient written over an e4m3 pre_act, and the byte transpose
    torch.library.opcheck(torch.ops.fused_dense.fp8_quantize_grad_.default, (pre8.clone(), x, 1, 1, scale, True, si),
                          test_utils=("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic"))
    torch.library.opcheck(torch.ops.fused_dense.fp8_transpose.default, (pre8,),
                          test_utils=("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic"))
    xi = torch.ops.fused_dense.fp8_quantize(x, None, 0, False, 0, None, True, False, False)
    args = (xi[0], xi[0][:16], xi[3], xi[3], None, torch.bfloat16, True, -2)
    # opcheck's test_schema multiplies the inputs, which PyTorch does not implement for float8
    # tensors; what it checks (no input mutated) is checked on the bytes here instead.
    before = xi[0].view(torch.uint8).clone()
    torch.library.opcheck(torch.ops.fused_dense.fp8_linear.default, args,
                          test_utils=("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic"))
    torch.ops.fused_dense.fp8_linear(*args)
    assert torch.equal(xi[0].view(torch.uint8), before)


# ---- fp8_linear_act ----

def linear_act_inputs(device, B, K, N, scale=2.0, bias=True, dtype=torch.bfloat16):
    """fp8_linear_act's inputs; scale None: current scaling."""
    xi = torch.ops.fused_dense.fp8_quantize(randn(B, K, device=device), None, 0, False, 0, None, True, False, False)
    wi = torch.ops.fused_dense.fp8_quantize(randn(N, K, device=device, scale=0.3), None, 0, False, 0, None, True,
                                            False, False)
    b = randn(N, dtype=dtype, device=device) if bias else None
    return xi[0], wi[0], xi[3], wi[3], b, None if scale is None else torch.tensor(scale, device=device)


def assert_quantize_of_pre(res, act, scale, columnwise):
    """fp8_linear_act's data, data_t, scale, scale_inv and amax are fp8_quantize's of its own pre
    (with the same scale, or both current scaling: scale None)."""
    pre, data, data_t, s, s_inv, amax = res
    q = torch.ops.fused_dense.fp8_quantize(pre, None, act, False, 0, scale, True, columnwise, False)
    assert torch.equal(data.view(torch.uint8), q[0].view(torch.uint8))
    if columnwise:
        assert torch.equal(data_t.view(torch.uint8), q[1].view(torch.uint8))  # padding columns included
    else:
        assert data_t.numel() == 0
    for got, want in zip((s, s_inv, amax), q[2:5]):
        assert torch.equal(got, want) or (got.isnan().item() and want.isnan().item())


# B, K, N: fits the one-GEMM kernel (multiples of 16), with partial tiles along every dimension
# (272 tokens, 208 features, K 160 against 128 x 128 x 128 tiles), and B not a multiple of 16 (the
# two kernels). On the CPU all are the reference.
LINEAR_ACT_SHAPES = [(64, 64, 96), (272, 160, 208), (50, 64, 96)]


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("act", list(ACTS))
@pytest.mark.parametrize("shape", LINEAR_ACT_SHAPES)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("columnwise", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("scaling", ["delayed", "current"])
def test_linear_act_matches_reference(device, act, shape, bias, columnwise, dtype, scaling):
    B, K, N = shape
    x, w, sx, sw, b, scale = linear_act_inputs(device, B, K, N, scale=2.0 if scaling == "delayed" else None,
                                               bias=bias, dtype=dtype)
    if device == "cuda":
        poison_cuda_cache()
    res = torch.ops.fused_dense.fp8_linear_act(x, w, sx, sw, b, dtype, ACTS[act], scale, columnwise)
    pre = res[0]
    assert pre.dtype == dtype and pre.shape == (B, N) and res[1].shape == (B, N)
    assert res[2].shape == ((N, (B + 15) // 16 * 16) if columnwise else (0,))
    ref = (x.double().cpu() * sx.item()) @ (w.double().cpu() * sw.item()).T
    if bias:
        ref = ref + b.double().cpu()
    assert rel_err(pre.double().cpu(), ref) <= 1e-2
    assert_quantize_of_pre(res, ACTS[act], scale, columnwise)
    # the activation of the op's own pre, quantized in float64 with the given scale, or (current
    # scaling) with the scale of its amax
    v = ref_act(pre.double().cpu(), act)
    want, want_scale = fake_quant(v, 0, scale)
    if scale is None:  # the amax and scale within the fast activation's error (ex2 / rcp approximations)
        assert torch.allclose(res[5].cpu().double(), v.abs().max(), rtol=5e-3, atol=0)
        assert torch.allclose(res[3].cpu().double(), want_scale.double(), rtol=5e-3, atol=0)
    assert_fp8_close(res[1].double().cpu() / res[3].item(), want, "act", fp8_tol(device))


@pytest.mark.parametrize("device", devices())
def test_linear_act_saturates_and_propagates_nan(device):
    x, w, sx, sw, b, scale = linear_act_inputs(device, 64, 64, 96, scale=1.0)
    b[5] = 1e4  # act(1e4) * 1 saturates to 448
    b[7] = float("nan")
    res = torch.ops.fused_dense.fp8_linear_act(x, w, sx, sw, b, torch.bfloat16, 1, scale, True)
    data = res[1].float().cpu()
    assert torch.all(data[:, 5] == 448.0)
    assert torch.all(torch.isnan(data[:, 7])) and torch.isfinite(data).sum() == data.numel() - 64
    assert math.isnan(res[5].item())  # the amax is NaN
    assert_quantize_of_pre(res, 1, scale, True)
    # current scaling: a NaN amax gives a NaN scale, so every element is NaN, as fp8_quantize's
    res = torch.ops.fused_dense.fp8_linear_act(x, w, sx, sw, b, torch.bfloat16, 1, None, True)
    assert math.isnan(res[5].item()) and math.isnan(res[3].item())
    assert torch.isnan(res[1].float()).all()
    assert_quantize_of_pre(res, 1, None, True)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("act", list(ACTS))
@pytest.mark.parametrize("shape", LINEAR_ACT_SHAPES)
@pytest.mark.parametrize("scaling", ["delayed", "current"])
def test_linear_act_writes_pres_e4m3_copy(device, act, shape, scaling):
    """pre_fp8 / pre_scale_inv: fc1's pre quantized to e4m3 at its own amax, beside the activation's
    quantize (on the GPU: the one-GEMM kernel's recorded amax where it fits, else the amax pass):
    its bytes are plain PyTorch's of the op's own pre, and the other outputs are those of the call
    without the copy."""
    if device == "cuda":
        poison_cuda_cache()
    args = linear_act_inputs(device, *shape, scale=None if scaling == "current" else 2.0)
    copy, si = poisoned_e4m3_copy((shape[0], shape[2]), device)
    got = torch.ops.fused_dense.fp8_linear_act(*args[:5], torch.bfloat16, ACTS[act], args[5], True, copy, si)
    want = torch.ops.fused_dense.fp8_linear_act(*args[:5], torch.bfloat16, ACTS[act], args[5], True)
    assert_same_outputs(got, want, "with the copy")
    assert_e4m3_copy_of(got[0], copy, si, f"{act} {shape} {scaling}")
    with pytest.raises(ValueError, match=r"pre_fp8 must have shape \[\d+, \d+\], got \[\d+, 16\]"):
        torch.ops.fused_dense.fp8_linear_act(*args[:5], torch.bfloat16, ACTS[act], args[5], True, copy[:, :16], si)
    with pytest.raises(ValueError, match="pre_fp8 and pre_scale_inv go together"):
        torch.ops.fused_dense.fp8_linear_act(*args[:5], torch.bfloat16, ACTS[act], args[5], True, None, si)


@cuda
@fp8_gpu
def test_linear_act_runs_one_gemm_where_it_fits():
    """On compute capability 9.0 with the cutlass_sm90 kernels built, a fitting problem is one
    kernel (no quantize pass after the GEMM); a problem that does not fit (B not a multiple of
    16, float16) runs both."""
    if torch.cuda.get_device_capability() != (9, 0) or not fused_dense.has_cutlass_gemms():
        pytest.skip("the one-GEMM kernel is for compute capability 9.0 with the cutlass_sm90 kernels")
    from torch.profiler import ProfilerActivity, profile

    def kernels(B, dtype=torch.bfloat16, scale=2.0, pre_copy=False):
        args = linear_act_inputs("cuda", B, 64, 96, scale=scale, dtype=dtype)
        copy = poisoned_e4m3_copy((B, 96), "cuda") if pre_copy else (None, None)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            torch.ops.fused_dense.fp8_linear_act(*args[:5], dtype, 1, args[5], True, *copy)
            torch.cuda.synchronize()
        return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]

    def has(names, part):
        return any(part in n for n in names)

    fused = kernels(64)
    assert has(fused, "cutlass") and not has(fused, "cast_kernel"), fused
    assert has(kernels(50), "cast_kernel")
    assert has(kernels(64, torch.float16), "cast_kernel")
    # current scaling: the GEMM records the amax, so the cast pass runs without the amax pass
    current = kernels(64, scale=None)
    assert has(current, "cutlass") and has(current, "cast_kernel") and not has(current, "amax_kernel"), current
    assert has(kernels(50, scale=None), "amax_kernel")
    # pre's e4m3 copy: its amax recorded by the GEMM too, so no amax pass; current scaling casts it
    # in the activation's cast pass, delayed scaling in one cast pass of its own
    current = kernels(64, scale=None, pre_copy=True)
    assert not has(current, "amax_kernel") and sum("cast_kernel" in n for n in current) == 1, current
    delayed = kernels(64, pre_copy=True)
    assert not has(delayed, "amax_kernel") and sum("cast_kernel" in n for n in delayed) == 1, delayed


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("bias", [True, False])
def test_fp8_linear_over_no_k(device, bias):
    """K = 0 (a weight gradient over no tokens) is the empty sum: out = bias, or zeros."""
    e4 = torch.empty(24, 0, dtype=torch.float8_e4m3fn, device=device)
    w = torch.empty(32, 0, dtype=torch.float8_e4m3fn, device=device)
    one = torch.tensor(1.0, device=device)
    b = randn(32, device=device) if bias else None
    out = torch.ops.fused_dense.fp8_linear(e4, w, one, one, b, torch.bfloat16, False, -2)
    want = b.expand(24, 32) if bias else torch.zeros(24, 32, dtype=torch.bfloat16, device=device)
    assert torch.equal(out.cpu(), want.cpu())


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("scaling", ["current", "delayed"])
@pytest.mark.parametrize("save_pre_fp8", [False, True])
def test_fp8_layers_on_an_empty_batch(device, scaling, save_pre_fp8):
    """An empty batch (an empty micro-batch) runs as nn.Linear's does: an empty output, zero
    gradients for the parameters, an empty one for x."""
    recipe = Float8Recipe(min_features=0, scaling=scaling, save_pre_fp8=save_pre_fp8)
    for m in (FusedDense(64, 96, device=device, dtype=torch.bfloat16, fp8=recipe),
              FusedMLP(64, 128, device=device, dtype=torch.bfloat16, fp8=recipe),
              FusedGatedMLP(64, 128, device=device, dtype=torch.bfloat16, fp8=recipe)):
        x = torch.randn(0, 64, device=device, dtype=torch.bfloat16, requires_grad=True)
        y = m(x)
        assert y.shape == (0, m(torch.randn(1, 64, device=device, dtype=torch.bfloat16)).shape[1])
        y.sum().backward()
        assert x.grad.shape == (0, 64)
        for name, p in m.named_parameters():
            assert p.grad is not None and not p.grad.any(), f"{type(m).__name__}.{name}"


def test_linear_act_errors():
    op = torch.ops.fused_dense.fp8_linear_act
    e4 = torch.zeros(16, 32).to(torch.float8_e4m3fn)
    e5 = torch.zeros(16, 32).to(torch.float8_e5m2)
    one = torch.tensor(1.0)
    with pytest.raises(ValueError, match="fp8_linear_act: input and weight must be float8_e4m3fn"):
        op(e5, e4, one, one, None, torch.bfloat16, 1, one, True)
    with pytest.raises(ValueError, match="activation must be 1 .* got 4"):
        op(e4, e4, one, one, None, torch.bfloat16, 4, one, True)
    with pytest.raises(ValueError, match="fp8_linear_act: scale must be float32"):
        op(e4, e4, one, one, None, torch.bfloat16, 1, one.double(), True)
    with pytest.raises(ValueError, match="fp8_linear_act: in_features must be a multiple of 16, got 24"):
        op(torch.zeros(4, 24).to(torch.float8_e4m3fn), torch.zeros(16, 24).to(torch.float8_e4m3fn), one, one, None,
           torch.bfloat16, 1, one, True)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("scaling", ["delayed", "current"])
def test_linear_act_opcheck(device, scaling):
    args = (*linear_act_inputs(device, 32, 32, 48)[:5], torch.bfloat16, 1,
            torch.tensor(2.0, device=device) if scaling == "delayed" else None, True)
    before = args[0].view(torch.uint8).clone()
    # As for fp8_linear: opcheck's test_schema cannot multiply float8 inputs.
    torch.library.opcheck(torch.ops.fused_dense.fp8_linear_act.default, args,
                          test_utils=("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic"))
    assert torch.equal(args[0].view(torch.uint8), before)
    copy, si = poisoned_e4m3_copy((32, 48), device)
    torch.library.opcheck(torch.ops.fused_dense.fp8_linear_act.default, (*args, copy, si),
                          test_utils=("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic"))


# ---- the FP8 MLP and linear layer ----

def make_mlp(device, act="gelu_approx", recipe=None, dtype=torch.bfloat16, d=64, h=128, lvl=0, bias=True):
    m = FusedMLP(d, h, activation=act, checkpoint_lvl=lvl, bias1=bias, bias2=bias, device=device, dtype=dtype,
                 fp8=recipe or Float8Recipe(min_features=0))
    return m


def run_step(m, x, g, **kw):
    x = x.detach().requires_grad_(True)
    for p in m.parameters():
        p.grad = None
    out = m(x, **kw)
    out.backward(g)
    grads = {"x": x.grad, "w1": m.fc1.weight.grad, "w2": m.fc2.weight.grad}
    if m.fc1.bias is not None:
        grads.update(b1=m.fc1.bias.grad, b2=m.fc2.bias.grad)
    return out, grads


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("act", ["gelu_approx", "swiglu"])
@pytest.mark.parametrize("save_pre_fp8", [False, True])
@pytest.mark.parametrize("lvl", [0, 1])
def test_mlp_backward_quantizes_the_gradient_row_major_then_transposes(device, act, save_pre_fp8, lvl):
    """The backward quantizes the activation's gradient row-major and makes its transposed copy
    from those bytes (fp8_transpose) once d_act and pre are gone; with save_pre_fp8 at level 0 and
    no retain_graph the row-major copy is written over pre's e4m3 copy (fp8_quantize_grad_), with a
    kept graph or at level 1 out of place. With save_pre_fp8 at level 0 the forward makes the
    activation's transposed copy the same way, and x's after the pass over pre (from x's row-major copy
    where fc1 kept it, else from x). The same bits either way (and the references of
    the other tests check the bits of both paths)."""
    from conftest import OpLog
    torch.manual_seed(0)
    recipe = Float8Recipe(min_features=0, save_pre_fp8=save_pre_fp8)
    if act == "swiglu":
        m = FusedGatedMLP(64, 128, activation=act, checkpoint_lvl=lvl, device=device, dtype=torch.bfloat16,
                          fp8=recipe)
    else:
        m = make_mlp(device, act, recipe, lvl=lvl)
    x = randn(96, 64, device=device).requires_grad_(True)
    g = randn(96, 64, device=device)
    params = [x, *m.parameters()]
    runs = {}
    for retain in (True, False):
        with OpLog() as log:
            out = m(x)
        # with pre's e4m3 copy kept, the activation's transposed copy is made after pre is freed,
        # and x's from x's row-major copy where fc1 held it through the pass (the plain
        # activations' fp8_linear_act), else by a second quantize of x (at its first one's scale)
        late = save_pre_fp8 and lvl == 0
        x_t_by_transpose = late and act != "swiglu"
        assert log.names.count("fp8_transpose") == (1 if late else 0) + x_t_by_transpose, log.names
        # the step's quantizes: the two weights', the gated activation's and x's
        x_quantizes = log.names.count("fp8_quantize") - 2 - (1 if act == "swiglu" else 0)
        assert x_quantizes == (2 if late and not x_t_by_transpose else 1), log.names
        with OpLog() as log:
            runs[retain] = torch.autograd.grad(out, params, g, retain_graph=retain)
        in_place = "fp8_quantize_grad_" in log.names
        assert in_place == (save_pre_fp8 and lvl == 0 and not retain), (retain, log.names)
        assert log.names.count("fp8_transpose") == 1, log.names
    for a, b in zip(runs[True], runs[False]):
        assert torch.equal(a, b)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("act", list(ACTS))
@pytest.mark.parametrize("grad_format", ["e5m2", "e4m3"])
@pytest.mark.parametrize("rows", [1, 77, 256])
def test_mlp_current_scaling_matches_reference(device, act, grad_format, rows):
    if device == "cuda":
        poison_cuda_cache()
    m = make_mlp(device, act, Float8Recipe(grad_format=grad_format, min_features=0))
    x = randn(rows, 64, device=device)
    g = randn(rows, 64, device=device)
    out, grads = run_step(m, x, g)
    ref = ref_mlp(x, m.fc1.weight, m.fc1.bias, m.fc2.weight, m.fc2.bias, g, act, 1 if grad_format == "e5m2" else 0,
                  torch.bfloat16)
    assert_fp8_close(out, ref["out"], "out", fp8_tol(device))
    for k, v in grads.items():
        assert v.dtype == torch.bfloat16
        assert_fp8_close(v, ref[k], f"grad {k}", fp8_tol(device, grad_format))


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("act", list(ACTS))
@pytest.mark.parametrize("rows", [77, 256])
def test_mlp_save_pre_fp8_matches_reference(device, act, rows):
    """save_pre_fp8: the same forward bits, gradients of the activation's derivative taken at the
    pre-activation's e4m3 copy, half the default's bytes for the pre-activation."""
    torch.manual_seed(rows)
    m = make_mlp(device, act, Float8Recipe(min_features=0, save_pre_fp8=True))
    m_default = make_mlp(device, act)
    m_default.load_state_dict(m.state_dict())
    x, g = randn(rows, 64, device=device, scale=2.0), randn(rows, 64, device=device)
    out, grads = run_step(m, x, g)
    out_default, grads_default = run_step(m_default, x, g)
    assert torch.equal(out, out_default), "save_pre_fp8 changed the forward"
    args = (x, m.fc1.weight, m.fc1.bias, m.fc2.weight, m.fc2.bias, g, act, 1, torch.bfloat16)
    ref, ref_default = ref_mlp(*args, pre_fp8=True), ref_mlp(*args)
    for k, v in grads.items():
        assert_fp8_close(v, ref[k], f"grad {k}", fp8_tol(device, "e5m2"))
    if device == "cpu" and act != "relu":
        # negative control: the derivative at the kept copy moves the pre-activation's gradients by
        # more than the CPU tolerance (ReLU's derivative is the sign, which e4m3 keeps)
        assert rel_err(grads["w1"], ref_default["w1"]) > FP8_CPU_TOL, "the kept pre-activation was not quantized"
        assert rel_err(grads_default["w1"], ref_default["w1"]) <= FP8_CPU_TOL


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("act", ["gelu_approx", "swiglu"])
@pytest.mark.parametrize("save_pre_fp8", [False, True])
def test_mlp_backward_frees_its_saved_intermediates_unless_the_graph_is_kept(device, act, save_pre_fp8,
                                                                            deterministic_tuning):
    """The FP8 MLP's node empties the storages of its saved pre (or pre's e4m3 copy) and the
    activation's transposed copy once their last reader has run, where the graph is not kept; with
    retain_graph=True nothing is freed and the next backward gives the same bits. x's FP8 copies
    and the parameters are never freed."""
    torch.manual_seed(0)
    recipe = Float8Recipe(min_features=0, save_pre_fp8=save_pre_fp8)
    m = (FusedGatedMLP(64, 96, activation=act, device=device, dtype=torch.bfloat16, fp8=recipe) if act == "swiglu"
         else make_mlp(device, act, recipe))
    params = list(m.parameters())
    x = randn(48, 64, device=device).requires_grad_()
    dy = randn(48, 64, device=device)
    def step():
        out, saved = saved_tensors(lambda: m(x))
        return out, [t for t in saved if t.numel() > 0]

    def freed(ts):
        return sorted((tuple(t.shape), str(t.dtype)) for t in ts if t.untyped_storage().nbytes() == 0)

    out, own = step()
    kept = torch.autograd.grad(out, [x, *params], dy, retain_graph=True)
    assert freed(own) == []
    again = torch.autograd.grad(out, [x, *params], dy)
    hidden = 96 if act == "swiglu" else 128
    pre_cols = 2 * hidden if act == "swiglu" else hidden
    pre_dtype = "torch.float8_e4m3fn" if save_pre_fp8 else "torch.bfloat16"
    # pre [48, pre_cols] and the activation's transposed copy [hidden, 48 padded to 16]
    assert freed(own) == sorted([((48, pre_cols), pre_dtype), ((hidden, 48), "torch.float8_e4m3fn")])
    assert all(p.untyped_storage().nbytes() > 0 for p in [x, *params])
    out, own = step()
    fresh = torch.autograd.grad(out, [x, *params], dy)
    assert len(freed(own)) == 2
    for a, b, c in zip(kept, again, fresh):
        assert torch.equal(a, b) and torch.equal(a, c)


def saved_bytes(m, x):
    """Bytes of the distinct storages a forward of m saves for backward (parameters left out)."""
    params = {p.untyped_storage().data_ptr() for p in m.parameters()}
    seen = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in params:
            seen[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        m(x.detach().requires_grad_(True))
    return sum(seen.values())


@pytest.mark.parametrize("act", ["gelu_approx", "swiglu"])
def test_save_pre_fp8_keeps_half_of_bf16(act):
    """The bytes kept for backward at level 0 (d 64, hidden 256, 128 tokens): bf16 keeps x, pre and
    the activation (2 bytes each); FP8 by default x^T and the activation in e4m3 and pre in bf16;
    with save_pre_fp8 pre in e4m3 too: half of bf16's, plus the three fp32 scales backward reads
    (x's, the activation's and pre's; the activation's scale itself only levels 1 and 2 keep)."""
    kw = dict(device="cpu", dtype=torch.bfloat16)
    if act == "swiglu":
        make = lambda fp8: FusedGatedMLP(64, 256, activation="swiglu", fp8=fp8, **kw)  # noqa: E731
    else:
        make = lambda fp8: FusedMLP(64, 256, activation=act, fp8=fp8, **kw)  # noqa: E731
    x = randn(128, 64)
    bf16 = saved_bytes(make(None), x)
    fp8 = saved_bytes(make(Float8Recipe(min_features=0)), x)
    half = saved_bytes(make(Float8Recipe(min_features=0, save_pre_fp8=True)), x)
    assert bf16 > fp8 > half, (bf16, fp8, half)
    assert half == bf16 // 2 + 3 * 4, (bf16, half)


def levels_are_bit_identical(make_at_level, step, x, g):
    """Levels 1 and 2 rebuild what level 0 keeps with the forward's scales: the same bits.
    make_at_level(lvl) builds the module; step(module, x, g) -> (out, {name: grad}). A first step
    on 3 x and g / 2 fills delayed scaling's history, so the compared step's delayed scales are not
    its tensors' own amaxes' (a rebuild at a scale of its own would then give other bits)."""
    state = {k: v.clone() for k, v in make_at_level(0).state_dict().items()}
    results = []
    for lvl in (0, 1, 2):
        m = make_at_level(lvl)
        m.load_state_dict(state)
        step(m, 3 * x, g / 2)
        results.append(step(m, x, g))
    for out, grads in results[1:]:
        assert torch.equal(out, results[0][0])
        for k in grads:
            assert torch.equal(grads[k], results[0][1][k]), k


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("scaling", ["current", "delayed"])
def test_mlp_checkpoint_levels_are_bit_identical(device, scaling):
    recipe = Float8Recipe(scaling=scaling, min_features=0)
    levels_are_bit_identical(lambda lvl: make_mlp(device, recipe=recipe, lvl=lvl), run_step,
                             randn(96, 64, device=device), randn(96, 64, device=device))


@pytest.mark.parametrize("device", devices())
def test_mlp_delayed_scaling_state(device):
    recipe = Float8Recipe(scaling="delayed", amax_history_len=4, min_features=0)
    m = make_mlp(device, recipe=recipe)
    assert torch.equal(m.fp8_scales.cpu(), torch.ones(4))
    x = randn(64, 64, device=device, scale=2.0)
    g = randn(64, 64, device=device, scale=0.01)
    run_step(m, x, g)
    amax1 = m.fp8_amax.clone()
    assert amax1[0].item() == pytest.approx(x.abs().max().item())
    assert torch.all(amax1 > 0)  # forward (x, act) and backward (grad_out, grad_pre) recorded
    assert amax1[2].item() == pytest.approx(g.abs().max().item())
    out2, grads2 = run_step(m, x, g)
    # the second step's scales come from the first step's amaxes
    expect = torch.tensor([448.0, 448.0, 57344.0, 57344.0]) / amax1.cpu()
    assert torch.allclose(m.fp8_scales.cpu(), expect, rtol=1e-6)
    assert torch.equal(m.fp8_amax_history[0].cpu(), amax1.cpu())
    ref = ref_mlp(x, m.fc1.weight, m.fc1.bias, m.fc2.weight, m.fc2.bias, g, "gelu_approx", 1, torch.bfloat16,
                  scales=m.fp8_scales.cpu())
    assert_fp8_close(out2, ref["out"], "out with delayed scales", fp8_tol(device))
    for k, v in grads2.items():
        assert_fp8_close(v, ref[k], f"grad {k} with delayed scales", fp8_tol(device))
    # state_dict carries the scaling state, into a layer built with or without the recipe
    sd = m.state_dict()
    assert {"fp8_amax_history", "fp8_scales", "fp8_amax"} <= set(sd)
    for fresh in (make_mlp(device, recipe=recipe), FusedMLP(64, 128, device=device, dtype=torch.bfloat16)):
        fresh.load_state_dict(sd)
        assert torch.equal(fresh.fp8_scales, m.fp8_scales) and torch.equal(fresh.fp8_amax_history, m.fp8_amax_history)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("cast", ["to_dtype", "bfloat16", "half", "double", "to_device_dtype"])
def test_delayed_scaling_buffers_stay_float32_through_module_casts(device, cast):
    """Module.to(dtype) and friends convert the layers' parameters but keep the scaling buffers
    float32, with their values (a scale of 1/3 does not round through bf16)."""
    recipe = Float8Recipe(scaling="delayed", amax_history_len=4, min_features=0)
    layers = [FusedMLP(64, 128, fp8=recipe), FusedGatedMLP(64, 128, fp8=recipe), FusedDense(64, 64, fp8=recipe)]
    for m in layers:
        with torch.no_grad():
            m.fp8_scales.fill_(1.0 / 3.0)
            m.fp8_amax_history.fill_(0.1)
        want = {n: b.clone() for n, b in m.named_buffers()}
        m = {"to_dtype": lambda: m.to(dtype=torch.bfloat16), "bfloat16": m.bfloat16, "half": m.half,
             "double": m.double, "to_device_dtype": lambda: m.to(device, torch.bfloat16)}[cast]()
        for n, b in m.named_buffers():
            assert b.dtype == torch.float32, (type(m).__name__, n, b.dtype)
            assert torch.equal(b.cpu(), want[n]), (type(m).__name__, n)
        assert next(m.parameters()).dtype != torch.float32
        if cast in ("bfloat16", "to_dtype", "to_device_dtype"):
            m = m.to(device)
            x = randn(32, 64, device=device)
            out = m(x)  # the ops accept the buffers: no "scales must be a float32 vector"
            assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()


@pytest.mark.parametrize("device", devices())
def test_mlp_first_microbatch_keeps_weight_copies(device):
    m = make_mlp(device)
    x = randn(32, 64, device=device)
    with pytest.raises(ValueError, match="is_first_microbatch=False reuses"):
        m(x, is_first_microbatch=False)
    a = m(x, is_first_microbatch=True)
    with torch.no_grad():
        m.fc1.weight.mul_(2)  # an optimizer step the kept copies do not see
    b = m(x, is_first_microbatch=False)
    assert torch.equal(a, b)
    c = m(x)
    assert not torch.equal(a, c)  # None: the weights are cast again


LAYER_LEVELS = [("dense", 0), ("mlp", 0), ("mlp", 1), ("mlp", 2), ("gated", 0), ("gated", 1), ("gated", 2)]


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("save_weight", [True, False])
@pytest.mark.parametrize("layer,lvl", LAYER_LEVELS)
def test_backward_keeps_only_the_weight_copies_it_reads(device, layer, lvl, save_weight, monkeypatch):
    """Between the forward and the backward the step holds, of the per-step FP8 weight copies
    [data, data_t, scale_inv, scale], the transposed copies (the data gradients' operands) and
    scale_inv, or with save_weight_fp8=False scale_inv and the scale backward casts the weights
    at again; the row-major copy only of weight1 at level 2, whose backward re-runs fc1. Outputs and gradients
    equal, bit for bit, those of a forward whose whole copies outlive it (the layer keeps them:
    is_first_microbatch=True)."""
    made = []
    quantize = fused_dense.fp8.quantize_weight

    def recording(weight, transposed=True):
        copies = quantize(weight, transposed)
        made.append([weakref.ref(t) for t in copies])
        return copies

    torch.manual_seed(lvl)
    kw = dict(device=device, dtype=torch.bfloat16, fp8=Float8Recipe(min_features=0, save_weight_fp8=save_weight))
    if layer == "dense":
        m = FusedDense(64, 48, **kw)
    elif layer == "mlp":
        m = FusedMLP(64, 128, checkpoint_lvl=lvl, **kw)
    else:
        m = FusedGatedMLP(64, 96, activation="swiglu", checkpoint_lvl=lvl, **kw)
    x = randn(40, 64, device=device)
    g = randn(40, 48 if layer == "dense" else 64, device=device)

    def step(**call):
        xr = x.detach().requires_grad_(True)
        for p in m.parameters():
            p.grad = None
        out = m(xr, **call)
        gc.collect()
        held = [[r() is not None and r().numel() > 0 for r in refs] for refs in made]
        out.backward(g)
        return held, [out, xr.grad] + [p.grad for p in m.parameters()]

    monkeypatch.setattr(fused_dense.fp8, "quantize_weight", recording)
    held, got = step()
    # per weight quantized (the MLPs: weight1, for the gated one the packed gate / up, then weight2)
    expected = [[False, save_weight, True, not save_weight]]
    if layer != "dense":
        expected = [[lvl == 2, save_weight, True, not save_weight], [False, save_weight, True, not save_weight]]
    assert held == expected, f"copies held after the forward (data, data_t, scale_inv, scale per weight): {held}"
    made.clear()
    held, want = step(is_first_microbatch=True)
    assert all(h[1] for h in held), "copies kept for later micro-batches are whole"
    for a, b in zip(got, want):
        assert torch.equal(a, b)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("layer,lvl", LAYER_LEVELS)
def test_weights_cast_again_at_the_forward_scale(device, layer, lvl, monkeypatch):
    """With save_weight_fp8=False backward casts each weight whose data gradient runs once, at the
    scale its forward copies were made with (fp8_quantize given that scale: no amax pass over the
    weight), transposed only; the bytes are the forward's (test above)."""
    from conftest import OpLog
    made = []
    quantize = fused_dense.fp8.quantize_weight

    def recording(weight, transposed=True):
        copies = quantize(weight, transposed)
        made.append((weight, copies))
        return copies

    monkeypatch.setattr(fused_dense.fp8, "quantize_weight", recording)
    torch.manual_seed(lvl)
    kw = dict(device=device, dtype=torch.bfloat16, fp8=Float8Recipe(min_features=0, save_weight_fp8=False))
    m = (FusedDense(64, 48, **kw) if layer == "dense" else FusedMLP(64, 128, checkpoint_lvl=lvl, **kw)
         if layer == "mlp" else FusedGatedMLP(64, 96, activation="swiglu", checkpoint_lvl=lvl, **kw))
    x = randn(40, 64, device=device).requires_grad_(True)
    out = m(x)
    with OpLog() as log:
        out.backward(torch.randn_like(out))
    assert len(made) == (1 if layer == "dense" else 2)
    for weight, (_, data_t, _, scale) in made:
        assert data_t.numel() == 0
        casts = [a for n, a in zip(log.names, log.args) if n == "fp8_quantize" and a[0].shape == weight.shape]
        assert len(casts) == 1, f"{len(casts)} casts of a {tuple(weight.shape)} weight in backward"
        (_, _, _, _, fmt, given, rowwise, columnwise, _) = casts[0][:9]
        assert given is not None and torch.equal(given, scale), "backward cast the weight at a scale of its own"
        assert (fmt, rowwise, columnwise) == (0, False, True)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("save_weight", [True, False])
@pytest.mark.parametrize("layer,lvl", [("dense", 0), ("mlp", 0), ("gated", 2)])
def test_weight_changed_before_backward_is_an_error(device, save_weight, layer, lvl):
    """A weight changed in place between the forward and a backward whose data gradient reads it
    raises autograd's saved-tensor error, as nn.Linear's does, whether backward reads the forward's
    transposed FP8 copy (save_weight_fp8=True) or quantizes the weight again (False): never
    gradients of a weight other than the one the forward used, silently. With the input needing no
    gradient, no data gradient reads the weight and backward runs, as nn.Linear's does."""
    kw = dict(device=device, dtype=torch.bfloat16, fp8=Float8Recipe(min_features=0, save_weight_fp8=save_weight))
    def build():
        torch.manual_seed(0)
        return (FusedDense(64, 48, **kw) if layer == "dense" else
                FusedMLP(64, 128, checkpoint_lvl=lvl, **kw) if layer == "mlp" else
                FusedGatedMLP(64, 96, activation="swiglu", checkpoint_lvl=lvl, **kw))
    x = randn(40, 64, device=device)
    def weights(m):
        return [p for p in m.parameters() if p.dim() == 2]
    assert len(weights(build())) == (1 if layer == "dense" else 2)
    for i in range(len(weights(build()))):  # each weight of the layer changed, in turn
        m = build()
        out = m(x.clone().requires_grad_(True))
        with torch.no_grad():
            weights(m)[i].mul_(2)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            out.backward(torch.ones_like(out))
    if layer == "dense":  # the reference: nn.Linear raises where the data gradient reads the weight
        lin = torch.nn.Linear(64, 48, device=device, dtype=torch.bfloat16)
        out = lin(x.clone().requires_grad_(True))
        with torch.no_grad():
            lin.weight.mul_(2)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            out.backward(torch.ones_like(out))
        m = build()
        out = m(x)  # no input gradient: the weight gradient alone, from x's copy
        with torch.no_grad():
            m.weight.mul_(2)
        out.backward(torch.ones_like(out))
        assert m.weight.grad is not None


def test_recipe_save_weight_fp8_is_a_bool():
    with pytest.raises(ValueError, match="save_weight_fp8 must be True or False, got 0"):
        Float8Recipe(save_weight_fp8=0)


@pytest.mark.parametrize("device", devices())
def test_dense_matches_reference(device):
    if device == "cuda":
        poison_cuda_cache()
    lin = FusedDense(64, 48, device=device, dtype=torch.bfloat16, fp8=Float8Recipe(min_features=0))
    x = randn(3, 25, 64, device=device).requires_grad_(True)
    g = randn(3, 25, 48, device=device)
    out = lin(x)
    out.backward(g)
    assert out.shape == (3, 25, 48)
    x2, g2 = x.detach().reshape(-1, 64).double().cpu(), g.reshape(-1, 48).double().cpu()
    xq, _ = fake_quant(x2, 0)
    wq, _ = fake_quant(lin.weight, 0)
    gq, _ = fake_quant(g2, 1)
    assert_fp8_close(out.reshape(-1, 48), xq @ wq.T + lin.bias.double().cpu(), "out", fp8_tol(device))
    assert_fp8_close(x.grad.reshape(-1, 64), gq @ wq, "grad x", fp8_tol(device))
    assert_fp8_close(lin.weight.grad, gq.T @ xq, "grad weight", fp8_tol(device))
    assert_fp8_close(lin.bias.grad, g2.sum(0), "grad bias", fp8_tol(device))


def test_size_rule_keeps_narrow_layers_in_model_dtype():
    torch.manual_seed(0)
    narrow = FusedMLP(64, 128, fp8=Float8Recipe())  # min_features 2048 by default
    plain = FusedMLP(64, 128)
    plain.load_state_dict(narrow.state_dict())
    x = randn(16, 64, dtype=torch.float32)
    assert torch.equal(narrow(x), plain(x))
    forced = FusedMLP(64, 128, fp8=Float8Recipe(min_features=0))
    forced.load_state_dict(narrow.state_dict())
    assert not torch.equal(forced(x), plain(x))
    assert Float8Recipe().min_features == fused_dense.fp8.DEFAULT_MIN_FEATURES


def test_autocast_and_convert():
    torch.manual_seed(0)
    m = FusedMLP(64, 128, dtype=torch.bfloat16)
    ref = FusedMLP(64, 128, dtype=torch.bfloat16, fp8=Float8Recipe(min_features=0))
    ref.load_state_dict(m.state_dict())
    x = randn(8, 64)
    with fused_dense.fp8_autocast(recipe=Float8Recipe(min_features=0)):
        a = m(x)
        with fused_dense.fp8_autocast(enabled=False):
            off = m(x)
    assert torch.equal(a, ref(x))
    assert torch.equal(off, m(x)) and not torch.equal(off, a)
    model = torch.nn.Sequential(FusedDense(64, 64, dtype=torch.bfloat16), m)
    fused_dense.convert_to_fp8(model, Float8Recipe(min_features=0))
    assert model[0].fp8 == Float8Recipe(min_features=0) and m.fp8 == Float8Recipe(min_features=0)


def test_recipe_errors():
    with pytest.raises(ValueError, match="scaling must be 'current' or 'delayed', got 'dynamic'"):
        Float8Recipe(scaling="dynamic")
    with pytest.raises(ValueError, match="grad_format"):
        Float8Recipe(grad_format="e3m4")
    with pytest.raises(ValueError, match="amax_history_len"):
        Float8Recipe(amax_history_len=0)
    with pytest.raises(ValueError, match="save_pre_fp8 must be True or False, got 1"):
        Float8Recipe(save_pre_fp8=1)
    with pytest.raises(ValueError, match=r"compiled_input_quantize must be one of \('traced', 'traced_rowwise', "
                                         r"'op'\), got 'rows'"):
        Float8Recipe(compiled_input_quantize="rows")
    assert Float8Recipe(compiled_input_quantize="traced_rowwise").compiled_input_quantize == "traced_rowwise"
    with pytest.raises(TypeError, match="fp8 must be None, a bool or a fused_dense.Float8Recipe"):
        FusedMLP(64, 128, fp8="yes")
    m = FusedMLP(64, 128, fp8=Float8Recipe(min_features=0))
    m.activation = "swiglu"  # a gated activation over a plain fc1: the op names the packed layout
    with pytest.raises(ValueError, match=r"gated MLP's weight1 is the packed .* must be 256, got weight1 shape"):
        m(randn(4, 64, dtype=torch.float32))
    with pytest.raises(ValueError, match="activation must be 1 .* got 6"):
        torch.ops.fused_dense.fused_mlp_fp8(randn(4, 64), m.fc1.weight, None, m.fc2.weight, None, 6, 0,
                                            fused_dense.fp8.quantize_weight(m.fc1.weight)
                                            + fused_dense.fp8.quantize_weight(m.fc2.weight), 1, None, None, [])


def test_torchao_converted_mlp_runs_fp8_and_warns():
    """A FusedMLP whose fc1 / fc2 torchao's convert_to_float8_training replaced must not silently
    stay in the model's dtype. (torchao swaps nn.Linear children for its Float8Linear; a stand-in
    class of that name and module does the same here, torchao or not.)"""
    Float8Linear = type("Float8Linear", (torch.nn.Linear,), {"__module__": "torchao.float8.float8_linear"})
    torch.manual_seed(0)
    m = FusedMLP(64, 128, dtype=torch.bfloat16)
    ref = FusedMLP(64, 128, dtype=torch.bfloat16, fp8=Float8Recipe(min_features=0))
    ref.load_state_dict(m.state_dict())
    for name in ("fc1", "fc2"):
        old = getattr(m, name)
        new = Float8Linear(old.in_features, old.out_features, dtype=torch.bfloat16)
        new.load_state_dict(old.state_dict())
        setattr(m, name, new)
    x = randn(8, 64)
    fused_dense.fp8._TORCHAO_WARNED[0] = False
    with pytest.warns(UserWarning, match="torchao's convert_to_float8_training"):
        out = m(x)
    assert torch.equal(out, ref(x))


def compile_matches_eager(make, step, d=64):
    """torch.compile(fullgraph=True) of an FP8 step of make()'s module gives the eager step's bits,
    and with delayed scaling the same scaling state (amaxes recorded in forward and backward, the
    history, the scales) over two steps. step(module, x, g) -> (out, {name: grad}); d: the
    module's input and output width."""
    torch._dynamo.reset()
    m, eager = make(), make()
    eager.load_state_dict(m.state_dict())
    compiled = torch.compile(m, fullgraph=True)
    for _ in range(2):
        x, g = randn(32, d), randn(32, d)
        eager_out, eager_grads = step(eager, x, g)
        out, grads = step(compiled, x, g)
        assert torch.equal(out, eager_out)
        for k in grads:
            assert torch.equal(grads[k], eager_grads[k]), k
        for k, v in eager.state_dict().items():
            assert torch.equal(m.state_dict()[k], v), k


def graph_replay_matches_eager(make, step, d):
    """A captured FP8 step of make()'s module (weights cast, scales derived and amaxes recorded
    inside the graph) replays to the eager step's results on new data."""
    from conftest import capture_training_step

    torch.manual_seed(0)
    m, eager = make(), make()
    static_x = randn(256, d, device="cuda").requires_grad_(True)
    static_g = randn(256, d, device="cuda")
    graph, static_out, grads = capture_training_step(m, static_x, static_g)
    eager.load_state_dict(m.state_dict())  # the same weights and, for delayed, the same scaling state
    x, g = randn(256, d, device="cuda"), randn(256, d, device="cuda")
    static_x.data.copy_(x)
    static_g.copy_(g)
    graph.replay()
    out, _ = step(eager, x, g)
    assert torch.equal(static_out, out)
    for got, p in zip(grads, eager.parameters()):
        assert torch.equal(got, p.grad)


@pytest.mark.parametrize("scaling", ["current", "delayed"])
def test_compile_fullgraph(scaling):
    recipe = Float8Recipe(scaling=scaling, min_features=0)
    compile_matches_eager(lambda: make_mlp("cpu", recipe=recipe), run_step)


@cuda
@fp8_gpu
@pytest.mark.parametrize("scaling", ["current", "delayed"])
def test_cuda_graph_replays_fp8_step(scaling):
    recipe = Float8Recipe(scaling=scaling, min_features=0)
    graph_replay_matches_eager(lambda: make_mlp("cuda", recipe=recipe, d=128, h=256), run_step, 128)
