"""Float64 references and checkers for the raw ops (torch.ops.fused_dense.*), shared by the
tests/test_op_*.py files, tests/test_relu_mask.py and tests/test_flash_attn_entry_points.py.

Every result is compared with a float64 reference written here in plain PyTorch (F.linear,
F.gelu(approximate='tanh'), relu, relu^2, matmul), never with the library's CPU reference
kernel, on fresh random inputs each run. The ReLU bit-mask is decoded with numpy.unpackbits
(bitorder='little'), independently of the C++ packing.

ReLU bit-mask layout (docs/contract.md; fused_dense.ops.relu_mask_row_bytes): bit j % 8 of byte
j // 8 of row i is set exactly when pre_act[i, j] >= 0 (cuBLASLt's RELU_AUX convention, which every
path follows); padding bits past N are zero.

Entry points a checker can call (`entry=`):
    "op"          torch.ops.fused_dense.linear_act / act_linear_dgrad / linear_bias_wgrad / act_forward
    "flash_attn"  torch.ops.fused_dense.linear_act_forward / bias_act_linear_dgrad_bgrad, the
                  flash-attn compatible ops (GELU or ReLU only, bias gradient always computed)
    "lib"         the same through the fused_dense_lib module
    "py"          the Python wrappers in fused_dense.ops (activation names instead of codes)
Tolerances are conftest.TOL (docs/contract.md).
"""
import math
import random

import numpy as np
import torch
import torch.nn.functional as F

import fused_dense_lib
from fused_dense import ops

from conftest import TOL, assert_close_rel, poison_cuda_cache, subnormal_floor

OPS = torch.ops.fused_dense
ACT_CODE = {"none": 0, "gelu_approx": 1, "relu": 2, "sqrelu": 3}
ACTS = list(ACT_CODE)
CPU_DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
HALF_DTYPES = [torch.float16, torch.bfloat16]
# -2 'auto', -1 the unfused path, >= 0 a cuBLASLt heuristic index (may be past the list offered)
CUDA_HEURISTICS = [-2, -1, 0, 1, 2, 3]
# the CPU reference ignores the heuristic; the CPU tests pass a random one to show it
CPU_HEURISTICS = [-2, -1, 0, 3]

# (B, K, N): odd sizes, sizes 1, widths that are / are not multiples of 8 and 128, and empty dims.
CPU_SHAPES = [
    (1, 1, 1), (3, 7, 13), (7, 13, 3), (13, 33, 7), (33, 127, 65), (127, 3, 33), (2, 64, 128),
    (5, 136, 136), (1, 128, 9), (0, 7, 13), (0, 16, 8), (4, 0, 9), (4, 9, 0),
]

# (B, K, N): B in {1, 17, 256, 1000}; K, N in {33, 64, 128, 136, 1024}. N = 64 / 136 / 33 make cuBLASLt
# refuse the ReLU bit-mask (the elementwise fallback must still be right); N = 128 / 1024 take it.
CUDA_SHAPES = [
    (1, 64, 64), (17, 33, 136), (256, 128, 128), (1000, 1024, 1024), (17, 136, 33), (256, 1024, 64),
    (1000, 64, 1024), (1, 1024, 128), (17, 128, 256), (256, 136, 1024), (1000, 33, 128),
]
CUDA_EDGE_SHAPES = [(0, 64, 128), (0, 33, 7), (5, 0, 128), (5, 64, 0)]

# act_forward is elementwise: any rank, empty tensors and a 0-d tensor included.
ACT_FORWARD_SHAPES = [(1,), (7,), (33,), (3, 13), (5, 127), (2, 3, 5), (0, 8), (4, 0), ()]


def shape_id(shape):
    return "x".join(map(str, shape))


def random_shapes(n=2, max_dim=150):
    """Fresh random shapes each run (failure messages print the shape)."""
    return [tuple(random.randint(1, max_dim) for _ in range(3)) for _ in range(n)]


def cpu_shapes():
    return CPU_SHAPES + random_shapes()


def forward_cases():
    """(activation, has_bias, save_pre_act) of every valid linear_act call (nothing to save for 'none')."""
    for act in ACTS:
        for save in (False, True):
            if act == "none" and save:
                continue
            for has_bias in (False, True):
                yield act, has_bias, save


# ----------------------------------------------------------------------------- references

def randn(*shape, dtype, device="cpu", scale=1.0):
    """Random normal in `dtype` (drawn in fp32/fp64, then rounded). Never all zeros."""
    base = torch.float64 if dtype == torch.float64 else torch.float32
    return (torch.randn(*shape, dtype=base, device=device) * scale).to(dtype)


def ref_act(pre, act):
    if act == "none":
        return pre
    if act == "gelu_approx":
        return F.gelu(pre, approximate="tanh")
    if act == "relu":
        return torch.relu(pre)
    if act == "sqrelu":
        return torch.relu(pre) ** 2
    raise AssertionError(act)


def ref_act_grad(pre, act):
    """d act(pre) / d pre in float64, from PyTorch's autograd of the plain activation."""
    p = pre.detach().to(torch.float64).requires_grad_()
    (g,) = torch.autograd.grad(ref_act(p, act).sum(), p)
    return g


def ref_pre(x, w, b):
    return F.linear(x.double(), w.double(), None if b is None else b.double())


def unpack_bits(mask):
    """uint8 [B, nbytes] -> bool [B, nbytes * 8], bit j % 8 of byte j // 8 (LSB first)."""
    m = mask.detach().cpu().numpy()
    bits = np.unpackbits(m, axis=1, bitorder="little") if m.size else np.zeros((m.shape[0], m.shape[1] * 8), np.uint8)
    return torch.from_numpy(bits.astype(bool))


def pack_bits(positive, set_padding=False):
    """bool [B, N] -> uint8 [B, ceil(N / 8)] in the documented layout. set_padding fills the
    bits past N with ones (the ops must ignore them)."""
    p = positive.detach().cpu().numpy().astype(np.uint8)
    rows, cols = p.shape
    nbytes = (cols + 7) // 8
    padded = np.zeros((rows, nbytes * 8), np.uint8)
    padded[:, :cols] = p
    if set_padding:
        padded[:, cols:] = 1
    return torch.from_numpy(np.packbits(padded, axis=1, bitorder="little") if nbytes else np.zeros((rows, 0), np.uint8))


def check_relu_mask(mask, out, pre64, ctx, margin=1e-2):
    """The saved ReLU mask: dtype, shape, zero padding bits, and bit (i, j) == (pre[i, j] >= 0).

    Exactness against a float64 reference is only decidable away from 0 (the op's pre-activation
    is a rounded fp32-accumulated GEMM), so: every element with out > 0 must have its bit set;
    every element with |pre64| > margin must have bit == (pre64 >= 0). (Bit-for-bit CPU == CUDA,
    exact zeros included, is tested in test_relu_mask.py on inputs whose GEMM is exact.)
    """
    B, N = out.shape
    assert mask.dtype == torch.uint8, f"{ctx}: mask dtype {mask.dtype}, expected uint8"
    assert tuple(mask.shape) == (B, (N + 7) // 8), f"{ctx}: mask shape {tuple(mask.shape)}, expected {(B, (N + 7) // 8)}"
    assert mask.device == out.device, f"{ctx}: mask on {mask.device}, out on {out.device}"
    bits = unpack_bits(mask)
    assert not bits[:, N:].any(), f"{ctx}: padding bits past N={N} are set"
    bits = bits[:, :N]
    pos_out = (out > 0).cpu()
    assert bits[pos_out].all(), f"{ctx}: {int((~bits[pos_out]).sum())} elements with out > 0 have their mask bit clear"
    p = pre64.cpu()
    sure = p.abs() > margin
    wrong = (bits != (p >= 0)) & sure
    assert not wrong.any(), f"{ctx}: {int(wrong.sum())} mask bits disagree with sign(pre) where |pre| > {margin}"


def assert_rel(out, ref, dtype, what, floor=0.0):
    """||out - ref|| / max(||ref||, floor) <= TOL[dtype], in float64 (rel_err when floor is 0).

    `floor` guards the two ill-conditioned cases small random tensors run into (see callers); it
    never loosens the check of a well-conditioned result, whose ||ref|| is far above the floor.
    """
    if floor == 0.0:
        return assert_close_rel(out, ref, dtype, what)
    floor = max(float(floor), subnormal_floor(out.dtype, out.numel(), TOL[dtype]))
    assert out.shape == ref.shape, f"{what}: shape {tuple(out.shape)} != reference shape {tuple(ref.shape)}"
    if out.numel() == 0:
        return
    o = out.detach().double()
    r = ref.detach().to(device=o.device, dtype=torch.float64)
    diff = torch.linalg.vector_norm(o - r).item() if torch.isfinite(o).all() else math.inf
    denom = max(torch.linalg.vector_norm(r).item(), float(floor))
    err = diff / denom if denom > 0 else diff
    assert err <= TOL[dtype], f"{what}: relative error {err:.3e} > {TOL[dtype]:.1e} (dtype {dtype}, shape {tuple(out.shape)})"


def norm(t):
    return torch.linalg.vector_norm(t.double()).item()


def sum_floor(terms):
    """Typical size of terms.sum(0): ||sqrt(sum_b terms[b]^2)||. A column sum may cancel far below
    the size of its terms; the rounding error of the terms does not cancel with it, so the error
    of a sum is judged against this (equal to ||sum|| in expectation for random signs)."""
    return norm(terms.double().square().sum(0).sqrt())


def gelu_floor(act, scale):
    """GELU's negative tail is ill-conditioned: 1 + tanh(z) cancels (fp32 math error ~ 6e-8 * |x|)
    and gelu(x) underflows in fp16 for x < -5.5. On tiny tensors whose elements all sit in the tail
    ||gelu|| is a poor denominator, so GELU results use max(||ref||, 1e-2 * ||scale||) with scale
    the argument's magnitude (pre-activation, or the incoming gradient for dgrad)."""
    return 1e-2 * norm(scale) if act == "gelu_approx" else 0.0


def check_activation_output(out, pre64, act, dtype, what):
    """out vs act(pre) in float64. Both act(pre64) and act(round(pre64)) are correct answers: the
    op may legitimately round the GEMM result to `dtype` where it stores the pre-activation (the
    unfused path does), which GELU's tail amplifies; the output must be close to one of them."""
    floor = gelu_floor(act, pre64)
    try:
        assert_rel(out, ref_act(pre64, act), dtype, what, floor)
    except AssertionError:
        assert_rel(out, ref_act(pre64.to(dtype).double(), act), dtype, what + " (vs act(pre rounded))", floor)


def run_heuristic(fn, heuristic):
    """Runs fn(). -2, -1 and 0 must work; an index >= 1 may instead raise the documented clear
    error (ValueError naming 'heuristic' and 'out of range'), in which case None is returned."""
    if heuristic <= 0:
        return fn()
    try:
        return fn()
    except ValueError as e:
        msg = str(e)
        assert "heuristic" in msg and "out of range" in msg, f"unexpected ValueError for heuristic={heuristic}: {msg}"
        return None


def assert_zero(t, ctx):
    assert torch.count_nonzero(t.float().nan_to_num(1.0)).item() == 0, f"{ctx}: expected all zeros"


# ------------------------------------------------------------------ generic checkers (CPU + CUDA)

def check_forward(device, dtype, act, has_bias, save, heuristic, shape, entry="op", poison=False):
    """linear_act through one entry point vs the float64 reference. Returns False when the
    heuristic index was (legitimately) out of range."""
    B, K, N = shape
    x = randn(B, K, dtype=dtype, device=device)
    w = randn(N, K, dtype=dtype, device=device, scale=1.0 / math.sqrt(max(K, 1)))
    b = randn(N, dtype=dtype, device=device, scale=0.5) if has_bias else None
    if entry == "op":
        call = lambda: OPS.linear_act(x, w, b, ACT_CODE[act], save, heuristic)  # noqa: E731
    elif entry == "flash_attn":
        call = lambda: OPS.linear_act_forward(x, w, b, act == "gelu_approx", save, heuristic)  # noqa: E731
    elif entry == "lib":
        call = lambda: fused_dense_lib.linear_act_forward(x, w, b, act == "gelu_approx", save, heuristic)  # noqa: E731
    elif entry == "py":
        call = lambda: list(r for r in ops.linear_act(x, w, b, act, save, heuristic) if r is not None)  # noqa: E731
    else:
        raise AssertionError(entry)
    if poison:
        poison_cuda_cache(x.device)
    res = run_heuristic(call, heuristic)
    if res is None:
        return False
    ctx = f"{entry} linear_act B={B} K={K} N={N} {dtype} {act} bias={has_bias} save={save} h={heuristic}"
    assert isinstance(res, (list, tuple)) and len(res) == (2 if save else 1), f"{ctx}: got {len(res)} outputs"
    out = res[0]
    assert tuple(out.shape) == (B, N) and out.dtype == dtype and out.device == x.device, \
        f"{ctx}: out {tuple(out.shape)} {out.dtype} {out.device}"
    assert out.is_contiguous()
    pre64 = ref_pre(x, w, b)
    check_activation_output(out, pre64, act, dtype, f"{ctx} out")
    if save:
        p = res[1]
        if act == "relu":
            check_relu_mask(p, out, pre64, ctx)
        else:
            assert tuple(p.shape) == (B, N) and p.dtype == dtype and p.device == x.device, \
                f"{ctx}: pre_act {tuple(p.shape)} {p.dtype} {p.device}"
            assert_close_rel(p, pre64, dtype, f"{ctx} pre_act")
    return True


def make_dgrad_inputs(dtype, act, shape, device, set_padding=False):
    B, K, N = shape
    w = randn(N, K, dtype=dtype, device=device, scale=1.0 / math.sqrt(max(N, 1)))
    dout = randn(B, N, dtype=dtype, device=device)
    pre = randn(B, K, dtype=dtype, device=device)
    if act == "none":
        saved = None
    elif act == "relu":
        saved = pack_bits(pre >= 0, set_padding=set_padding).to(device)
    else:
        saved = pre
    return w, dout, pre, saved


def ref_dgrad(w, dout, pre, act, saved):
    d_act = dout.double() @ w.double()
    K = w.shape[1]
    if act == "relu":
        d_in = d_act * unpack_bits(saved)[:, :K].to(device=d_act.device, dtype=torch.float64)
    elif act == "none":
        d_in = d_act
    else:
        d_in = d_act * ref_act_grad(pre, act)
    return d_in, d_in.sum(0)


def check_dgrad(device, dtype, act, has_d_bias, heuristic, shape, entry="op", poison=False, set_padding=False):
    """act_linear_dgrad through one entry point vs the float64 reference. Returns False when the
    heuristic index was (legitimately) out of range."""
    B, K, N = shape
    w, dout, pre, saved = make_dgrad_inputs(dtype, act, shape, device, set_padding)
    if entry == "op":
        call = lambda: OPS.act_linear_dgrad(w, dout, saved, ACT_CODE[act], has_d_bias, heuristic)  # noqa: E731
    elif entry == "flash_attn":
        call = lambda: OPS.bias_act_linear_dgrad_bgrad(w, dout, saved, act == "gelu_approx", heuristic)  # noqa: E731
    elif entry == "lib":
        call = lambda: fused_dense_lib.bias_act_linear_dgrad_bgrad(w, dout, saved, act == "gelu_approx", heuristic)  # noqa: E731
    elif entry == "py":
        call = lambda: [r for r in ops.act_linear_dgrad(w, dout, saved, act, has_d_bias, heuristic) if r is not None]  # noqa: E731
    else:
        raise AssertionError(entry)
    if poison:
        poison_cuda_cache(w.device)
    res = run_heuristic(call, heuristic)
    if res is None:
        return False
    ctx = f"{entry} act_linear_dgrad B={B} K={K} N={N} {dtype} {act} d_bias={has_d_bias} h={heuristic}"
    assert isinstance(res, (list, tuple)) and len(res) == (2 if has_d_bias else 1), f"{ctx}: got {len(res)} outputs"
    d_in_ref, d_b_ref = ref_dgrad(w, dout, pre, act, saved)
    d_act = dout.double() @ w.double()
    d_in = res[0]
    assert tuple(d_in.shape) == (B, K) and d_in.dtype == dtype and d_in.device == w.device, \
        f"{ctx}: d_input {tuple(d_in.shape)} {d_in.dtype} {d_in.device}"
    assert_rel(d_in, d_in_ref, dtype, f"{ctx} d_input", gelu_floor(act, d_act))
    if has_d_bias:
        d_b = res[1]
        assert tuple(d_b.shape) == (K,) and d_b.dtype == dtype and d_b.device == w.device, \
            f"{ctx}: d_bias {tuple(d_b.shape)} {d_b.dtype} {d_b.device}"
        assert_rel(d_b, d_b_ref, dtype, f"{ctx} d_bias", max(sum_floor(d_in_ref), gelu_floor(act, d_act.square().sum(0).sqrt())))
        if B == 0 or N == 0:
            assert_zero(d_b, f"{ctx} d_bias")
    return True


def check_dgrad_act_out(device, dtype, act, has_d_bias, heuristic, shape, poison=False):
    """return_act_out=True: the same d_input / d_bias as without it, bit for bit, plus act(pre_act)
    bit-identical to act_forward's (checkpoint level 1 must rebuild exactly what level 0 keeps)."""
    B, K, N = shape
    w, dout, pre, saved = make_dgrad_inputs(dtype, act, shape, device)
    code = ACT_CODE[act]
    base = run_heuristic(lambda: OPS.act_linear_dgrad(w, dout, saved, code, has_d_bias, heuristic), heuristic)
    if base is None:
        return False
    if poison:
        poison_cuda_cache(w.device)
    res = OPS.act_linear_dgrad(w, dout, saved, code, has_d_bias, heuristic, True)
    ctx = f"act_linear_dgrad return_act_out B={B} K={K} N={N} {dtype} {act} d_bias={has_d_bias} h={heuristic}"
    assert len(res) == len(base) + 1, f"{ctx}: {len(res)} outputs"
    for i, (a, b) in enumerate(zip(res, base)):
        assert torch.equal(a, b), f"{ctx}: output {i} differs from the call without return_act_out"
    act_out = res[-1]
    assert tuple(act_out.shape) == (B, K) and act_out.dtype == dtype and act_out.device == w.device, \
        f"{ctx}: act_out {tuple(act_out.shape)} {act_out.dtype} {act_out.device}"
    assert torch.equal(act_out, OPS.act_forward(saved, code)), f"{ctx}: act_out differs from act_forward(pre_act)"
    ref = F.gelu(pre.double(), approximate="tanh") if act == "gelu_approx" else F.relu(pre.double()).square()
    assert_rel(act_out, ref, dtype, f"{ctx} act_out")
    return True


def check_wgrad(device, dtype, has_d_bias, shape, entry="op", poison=False):
    """linear_bias_wgrad through one entry point vs the float64 reference."""
    B, K, N = shape
    x = randn(B, K, dtype=dtype, device=device, scale=1.0 / math.sqrt(max(B, 1)))
    dout = randn(B, N, dtype=dtype, device=device)
    if entry == "op":
        call = lambda: OPS.linear_bias_wgrad(x, dout, has_d_bias)  # noqa: E731
    elif entry == "lib":
        call = lambda: fused_dense_lib.linear_bias_wgrad(x, dout, has_d_bias)  # noqa: E731
    elif entry == "py":
        call = lambda: list(ops.linear_bias_wgrad(x, dout, has_d_bias))  # noqa: E731
    else:
        raise AssertionError(entry)
    if poison:
        poison_cuda_cache(x.device)
    res = call()
    ctx = f"{entry} linear_bias_wgrad B={B} K={K} N={N} {dtype} d_bias={has_d_bias}"
    if entry == "op":
        assert len(res) == (2 if has_d_bias else 1), f"{ctx}: got {len(res)} outputs"
    else:  # fused_dense_lib and ops.py always return two entries, the second None without bias
        assert len(res) == 2 and (res[1] is not None) == has_d_bias, f"{ctx}: got {res}"
    d_w = res[0]
    assert tuple(d_w.shape) == (N, K) and d_w.dtype == dtype and d_w.device == x.device, \
        f"{ctx}: d_weight {tuple(d_w.shape)} {d_w.dtype} {d_w.device}"
    assert_close_rel(d_w, dout.double().t() @ x.double(), dtype, f"{ctx} d_weight")
    if B == 0:
        assert_zero(d_w, f"{ctx} d_weight")
    if has_d_bias:
        d_b = res[1]
        assert tuple(d_b.shape) == (N,) and d_b.dtype == dtype and d_b.device == x.device, \
            f"{ctx}: d_bias {tuple(d_b.shape)} {d_b.dtype} {d_b.device}"
        assert_rel(d_b, dout.double().sum(0), dtype, f"{ctx} d_bias", sum_floor(dout))
        if B == 0:
            assert_zero(d_b, f"{ctx} d_bias")


def check_act_forward(device, dtype, act, shape, entry="op", poison=False, offset=0):
    """act_forward (op or Python wrapper) vs the float64 activation; `offset` places the input at
    that storage offset (contiguous, but not 16-byte aligned unless 0)."""
    flat = randn(offset + math.prod(shape), dtype=dtype, device=device, scale=2.0)
    pre = flat[offset:].view(shape)
    if poison:
        poison_cuda_cache(pre.device)
    out = OPS.act_forward(pre, ACT_CODE[act]) if entry == "op" else ops.act_forward(pre, act)
    ctx = f"{entry} act_forward shape={shape} {dtype} {act} offset={offset}"
    assert out.shape == pre.shape and out.dtype == dtype and out.device == pre.device, \
        f"{ctx}: out {tuple(out.shape)} {out.dtype} {out.device}"
    check_activation_output(out, pre.double(), act, dtype, ctx)


# --------------------------------------------------------- small input factories (errors, opcheck)

def tensor(*shape, dtype=torch.float32, device="cpu"):
    """A random tensor of any dtype (floating: normal; integer: small integers)."""
    return torch.randn(*shape, dtype=torch.float32).to(device=device, dtype=dtype) if dtype.is_floating_point \
        else torch.randint(-3, 4, shape, dtype=dtype, device=device)


def noncontig(rows, cols):
    """A [rows, cols] float32 view with strides [1, rows]: not contiguous."""
    return torch.randn(cols, rows).t()


def random_mask(rows, cols):
    """A random ReLU bit-mask for a [rows, cols] pre-activation (padding bits random too)."""
    return torch.randint(0, 256, (rows, (cols + 7) // 8), dtype=torch.uint8)
