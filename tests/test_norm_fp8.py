"""norm_fp8 / norm_backward (csrc/torch/norm.cpp): RMSNorm and LayerNorm with the FP8 copies of
their output, against float64 definitions written here and, for the FP8 bytes, against
fp8_quantize run on the norm's output (the same bytes by contract)."""
import pytest
import torch

import fused_dense  # noqa: F401  (loads the ops)
from conftest import rel_err

OPS = torch.ops.fused_dense
E4M3, E5M2 = 0, 1


def definition(x, weight, bias, eps, layer_norm):
    x = x.double()
    mean = x.mean(1, keepdim=True) if layer_norm else torch.zeros_like(x[:, :1])
    rstd = torch.rsqrt(((x - mean) ** 2).mean(1, keepdim=True) + eps)
    y = (x - mean) * rstd * weight.double()
    if bias is not None:
        y = y + bias.double()
    return y, rstd.squeeze(1), mean.squeeze(1)


def inputs(device, dtype, rows=33, cols=64, bias=True):
    x = torch.randn(rows, cols, device=device, dtype=dtype) * 3 + 0.5
    weight = 1 + 0.2 * torch.randn(cols, device=device, dtype=dtype)
    b = 0.1 * torch.randn(cols, device=device, dtype=dtype) if bias else None
    return x, weight, b


def assert_same_bytes(a, b, what):
    assert a.shape == b.shape and a.dtype == b.dtype, what
    assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), what


def check_forward(device, dtype, layer_norm, fp8_format, delayed, rowwise=True, columnwise=True, x=None):
    if x is None:
        x, weight, b = inputs(device, dtype, bias=layer_norm)
    else:
        _, weight, b = inputs(device, dtype, cols=x.shape[1], bias=layer_norm)
    scale = torch.tensor(7.5, device=device) if delayed else None
    res = OPS.norm_fp8(x, weight, b, 1e-5, layer_norm, fp8_format, scale, rowwise, columnwise)
    out, data, data_t, s, s_inv, amax, rstd, mean = res
    y, rstd_ref, mean_ref = definition(x, weight, b, 1e-5, layer_norm)
    # out: one rounding of y (0.44 u measured in bf16 over 5 seeds) plus the fp32 statistics' error
    # (fp32 out: 1.18 u measured): 0.6 u + 2 u_fp32
    u, u32 = torch.finfo(dtype).eps / 2, torch.finfo(torch.float32).eps / 2
    assert rel_err(out, y) <= 0.6 * u + 2 * u32, rel_err(out, y)
    assert rel_err(rstd, rstd_ref) <= 1e-6
    if layer_norm:
        assert rel_err(mean, mean_ref) <= 1e-5
    else:
        assert mean.numel() == 0
    # the FP8 copies are fp8_quantize's of out, on the same device, byte for byte
    q = OPS.fp8_quantize(out, None, 0, False, fp8_format, scale, rowwise, columnwise, False)
    if rowwise:
        assert_same_bytes(data, q[0], "data")
    if columnwise:
        assert_same_bytes(data_t, q[1], "data_t")
    for name, got, want in (("scale", s, q[2]), ("scale_inv", s_inv, q[3]), ("amax", amax, q[4])):
        assert torch.equal(got, want), (name, got, want)
    assert amax.item() == out.float().abs().max().item()


def forward_cases(test):
    """The forward's cases: dtype x norm x FP8 format x scaling."""
    for name, values in (("delayed", [False, True]), ("fp8_format", [E4M3, E5M2]), ("layer_norm", [False, True])):
        test = pytest.mark.parametrize(name, values)(test)
    return pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)(test)


@forward_cases
def test_cpu_forward(dtype, layer_norm, fp8_format, delayed):
    check_forward("cpu", dtype, layer_norm, fp8_format, delayed)


@pytest.mark.parametrize("rowwise,columnwise", [(True, False), (False, True)])
def test_cpu_one_copy(rowwise, columnwise):
    check_forward("cpu", torch.bfloat16, False, E4M3, False, rowwise, columnwise)


@pytest.mark.parametrize("layer_norm", [False, True])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=str)
def test_cpu_backward(dtype, layer_norm):
    x, weight, b = inputs("cpu", dtype, bias=layer_norm)
    _, rstd, mean = definition(x, weight, b, 1e-5, layer_norm)
    stats = torch.float64 if dtype == torch.float64 else torch.float32
    g = torch.randn_like(x)
    got = OPS.norm_backward(g, x, weight, rstd.to(stats), mean.to(stats) if layer_norm else None,
                            [True, True, layer_norm])
    leaves = [t.double().requires_grad_() for t in (x, weight) + ((b,) if layer_norm else ())]
    y, _, _ = definition(leaves[0], leaves[1], leaves[2] if layer_norm else None, 1e-5, layer_norm)
    want = torch.autograd.grad(y, leaves, g.double())
    # fp32 math from the rounded inputs, one rounding of each result. Measured over 5 seeds:
    # float64 1.3e-16, float32 <= 2.0 u (the weight's 33-row sum), bf16 <= 0.48 u; allowed 100 u
    # (float64), 4 u (float32), 1 u (bf16: a 1% error fails)
    u = torch.finfo(dtype).eps / 2
    tol = {torch.float64: 100 * u, torch.float32: 4 * u, torch.bfloat16: u}[dtype]
    for name, a, r in zip(("x", "weight", "bias"), got, want):
        assert rel_err(a, r) <= tol, (name, rel_err(a, r))


def test_cpu_backward_skips_what_is_not_asked():
    x, weight, _ = inputs("cpu", torch.float32, bias=False)
    _, rstd, _ = definition(x, weight, None, 1e-5, False)
    gx, gw, gb = OPS.norm_backward(torch.randn_like(x), x, weight, rstd.float(), None, [True, False, False])
    assert gx.shape == x.shape and gw.numel() == 0 and gb.numel() == 0


@pytest.mark.parametrize("make,match", [
    (lambda x, w: (x.double(), w.double()), "x must be float16, bfloat16 or float32"),
    (lambda x, w: (x[:, :60], w[:60]), "multiple of 8"),
    (lambda x, w: (x, w[:32]), "weight must be \\[cols\\] = \\[64\\]"),
    (lambda x, w: (x, w.float()), "weight must have the dtype of x"),
])
def test_cpu_bad_input(make, match):
    x, weight, _ = inputs("cpu", torch.bfloat16, bias=False)
    x, weight = make(x, weight)
    with pytest.raises(ValueError, match=match):
        OPS.norm_fp8(x.contiguous(), weight.contiguous(), None, 1e-5, False, E4M3, None, True, False)


def test_cpu_bad_backward_input():
    x, weight, _ = inputs("cpu", torch.bfloat16, bias=False)
    with pytest.raises(ValueError, match="rstd must be Float \\[rows\\] = \\[33\\]"):
        OPS.norm_backward(torch.randn_like(x), x, weight, torch.ones(33, dtype=torch.bfloat16), None,
                          [True, True, False])
    with pytest.raises(ValueError, match="eps must be finite and >= 0"):
        OPS.norm_fp8(x, weight, None, -1.0, False, E4M3, None, True, False)


def test_meta_shapes():
    x, weight, b = (t.to("meta") for t in inputs("cpu", torch.bfloat16))
    out, data, data_t, s, s_inv, amax, rstd, mean = OPS.norm_fp8(x, weight, b, 1e-5, True, E4M3, None, True, True)
    assert (out.shape, out.dtype, data.shape, data_t.shape) == (x.shape, x.dtype, x.shape, (64, 48))
    assert (rstd.shape, mean.shape, rstd.dtype) == ((33,), (33,), torch.float32)
    gx, gw, gb = OPS.norm_backward(out, x, weight, rstd, mean, [True, True, True])
    assert (gx.shape, gw.shape, gb.shape) == (x.shape, (64,), (64,))


def test_opcheck():
    x, weight, b = inputs("cpu", torch.float32, rows=7, cols=16)
    # opcheck's schema test multiplies inputs, which PyTorch lacks for float8 outputs: the
    # registration, fake-tensor and dispatch tests
    torch.library.opcheck(OPS.norm_fp8.default, (x, weight, b, 1e-5, True, E4M3, None, True, True),
                          test_utils=("test_autograd_registration", "test_faketensor"))
    _, rstd, mean = definition(x, weight, b, 1e-5, True)
    torch.library.opcheck(OPS.norm_backward.default,
                          (torch.randn_like(x), x, weight, rstd.float(), mean.float(), [True, True, True]))


# ---- CUDA: the core's norm kernel (its amax fed to the quantize pass) ----

@pytest.mark.cuda
@forward_cases
def test_cuda_forward(dtype, layer_norm, fp8_format, delayed):
    check_forward("cuda", dtype, layer_norm, fp8_format, delayed)


@pytest.mark.cuda
def test_cuda_unaligned_rows_take_the_scalar_path():
    flat = torch.randn(33 * 64 + 1, device="cuda", dtype=torch.bfloat16)
    x = flat[1:].view(33, 64)  # 2 bytes off a 16-byte boundary
    check_forward("cuda", torch.bfloat16, True, E4M3, False, x=x)


@pytest.mark.cuda
@pytest.mark.parametrize("layer_norm", [False, True])
def test_cuda_matches_the_cpu_reference(layer_norm):
    x, weight, b = inputs("cpu", torch.bfloat16, rows=300, cols=4096, bias=layer_norm)
    cpu = OPS.norm_fp8(x, weight, b, 1e-6, layer_norm, E4M3, None, True, True)
    cuda = OPS.norm_fp8(x.cuda(), weight.cuda(), b.cuda() if layer_norm else None, 1e-6, layer_norm, E4M3, None,
                        True, True)
    # the row sums run in another order, so mean and rstd differ in their last fp32 bits (rstd:
    # <= 1e-6 relative, checked below); out may then round to the neighbouring bf16 value. Where
    # the bias cancels the normalised term, out is small and that fp32 difference, relative to the
    # terms (|x - mean| * rstd * |w| + |b|), exceeds out's own unit: the bound is both.
    diff = (cuda[0].cpu().float() - cpu[0].float()).abs()
    ulp = cpu[0].float().abs() * torch.finfo(torch.bfloat16).eps
    mean = cpu[7].view(-1, 1) if layer_norm else 0.0
    terms = (x.float() - mean).abs() * cpu[6].view(-1, 1) * weight.float().abs()
    if layer_norm:
        terms = terms + b.float().abs()
    assert bool((diff <= ulp + 4e-6 * terms).all())
    assert (diff > 0).float().mean().item() < 0.01
    assert rel_err(cuda[6].cpu(), cpu[6]) <= 1e-6


def check_backward(device, dtype, layer_norm, rows, cols, offset=0, grads=None):
    """norm_backward on device against the float64 definition's autograd; offset: the inputs start
    that many elements past an aligned address (the kernel's scalar path)."""
    x, weight, b = inputs(device, dtype, rows=rows, cols=cols, bias=layer_norm)
    if offset:
        flat = torch.empty(rows * cols + offset, device=device, dtype=dtype)
        flat[offset:].copy_(x.flatten())
        x = flat[offset:].view(rows, cols)
    _, rstd, mean = definition(x, weight, b, 1e-5, layer_norm)
    g = torch.randn_like(x)
    grads = grads or [True, True, layer_norm]
    got = OPS.norm_backward(g, x, weight, rstd.float(), mean.float() if layer_norm else None, grads)
    leaves = [t.double().requires_grad_() for t in (x, weight) + ((b,) if layer_norm else ())]
    y, _, _ = definition(leaves[0], leaves[1], leaves[2] if layer_norm else None, 1e-5, layer_norm)
    want = torch.autograd.grad(y, leaves, g.double())
    # as test_cpu_backward: fp32 math, one rounding of each result; the column sums of up to 600
    # rows in fp32 (each block's rows, then the blocks' partial sums) add about 2 u_fp32 more
    u = torch.finfo(dtype).eps / 2
    tol = {torch.float32: 8 * u, torch.float16: u, torch.bfloat16: u}[dtype]
    for name, asked, a, r in zip(("x", "weight", "bias"), grads, got, want):
        if asked:
            assert rel_err(a, r) <= tol, (name, rel_err(a, r))
        else:
            assert a.numel() == 0, name
    return got


@pytest.mark.cuda
@pytest.mark.parametrize("layer_norm", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("rows, cols", [(33, 64), (600, 4096), (7, 8192), (300, 36)])
def test_cuda_backward(dtype, layer_norm, rows, cols):
    """The core's kernel: 16-byte vectors (cols a multiple of 8), more rows than blocks (600),
    fewer (7, 33), a width the vectors do not divide (36: the scalar path)."""
    check_backward("cuda", dtype, layer_norm, rows, cols)


@pytest.mark.cuda
def test_cuda_backward_unaligned_and_partial():
    check_backward("cuda", torch.bfloat16, True, 40, 64, offset=1)
    for grads in ([True, False, False], [False, True, False], [False, False, True], [False, True, True]):
        check_backward("cuda", torch.bfloat16, True, 70, 128, grads=grads)
    # wider than the kernel's shared-memory column sums: the ATen composition, same contract
    check_backward("cuda", torch.bfloat16, True, 3, 25_000)


@pytest.mark.cuda
def test_cuda_backward_matches_the_cpu_reference():
    x, weight, b = inputs("cpu", torch.bfloat16, rows=300, cols=4096, bias=True)
    _, rstd, mean = definition(x, weight, b, 1e-5, True)
    g = torch.randn_like(x)
    cpu = OPS.norm_backward(g, x, weight, rstd.float(), mean.float(), [True, True, True])
    cuda = OPS.norm_backward(g.cuda(), x.cuda(), weight.cuda(), rstd.float().cuda(), mean.float().cuda(),
                             [True, True, True])
    # both round one fp32 result per element; the fp32 sums run in other orders (the row sums
    # c1, c2 agree to ~1e-6 relative), so a value may round to the neighbouring bf16 one. Where
    # grad_x's terms cancel, grad_x is small and that fp32 difference, relative to the terms
    # rstd * (|g w| + |xhat c1| + |c2|), exceeds its own unit: the bound is both (as the forward's)
    eps = torch.finfo(torch.bfloat16).eps
    x64, g64, w64 = x.double(), g.double(), weight.double()
    xhat = (x64 - mean.view(-1, 1)) * rstd.view(-1, 1)
    gy = g64 * w64
    c1, c2 = (gy * xhat).mean(1, keepdim=True), gy.mean(1, keepdim=True)
    terms = rstd.view(-1, 1) * (gy.abs() + (xhat * c1).abs() + c2.abs())
    bounds = (terms * 4e-6, 0.0, 0.0)
    for a, r, extra in zip(cuda, cpu, bounds):
        diff = (a.cpu().double() - r.double()).abs()
        assert bool((diff <= r.double().abs() * eps + extra).all())
        assert (diff > 0).double().mean().item() < 0.01


@pytest.mark.cuda
def test_cuda_nan_reaches_the_amax():
    x, weight, _ = inputs("cuda", torch.bfloat16, bias=False)
    x[5, 7] = float("nan")
    amax = OPS.norm_fp8(x, weight, None, 1e-5, False, E4M3, None, True, False)[5]
    assert torch.isnan(amax)
