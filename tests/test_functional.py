"""Tests of fused_dense.functional: FusedDenseFunc / FusedMLPFunc against float64 references.

Every case draws random normal inputs from its own fixed seed (conftest's _seeded: a failure's
report names it; FUSED_DENSE_TEST_SEED picks another base). Errors are relative,
||out - ref|| / ||ref||, within conftest.TOL for the dtype under test.
"""
import pytest
import torch
import torch.nn.functional as F

import fused_dense
from fused_dense import _common
from fused_dense.functional import FusedDenseFunc, FusedMLPFunc, fused_dense_func, fused_mlp_func

from conftest import assert_close_rel, needs_caching_allocator

ACTIVATIONS = ["gelu_approx", "relu", "sqrelu"]
HEURISTICS = ["auto", -1, 0]
CUDA_DTYPES = [torch.float16, torch.bfloat16]
CPU_DTYPES = [torch.float32, torch.float64, torch.bfloat16]


def ref_act(t, activation):
    if activation == "gelu_approx":
        return F.gelu(t, approximate="tanh")
    if activation == "relu":
        return F.relu(t)
    return F.relu(t).square()


def wide(t):
    """t in float32, or float64 when it is float64 (losses summed without losing precision)."""
    return t if t.dtype == torch.float64 else t.float()


def leaf64(t, via=None):
    """A float64 leaf copy of t; `via` first rounds it to that dtype, as autocast does."""
    if t is None:
        return None
    t64 = t.detach() if via is None else t.detach().to(via)
    return t64.to(torch.float64).requires_grad_(t.requires_grad)


def autocast_leaf64(dtype):
    return lambda t: leaf64(t, via=dtype)


def make_params(shapes, dtype, device, requires_grad=True, bias=True):
    """nn.Linear-like init: uniform(+-1/sqrt(fan_in)) weights and biases."""
    params = []
    for out_f, in_f in shapes:
        bound = in_f ** -0.5
        w = (torch.rand(out_f, in_f, device=device, dtype=torch.float64) * 2 - 1) * bound
        b = (torch.rand(out_f, device=device, dtype=torch.float64) * 2 - 1) * bound
        params.append(w.to(dtype).requires_grad_(requires_grad))
        params.append(b.to(dtype).requires_grad_(requires_grad) if bias else None)
    return params


def check_grads(pairs, dtype, tol=None):
    for name, t, ref in pairs:
        if t is None:
            continue
        if not t.requires_grad:
            assert t.grad is None, f"{name} does not require grad but got one"
            continue
        assert t.grad is not None, f"{name}.grad missing"
        assert t.grad.dtype == t.dtype, f"{name}.grad dtype {t.grad.dtype} != {t.dtype}"
        assert_close_rel(t.grad, ref.grad, dtype, what=f"grad {name}", tol=tol)


def run_mlp_case(batch_shape, in_f, hidden, out_f, dtype, device, activation, checkpoint_lvl, heuristic, bias1,
                 bias2, return_residual, tol=None):
    x = torch.randn(*batch_shape, in_f, device=device, dtype=dtype, requires_grad=True)
    w1, b1, w2, b2 = make_params([(hidden, in_f), (out_f, hidden)], dtype, device)
    b1 = b1 if bias1 else None
    b2 = b2 if bias2 else None
    res = fused_mlp_func(x, w1, w2, b1, b2, activation=activation, save_pre_act=True,
                         return_residual=return_residual, checkpoint_lvl=checkpoint_lvl, heuristic=heuristic)
    out, resid = res if return_residual else (res, None)
    assert out.shape == (*batch_shape, out_f) and out.dtype == dtype
    g = torch.randn_like(out)
    loss = (wide(out) * wide(g)).sum()
    if return_residual:
        assert resid.shape == x.shape
        torch.testing.assert_close(resid, x, rtol=0, atol=0)
        gr = torch.randn_like(resid)
        loss = loss + (wide(resid) * wide(gr)).sum()
    loss.backward()

    x64, w1_64, b1_64, w2_64, b2_64 = map(leaf64, (x, w1, b1, w2, b2))
    ref = F.linear(ref_act(F.linear(x64, w1_64, b1_64), activation), w2_64, b2_64)
    ref_loss = (ref * g.double()).sum()
    if return_residual:
        ref_loss = ref_loss + (x64 * gr.double()).sum()
    ref_loss.backward()
    assert_close_rel(out, ref, dtype, tol=tol)
    check_grads([("x", x, x64), ("weight1", w1, w1_64), ("bias1", b1, b1_64), ("weight2", w2, w2_64),
                 ("bias2", b2, b2_64)], dtype, tol=tol)


# ------------------------------------------------------------------------------------------------
# FusedDense


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("in_f,out_f", [(32, 64), (33, 17)])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("return_residual", [False, True])
def test_dense_cpu(dtype, in_f, out_f, bias, return_residual):
    run_dense_case((3, 5), in_f, out_f, dtype, "cpu", bias, return_residual)


def run_dense_case(batch_shape, in_f, out_f, dtype, device, bias, return_residual):
    x = torch.randn(*batch_shape, in_f, device=device, dtype=dtype, requires_grad=True)
    w, b = make_params([(out_f, in_f)], dtype, device, bias=bias)
    res = fused_dense_func(x, w, b, return_residual=return_residual)
    out, resid = res if return_residual else (res, None)
    assert out.shape == (*batch_shape, out_f) and out.dtype == dtype
    g = torch.randn_like(out)
    loss = (wide(out) * wide(g)).sum()
    if return_residual:
        torch.testing.assert_close(resid, x, rtol=0, atol=0)
        gr = torch.randn_like(resid)
        loss = loss + (wide(resid) * wide(gr)).sum()
    loss.backward()
    x64, w64, b64 = map(leaf64, (x, w, b))
    ref = F.linear(x64, w64, b64)
    ref_loss = (ref * g.double()).sum()
    if return_residual:
        ref_loss = ref_loss + (x64 * gr.double()).sum()
    ref_loss.backward()
    assert_close_rel(out, ref, dtype)
    check_grads([("x", x, x64), ("weight", w, w64), ("bias", b, b64)], dtype)


@pytest.mark.parametrize("needs", ["x", "w", "b", "wb", "xb", "none"])
def test_dense_needs_input_grad(needs):
    x = torch.randn(4, 6, 16, dtype=torch.float64, requires_grad="x" in needs)
    w, b = make_params([(8, 16)], torch.float64, "cpu")
    w.requires_grad_("w" in needs)
    b.requires_grad_("b" in needs)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = fused_dense_func(x, w, b)
    # The input is kept only for the weight gradient, the weight only for the input gradient (the
    # input as its 2-D view: the same memory).
    assert any(t.data_ptr() == x.data_ptr() and t.numel() == x.numel() for t in saved) == ("w" in needs)
    assert any(t is w for t in saved) == ("x" in needs)
    if needs == "none":
        assert not out.requires_grad
        return
    g = torch.randn_like(out)
    (out * g).sum().backward()
    x64, w64, b64 = map(leaf64, (x, w, b))
    (F.linear(x64, w64, b64) * g).sum().backward()
    check_grads([("x", x, x64), ("weight", w, w64), ("bias", b, b64)], torch.float64)


def test_dense_input_layouts():
    w, b = make_params([(8, 16)], torch.float32, "cpu")
    x1 = torch.randn(16, requires_grad=True)  # 1-D, as nn.Linear accepts
    out = fused_dense_func(x1, w, b)
    assert out.shape == (8,)
    torch.testing.assert_close(out, F.linear(x1, w, b))
    xt = torch.randn(16, 5, 3).transpose(0, 2)  # non-contiguous [3, 5, 16]
    xt.requires_grad_()
    out = fused_dense_func(xt, w, b)
    torch.testing.assert_close(out, F.linear(xt, w, b))
    out.sum().backward()
    torch.testing.assert_close(xt.grad, w.sum(0).expand_as(xt).contiguous())
    xs = torch.randn(6, 40)[:, 3:19]  # a column slice: reshape keeps it non-contiguous
    xs.requires_grad_()
    torch.testing.assert_close(fused_dense_func(xs, w, b), F.linear(xs, w, b))
    ws = torch.randn(16, 8).t()  # a non-contiguous weight
    torch.testing.assert_close(fused_dense_func(xs, ws, b), F.linear(xs, ws, b))
    x0 = torch.randn(0, 16, requires_grad=True)  # empty batch
    w.grad = b.grad = None
    out = fused_dense_func(x0, w, b)
    assert out.shape == (0, 8)
    out.sum().backward()
    assert x0.grad.shape == (0, 16)
    torch.testing.assert_close(b.grad, torch.zeros(8))


def test_dense_gradcheck():
    x = torch.randn(2, 3, 5, dtype=torch.float64, requires_grad=True)
    w = torch.randn(4, 5, dtype=torch.float64, requires_grad=True)
    b = torch.randn(4, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda *a: FusedDenseFunc.apply(*a), (x, w, b))
    assert torch.autograd.gradcheck(lambda x, w, b: FusedDenseFunc.apply(x, w, b, True), (x, w, b))
    assert torch.autograd.gradcheck(lambda x, w: FusedDenseFunc.apply(x, w, None), (x, w))


# ------------------------------------------------------------------------------------------------
# FusedMLP


# (batch shape, in, hidden, out, bias1, bias2, return_residual, heuristic): tight but covering
# every option once per activation x checkpoint level x dtype.
CPU_MLP_CONFIGS = [
    ((2, 7), 32, 128, 32, True, True, False, "auto"),
    ((9,), 33, 65, 17, False, True, True, -1),
    ((3, 2, 2), 64, 40, 64, True, False, False, 0),
    ((5,), 32, 128, 32, False, False, True, "auto"),
]


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("checkpoint_lvl", [0, 1, 2])
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("config", CPU_MLP_CONFIGS, ids=lambda c: f"in{c[1]}-h{c[2]}-out{c[3]}-b{int(c[4])}{int(c[5])}"
                         f"-res{int(c[6])}-heur{c[7]}")
def test_mlp_cpu(config, activation, checkpoint_lvl, dtype):
    batch_shape, in_f, hidden, out_f, bias1, bias2, return_residual, heuristic = config
    run_mlp_case(batch_shape, in_f, hidden, out_f, dtype, "cpu", activation, checkpoint_lvl, heuristic, bias1,
                 bias2, return_residual)


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("needs", ["x", "w1", "b1", "w2", "b2", "x-w2", "w1-b2", "params"])
@pytest.mark.parametrize("checkpoint_lvl", [0, 1, 2])
def test_mlp_needs_input_grad(needs, checkpoint_lvl, activation):
    names = ["x", "w1", "b1", "w2", "b2"]
    want = set(names[1:]) if needs == "params" else set(needs.split("-"))
    x = torch.randn(6, 16, dtype=torch.float64)
    w1, b1, w2, b2 = make_params([(24, 16), (8, 24)], torch.float64, "cpu")
    tensors = dict(zip(names, (x, w1, b1, w2, b2)))
    for n, t in tensors.items():
        t.requires_grad_(n in want)
    out = fused_mlp_func(x, w1, w2, b1, b2, activation=activation, checkpoint_lvl=checkpoint_lvl)
    g = torch.randn_like(out)
    (out * g).sum().backward()
    refs = {n: leaf64(t) for n, t in tensors.items()}
    ref = F.linear(ref_act(F.linear(refs["x"], refs["w1"], refs["b1"]), activation), refs["w2"], refs["b2"])
    (ref * g).sum().backward()
    check_grads([(n, tensors[n], refs[n]) for n in names], torch.float64)


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("checkpoint_lvl", [0, 1, 2])
def test_mlp_gradcheck(activation, checkpoint_lvl):
    x = torch.randn(2, 3, 6, dtype=torch.float64, requires_grad=True)
    w1 = torch.randn(9, 6, dtype=torch.float64, requires_grad=True)
    b1 = torch.randn(9, dtype=torch.float64, requires_grad=True)
    w2 = torch.randn(4, 9, dtype=torch.float64, requires_grad=True)
    b2 = torch.randn(4, dtype=torch.float64, requires_grad=True)

    def f(x, w1, b1, w2, b2):
        return FusedMLPFunc.apply(x, w1, b1, w2, b2, activation, True, True, checkpoint_lvl, "auto")

    # ReLU's kink: gradcheck's finite differences need pre-activations away from 0.
    assert torch.autograd.gradcheck(f, (x, w1, b1, w2, b2), eps=1e-6, atol=1e-5)


def test_mlp_input_layouts():
    w1, b1, w2, b2 = make_params([(20, 8), (8, 20)], torch.float64, "cpu")
    x = torch.randn(8, 4, 3, dtype=torch.float64).permute(2, 1, 0).requires_grad_()  # non-contiguous
    out = fused_mlp_func(x, w1, w2, b1, b2)
    ref = F.linear(F.gelu(F.linear(x, w1, b1), approximate="tanh"), w2, b2)
    torch.testing.assert_close(out, ref)
    x1 = torch.randn(8, dtype=torch.float64)
    assert fused_mlp_func(x1, w1, w2, b1, b2).shape == (8,)
    xs = torch.randn(5, 30, dtype=torch.float64)[:, 2:10].requires_grad_()  # viewable, non-contiguous
    w1s = torch.randn(8, 20, dtype=torch.float64).t().requires_grad_()
    out = fused_mlp_func(xs, w1s, w2, b1, b2, activation="relu", checkpoint_lvl=2)
    ref = F.linear(F.relu(F.linear(xs, w1s, b1)), w2, b2)
    torch.testing.assert_close(out, ref)
    g = torch.randn_like(out)
    got = torch.autograd.grad(out, (xs, w1s), g)
    want = torch.autograd.grad(ref, (xs, w1s), g)
    torch.testing.assert_close(got, want)


# ------------------------------------------------------------------------------------------------
# Memory kept for backward


def saved_bytes(fn, inputs_and_params):
    """Runs fn under saved-tensor hooks. Returns (bytes of all saved tensors, bytes of saved
    tensors that are neither an input nor a parameter, i.e. the memory the layer itself keeps)."""
    known = {t.untyped_storage().data_ptr() for t in inputs_and_params if t is not None}
    total, extra = [0], [0]

    def pack(t):
        n = t.numel() * t.element_size()
        total[0] += n
        if t.untyped_storage().data_ptr() not in known:
            extra[0] += n
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, total[0], extra[0]


def expected_mlp_saved(rows, in_f, hidden, out_f, elem, activation, checkpoint_lvl, bias1):
    params = (hidden * in_f + out_f * hidden) * elem
    x = rows * in_f * elem
    mask = rows * ((hidden + 7) // 8)  # ReLU: 1 bit per element, rows padded to whole bytes
    pre = rows * hidden * elem
    act = rows * hidden * elem
    if checkpoint_lvl == 0:
        extra = (mask if activation == "relu" else pre) + act
    elif checkpoint_lvl == 1:
        extra = mask + act if activation == "relu" else pre
    else:
        extra = 0
        params += hidden * elem if bias1 else 0  # fc1's bias, to recompute fc1
    return x + params + extra, extra


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("checkpoint_lvl", [0, 1, 2])
def test_mlp_saved_memory(checkpoint_lvl, activation, dtype):
    rows, in_f, hidden, out_f = 12, 16, 67, 16  # hidden odd: the mask pads each row to 9 bytes
    x = torch.randn(3, 4, in_f, dtype=dtype, requires_grad=True)
    w1, b1, w2, b2 = make_params([(hidden, in_f), (out_f, hidden)], dtype, "cpu")
    out, total, extra = saved_bytes(
        lambda: fused_mlp_func(x, w1, w2, b1, b2, activation=activation, checkpoint_lvl=checkpoint_lvl),
        [x, w1, b1, w2, b2])
    exp_total, exp_extra = expected_mlp_saved(rows, in_f, hidden, out_f, x.element_size(), activation,
                                              checkpoint_lvl, True)
    assert (total, extra) == (exp_total, exp_extra)
    out.sum().backward()  # and backward still works from what was kept
    assert x.grad is not None and w1.grad is not None and b2.grad is not None


def test_mlp_saved_memory_levels_ordered():
    x = torch.randn(32, 64, requires_grad=True)
    w1, b1, w2, b2 = make_params([(256, 64), (64, 256)], torch.float32, "cpu")
    extras = {}
    for activation in ACTIVATIONS:
        for lvl in (0, 1, 2):
            _, _, extras[activation, lvl] = saved_bytes(
                lambda: fused_mlp_func(x, w1, w2, b1, b2, activation=activation, checkpoint_lvl=lvl),
                [x, w1, b1, w2, b2])
    for activation in ("gelu_approx", "sqrelu"):
        assert extras[activation, 0] > extras[activation, 1] > extras[activation, 2] == 0
    # ReLU: the bit-mask is 1/32 of an fp32 pre-activation, level 1 keeps what level 0 keeps.
    assert extras["relu", 0] == extras["relu", 1] == 32 * 256 * 4 + 32 * 256 // 8
    assert extras["relu", 2] == 0


def test_mlp_saved_memory_needs_input_grad():
    # Only fc2 trains (x and fc1 frozen): level 0 keeps act(fc1(x)) alone.
    x = torch.randn(10, 16)
    w1, b1, w2, b2 = make_params([(32, 16), (8, 32)], torch.float32, "cpu", requires_grad=False)
    w2.requires_grad_()
    b2.requires_grad_()
    for activation in ACTIVATIONS:
        _, total, extra = saved_bytes(lambda: fused_mlp_func(x, w1, w2, b1, b2, activation=activation),
                                      [x, w1, b1, w2, b2])
        assert total == extra == 10 * 32 * 4
    _, total, _ = saved_bytes(lambda: fused_mlp_func(x, w1, w2.detach(), b1, b2.detach()), [x, w1, b1, w2, b2])
    assert total == 0


def test_mlp_save_pre_act_false_is_level_2():
    x = torch.randn(10, 16, requires_grad=True)
    w1, b1, w2, b2 = make_params([(32, 16), (8, 32)], torch.float32, "cpu")
    out, total, extra = saved_bytes(lambda: fused_mlp_func(x, w1, w2, b1, b2, save_pre_act=False),
                                    [x, w1, b1, w2, b2])
    assert extra == 0
    out.sum().backward()
    x64, w1_64, b1_64, w2_64, b2_64 = map(leaf64, (x, w1, b1, w2, b2))
    F.linear(F.gelu(F.linear(x64, w1_64, b1_64), approximate="tanh"), w2_64, b2_64).sum().backward()
    check_grads([("x", x, x64), ("weight1", w1, w1_64), ("bias2", b2, b2_64)], torch.float32)


def test_dense_saved_memory():
    x = torch.randn(4, 5, 16, requires_grad=True)
    w, b = make_params([(8, 16)], torch.float32, "cpu")
    _, total, extra = saved_bytes(lambda: fused_dense_func(x, w, b), [x, w, b])
    assert (total, extra) == ((20 * 16 + 8 * 16) * 4, 0)
    with torch.no_grad():
        _, total, _ = saved_bytes(lambda: fused_dense_func(x, w, b), [x, w, b])
    assert total == 0


# ------------------------------------------------------------------------------------------------
# autocast, dtype fallback, argument checks


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_mlp_autocast_cpu_bf16(activation):
    x = torch.randn(4, 6, 32, requires_grad=True)
    w1, b1, w2, b2 = make_params([(64, 32), (32, 64)], torch.float32, "cpu")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = fused_mlp_func(x, w1, w2, b1, b2, activation=activation)
        ref_dtype = F.linear(x, w1, b1).dtype
    assert out.dtype == ref_dtype == torch.bfloat16
    g = torch.randn_like(out)
    (out.float() * g.float()).sum().backward()
    x64, w1_64, b1_64, w2_64, b2_64 = map(autocast_leaf64(torch.bfloat16), (x, w1, b1, w2, b2))
    ref = F.linear(ref_act(F.linear(x64, w1_64, b1_64), activation), w2_64, b2_64)
    (ref * g.double()).sum().backward()
    assert_close_rel(out, ref, torch.bfloat16)
    # Gradients arrive in the parameters' own dtype, with bf16 accuracy.
    check_grads([("x", x, x64), ("weight1", w1, w1_64), ("bias1", b1, b1_64), ("weight2", w2, w2_64),
                 ("bias2", b2, b2_64)], torch.bfloat16)


def test_dense_autocast_cpu_bf16():
    x = torch.randn(4, 6, 32, requires_grad=True)
    w, b = make_params([(48, 32)], torch.float32, "cpu")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, resid = fused_dense_func(x, w, b, return_residual=True)
    assert out.dtype == torch.bfloat16 and resid.dtype == torch.bfloat16
    (out.float().sum() + resid.float().sum()).backward()
    x64, w64, b64 = map(autocast_leaf64(torch.bfloat16), (x, w, b))
    (F.linear(x64, w64, b64).sum() + x64.sum()).backward()
    check_grads([("x", x, x64), ("weight", w, w64), ("bias", b, b64)], torch.bfloat16)


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_mlp_autocast_equals_bf16_run(activation):
    """Under autocast the layer is exactly the bf16 layer: nothing else (e.g. autocast leaking into
    the ops' float32 math) changes the numbers."""
    x = torch.randn(24, 32, requires_grad=True)
    params = make_params([(64, 32), (32, 64)], torch.float32, "cpu")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = fused_mlp_func(x, params[0], params[2], params[1], params[3], activation=activation)
    g = torch.randn_like(out)
    grads = torch.autograd.grad(out, [x, *params], g)
    x16 = x.detach().bfloat16().requires_grad_()
    p16 = [p.detach().bfloat16().requires_grad_() for p in params]
    out16 = fused_mlp_func(x16, p16[0], p16[2], p16[1], p16[3], activation=activation)
    grads16 = torch.autograd.grad(out16, [x16, *p16], g)
    torch.testing.assert_close(out, out16, rtol=0, atol=0)
    for a, b in zip(grads, grads16):
        assert a.dtype == torch.float32
        torch.testing.assert_close(a, b.float(), rtol=0, atol=0)


def test_mlp_autocast_casts_weights_for_bf16_input():
    x = torch.randn(6, 32, dtype=torch.bfloat16, requires_grad=True)
    w1, b1, w2, b2 = make_params([(64, 32), (32, 64)], torch.float32, "cpu")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = fused_mlp_func(x, w1, w2, b1, b2)
    assert out.dtype == torch.bfloat16
    out.float().sum().backward()
    assert w1.grad.dtype == torch.float32 and x.grad.dtype == torch.bfloat16
    x64, w1_64, b1_64, w2_64, b2_64 = map(autocast_leaf64(torch.bfloat16), (x, w1, b1, w2, b2))
    ref = F.linear(F.gelu(F.linear(x64, w1_64, b1_64), approximate="tanh"), w2_64, b2_64)
    ref.sum().backward()
    assert_close_rel(out, ref, torch.bfloat16)
    check_grads([("x", x, x64), ("weight1", w1, w1_64), ("bias2", b2, b2_64)], torch.bfloat16)


def test_dense_float64_under_autocast_stays_float64():
    x = torch.randn(3, 8, dtype=torch.float64)
    w, b = make_params([(4, 8)], torch.float64, "cpu")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert fused_dense_func(x, w, b).dtype == torch.float64


def test_dense_complex_falls_back_to_plain_pytorch():
    # complex64 is not an op dtype, but nn.Linear accepts it: the same Function runs on torch ops.
    lin = torch.nn.Linear(12, 5, dtype=torch.complex64)
    x = torch.randn(3, 4, 12, dtype=torch.complex64, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    out, resid = fused_dense_func(x, lin.weight, lin.bias, return_residual=True)
    torch.testing.assert_close(out, lin(x_ref))
    g = torch.randn_like(out)
    (out * g).sum().abs().backward()
    w_grad, b_grad = lin.weight.grad.clone(), lin.bias.grad.clone()
    lin.zero_grad()
    (lin(x_ref) * g).sum().abs().backward()
    torch.testing.assert_close(x.grad, x_ref.grad)
    torch.testing.assert_close(w_grad, lin.weight.grad)
    torch.testing.assert_close(b_grad, lin.bias.grad)


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("checkpoint_lvl", [0, 1, 2])
def test_mlp_plain_pytorch_path(monkeypatch, activation, checkpoint_lvl):
    """The path taken for devices / dtypes the ops do not serve, forced here on the CPU."""
    monkeypatch.setattr(_common, "OP_DEVICES", ())
    run_mlp_case((3, 4), 16, 24, 8, torch.float64, "cpu", activation, checkpoint_lvl, "auto", True, True, True)
    run_mlp_case((5,), 16, 24, 8, torch.float32, "cpu", activation, checkpoint_lvl, -1, False, True, False)


def test_dense_plain_pytorch_path(monkeypatch):
    monkeypatch.setattr(_common, "OP_DEVICES", ())
    run_dense_case((2, 3), 16, 8, torch.float64, "cpu", True, True)


def test_mismatched_dtypes_error_like_nn_linear():
    x = torch.randn(3, 8)
    w = torch.randn(4, 8, dtype=torch.float64)
    with pytest.raises(RuntimeError):
        F.linear(x, w)
    with pytest.raises(RuntimeError):
        fused_dense_func(x, w)


@pytest.mark.parametrize("kwargs,match", [
    (dict(activation="gelu"), "activation"),
    (dict(activation="none"), "activation"),
    (dict(activation=None), "activation"),
    (dict(checkpoint_lvl=3), "checkpoint_lvl"),
    (dict(checkpoint_lvl=-1), "checkpoint_lvl"),
    (dict(checkpoint_lvl=True), "checkpoint_lvl"),
    (dict(checkpoint_lvl=1.0), "checkpoint_lvl"),
    (dict(heuristic=-3), "heuristic"),
    (dict(heuristic="fast"), "heuristic"),
    (dict(heuristic=0.5), "heuristic"),
])
def test_mlp_bad_arguments(kwargs, match):
    x = torch.randn(2, 8)
    w1, b1, w2, b2 = make_params([(16, 8), (8, 16)], torch.float32, "cpu")
    with pytest.raises(ValueError, match=match):
        fused_mlp_func(x, w1, w2, b1, b2, **kwargs)
    args = dict(activation="gelu_approx", checkpoint_lvl=0, heuristic=0)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):  # the Function itself checks too
        FusedMLPFunc.apply(x, w1, b1, w2, b2, args["activation"], True, False, args["checkpoint_lvl"],
                           args["heuristic"])


def test_exports():
    for name in ["FusedDenseFunc", "FusedMLPFunc", "fused_dense_func", "fused_mlp_func", "FusedDense", "FusedMLP"]:
        assert name in fused_dense.__all__ and hasattr(fused_dense, name)


# ------------------------------------------------------------------------------------------------
# CUDA (the GPU machine): flash-attn's matrix at full size


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", CUDA_DTYPES)
@pytest.mark.parametrize("features", [1024, 4096])
@pytest.mark.parametrize("bias,return_residual", [(True, False), (False, True)])
def test_dense_cuda(dtype, features, bias, return_residual):
    run_dense_case((8, 512), features, features, dtype, "cuda", bias, return_residual)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", CUDA_DTYPES)
@pytest.mark.parametrize("features", [1024, 4096])
@pytest.mark.parametrize("heuristic", HEURISTICS)
@pytest.mark.parametrize("checkpoint_lvl", [0, 1, 2])
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("bias1,bias2,return_residual", [(True, True, False), (False, True, True),
                                                          (True, False, True)])
def test_mlp_cuda(bias1, bias2, return_residual, activation, checkpoint_lvl, heuristic, features, dtype):
    run_mlp_case((8, 512), features, 4 * features, features, dtype, "cuda", activation, checkpoint_lvl, heuristic,
                 bias1, bias2, return_residual)


@pytest.mark.cuda
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("hidden", [1000, 136, 8])  # widths cuBLASLt's ReLU bit-mask refuses
@pytest.mark.parametrize("heuristic", HEURISTICS)
def test_mlp_cuda_odd_widths(activation, hidden, heuristic):
    run_mlp_case((4, 100), 96, hidden, 72, torch.bfloat16, "cuda", activation, 0, heuristic, True, True, False)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_mlp_cuda_wide_dtypes(dtype, activation):
    run_mlp_case((4, 64), 256, 1024, 256, dtype, "cuda", activation, 1, "auto", True, True, False)


@pytest.mark.cuda
def test_mlp_cuda_heuristic_past_the_list():
    x = torch.randn(64, 256, device="cuda", dtype=torch.float16)
    w1, b1, w2, b2 = make_params([(1024, 256), (256, 1024)], torch.float16, "cuda")
    with pytest.raises(ValueError, match="heuristic"):
        fused_mlp_func(x, w1, w2, b1, b2, heuristic=100_000)


@pytest.mark.cuda
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_mlp_autocast_cuda_fp16(activation):
    x = torch.randn(4, 256, 1024, device="cuda", requires_grad=True)
    w1, b1, w2, b2 = make_params([(4096, 1024), (1024, 4096)], torch.float32, "cuda")
    with torch.autocast("cuda", dtype=torch.float16):
        out = fused_mlp_func(x, w1, w2, b1, b2, activation=activation, heuristic="auto")
    assert out.dtype == torch.float16
    g = torch.randn_like(out)
    (out.float() * g.float()).sum().backward()
    x64, w1_64, b1_64, w2_64, b2_64 = map(autocast_leaf64(torch.float16), (x, w1, b1, w2, b2))
    ref = F.linear(ref_act(F.linear(x64, w1_64, b1_64), activation), w2_64, b2_64)
    (ref * g.double()).sum().backward()
    assert_close_rel(out, ref, torch.float16)
    check_grads([("x", x, x64), ("weight1", w1, w1_64), ("bias1", b1, b1_64), ("weight2", w2, w2_64),
                 ("bias2", b2, b2_64)], torch.float16)


@pytest.mark.cuda
@needs_caching_allocator
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("checkpoint_lvl", [0, 1, 2])
def test_mlp_cuda_memory(activation, checkpoint_lvl):
    """Memory held between forward and backward, seen by the caching allocator and the hooks."""
    dtype, rows, in_f, hidden = torch.bfloat16, 4096, 1024, 4096
    x = torch.randn(rows, in_f, device="cuda", dtype=dtype, requires_grad=True)
    w1, b1, w2, b2 = make_params([(hidden, in_f), (in_f, hidden)], dtype, "cuda")
    fn = lambda: fused_mlp_func(x, w1, w2, b1, b2, activation=activation, checkpoint_lvl=checkpoint_lvl,  # noqa
                                heuristic="auto")
    fn().sum().backward()  # warm up (cuBLASLt plans, allocator pools)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out, total, extra = saved_bytes(fn, [x, w1, b1, w2, b2])
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated() - base
    peak = torch.cuda.max_memory_allocated() - base
    exp_total, exp_extra = expected_mlp_saved(rows, in_f, hidden, in_f, 2, activation, checkpoint_lvl, True)
    assert (total, extra) == (exp_total, exp_extra)
    out_bytes = out.numel() * out.element_size()
    # Held after forward: the output and what was saved (each allocation rounds up to 512 bytes).
    assert exp_extra + out_bytes <= held <= exp_extra + out_bytes + 4 * 512
    # Peak in forward: at most the held memory, one transient [rows, hidden] activation and the
    # cuBLASLt workspace (32 MiB on Hopper).
    assert peak <= held + rows * hidden * 2 + (32 << 20) + (1 << 20)
    out.sum().backward()


@pytest.mark.cuda
@pytest.mark.parametrize("path", ["native", "python"])
@pytest.mark.parametrize("activation", ["gelu_approx", "sqrelu", "relu"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_cuda_mlp_checkpoint_levels_bit_identical(dtype, activation, path):
    """Level 1 rebuilds act(fc1(x)) inside the activation-backward pass with level 0's GEMM
    choices: its output and every gradient equal level 0's bit for bit, 'auto' included. Level 2
    runs fc1's forward without saving the pre-activation, a problem 'auto' may solve with another
    algorithm: equal within the fp16/bf16 tolerance. One exception: with GELU, level 0 keeps the
    activation output the forward's GEMM epilogue may have computed (cuBLASLt's GELU), while level 1
    rebuilds it with fused_dense's kernel, so fc2's weight gradient is equal within tolerance."""
    torch.manual_seed(0)
    x0 = torch.randn(384, 192, dtype=dtype, device="cuda")
    w1, b1, w2, b2 = make_params([(768, 192), (160, 768)], dtype, "cuda")
    dy = torch.randn(384, 160, dtype=dtype, device="cuda")
    results = []
    for lvl in (0, 1, 2):
        x = x0.clone().requires_grad_()
        for p in (w1, b1, w2, b2):
            p.grad = None
        if path == "native":
            out = fused_mlp_func(x, w1, w2, b1, b2, activation=activation, checkpoint_lvl=lvl, heuristic="auto")
        else:
            out = FusedMLPFunc.apply(x, w1, b1, w2, b2, activation, True, False, lvl, "auto")
        out.backward(dy)
        results.append([out.detach(), x.grad, w1.grad, b1.grad, w2.grad, b2.grad])
    names = ["out", "dx", "dw1", "db1", "dw2", "db2"]
    for name, a, b, c in zip(names, *results):
        ctx = f"{activation} {dtype} {path}: {name}"
        assert torch.isfinite(a).all(), f"{ctx} at level 0 not finite"
        if activation == "gelu_approx" and name == "dw2":
            assert_close_rel(b, a, dtype, f"{ctx} at level 1 against level 0")
        else:
            assert torch.equal(a, b), f"{ctx} at level 1 differs from level 0"
        assert_close_rel(c, a, dtype, f"{ctx} at level 2 against level 0")


def test_dense_step_is_one_cpp_node():
    """FusedDense on one process runs the dense op, whose derivative is a C++ autograd Function: one
    graph node and no Python Function in the step (the host time nn.Linear's step is held to)."""
    layer = fused_dense.FusedDense(16, 8)
    x = torch.randn(2, 3, 16, requires_grad=True)
    out = layer(x)
    node = out.grad_fn
    while node is not None and "DenseFunction" not in node.name():  # past the reshape back to 3-D
        node = node.next_functions[0][0]
    assert node is not None and "FusedDenseFunc" not in node.name(), out.grad_fn.name()
    with torch.no_grad():
        assert layer(x).grad_fn is None


def test_dense_op_folds_any_batch_shape_and_names_bad_input():
    """The dense op takes x [..., in_features] (folded to rows in C++); its output takes in-place ops
    as nn.Linear's does; a 0-D x or a width mismatch is a ValueError naming the argument."""
    dense = torch.ops.fused_dense.dense
    w, b = torch.randn(5, 6, dtype=torch.float64), torch.randn(5, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"x must have at least 1 dimension"):
        dense(torch.tensor(1.0, dtype=torch.float64), w, b)
    with pytest.raises(ValueError, match=r"x.size\(-1\) \(in_features\) must equal weight.size\(1\) = 6"):
        dense(torch.randn(2, 3, 4, dtype=torch.float64), w, b)
    x = torch.randn(2, 3, 6, dtype=torch.float64, requires_grad=True)
    out = dense(x, w, b)
    assert out.shape == (2, 3, 5)
    out.mul_(2)  # in place, as on nn.Linear's output
    g = torch.randn_like(out)
    out.backward(g)
    x64 = x.detach().clone().requires_grad_()
    (2 * F.linear(x64, w, b)).backward(g)
    assert torch.equal(x.grad, x64.grad) or (x.grad - x64.grad).abs().max() <= 1e-12 * x64.grad.abs().max()
    assert dense(torch.randn(6, dtype=torch.float64), w, None).shape == (5,)
