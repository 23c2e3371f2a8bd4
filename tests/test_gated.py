"""The gated MLP (SwiGLU / GeGLU): the packed gate / up layout, the gated ops
(torch.ops.fused_dense.gated_linear / gated_linear_dgrad / gated_act_forward), the MLP op and
FusedGatedMLP on its one autograd, against float64 references written here in plain PyTorch on
fresh random inputs. Contract: docs/contract.md ("Gated MLP"). CUDA tests poison the allocator
before each call, so an element an op never writes shows up as NaN.

The Hugging Face interoperability tests are in tests/test_gated_hf.py, the tensor-parallel form in
tests/test_parallel.py.
"""
import copy
import itertools
import random

import pytest
import torch
import torch.nn.functional as F

import mlp_reference as R
from conftest import (MLP_ROUNDINGS, TOL, assert_close_rel, capture_training_step, needs_caching_allocator,
                      poison_cuda_cache, rel_err, rounding_tol, saved_bytes)
from fused_dense import FusedGatedMLP, FusedMLP, fused_gated_mlp_func, ops
from op_checks import run_heuristic

OPS = torch.ops.fused_dense
GATED = {"swiglu": 4, "geglu": 5}
CPU_DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
HALF_DTYPES = [torch.float16, torch.bfloat16]
# (B, K, h): h below, at and past the interleave, not multiples of it, and empty dims
CPU_SHAPES = [(1, 1, 1), (3, 7, 5), (5, 16, 8), (7, 13, 19), (33, 40, 64), (2, 9, 100), (0, 7, 9), (4, 0, 9),
              (4, 9, 0)]
CUDA_SHAPES = [(1, 64, 64), (17, 33, 24), (256, 128, 136), (1000, 1024, 688), (17, 136, 5), (256, 64, 1001)]
LARGEST = (1000, 1024, 688)


def randn(*shape, dtype, device="cpu", scale=1.0):
    base = torch.float64 if dtype == torch.float64 else torch.float32
    return (torch.randn(*shape, dtype=base, device=device) * scale).to(dtype)


def shapes(base):
    return base + [tuple(random.randint(1, 120) for _ in range(3))]


# ------------------------------------------------------------------ the layout (tests/mlp_reference.py)

def ref_gated(gu64, activation):
    """act(g) * u of a float64 packed pre-activation, unpacked by the layout mlp_reference writes out."""
    gate, up = R.gated_columns(gu64.shape[-1] // 2)
    return R.act(gu64[..., gate], activation) * gu64[..., up]


def gated_sensitivity(gu64, activation):
    """The norm of |g act'(g) u| + |act(g) u|: the sizes of the first-order changes of act(g) * u
    under relative perturbations of g and u. Against the exact pre-activation the output differs by
    that pre-activation's rounding times these terms, which a few elements (g where act(g) is
    small and steep, g ~ -3 for GeGLU) can make larger than the output itself; this norm is the
    scale that rounding is judged on."""
    gate, up = R.gated_columns(gu64.shape[-1] // 2)
    g = gu64[..., gate].detach().requires_grad_()
    u = gu64[..., up].detach()
    act = R.act(g, activation)
    (d,) = torch.autograd.grad(act.sum(), g) if g.numel() else (torch.zeros_like(g),)
    terms = (g * d * u).abs() + (act * u).abs()
    return torch.linalg.vector_norm(terms.detach()).item()


def test_interleave_is_published_once():
    assert ops.GATED_INTERLEAVE == R.GATED_BLOCK == 8
    assert ops.GATED_ACTIVATIONS == ("swiglu", "geglu")
    assert [ops.ACTIVATIONS[a] for a in ops.GATED_ACTIVATIONS] == [GATED["swiglu"], GATED["geglu"]]


@pytest.mark.parametrize("hidden", [0, 1, 7, 8, 9, 16, 17, 100, 11008])
def test_gated_columns_follow_the_layout(hidden):
    gate, up = ops.gated_columns(hidden)
    eg, eu = R.gated_columns(hidden)
    assert gate.tolist() == eg and up.tolist() == eu
    assert sorted(eg + eu) == list(range(2 * hidden))  # a permutation of the packed rows


@pytest.mark.parametrize("dim", [0, 1, -1])
def test_pack_unpack_round_trip(dim):
    shape = [19, 5]
    shape[dim] = 19 if dim == 0 else 21
    gate, up = torch.randn(*shape), torch.randn(*shape)
    packed = ops.pack_gate_up(gate, up, dim=dim)
    gcols, ucols = R.gated_columns(gate.shape[dim])
    assert torch.equal(packed.index_select(dim, torch.tensor(gcols)), gate)
    assert torch.equal(packed.index_select(dim, torch.tensor(ucols)), up)
    g2, u2 = ops.unpack_gate_up(packed, dim=dim)
    assert torch.equal(g2, gate) and torch.equal(u2, up)


def test_pack_unpack_errors():
    with pytest.raises(ValueError, match=r"gate and up must have the same shape, got \(3, 4\) and \(3, 5\)"):
        ops.pack_gate_up(torch.randn(3, 4), torch.randn(3, 5))
    with pytest.raises(ValueError, match=r"even size along dim 0, got shape \(5, 2\)"):
        ops.unpack_gate_up(torch.randn(5, 2))
    with pytest.raises(ValueError, match="hidden must be an integer >= 0, got -1"):
        ops.gated_columns(-1)


# ------------------------------------------------------------------ the gated ops

def check_gated_forward(device, dtype, activation, save, heuristic, shape, poison=False):
    B, K, H = shape
    x = randn(B, K, dtype=dtype, device=device)
    w = randn(2 * H, K, dtype=dtype, device=device, scale=max(K, 1) ** -0.5)
    if poison:
        poison_cuda_cache()
    res = run_heuristic(lambda: OPS.gated_linear(x, w, GATED[activation], save, heuristic), heuristic)
    if res is None:
        return False
    ctx = f"gated_linear {activation} {dtype} shape={shape} heuristic={heuristic}"
    assert len(res) == (2 if save else 1), ctx
    gu_ref = F.linear(x.double(), w.double())
    assert res[0].shape == (B, H) and res[0].dtype == dtype, ctx
    # the reference gates the library's own rounded pre-activation where it is saved, else its own
    assert_close_rel(res[0], ref_gated(gu_ref if not save else res[1].double(), activation), dtype, ctx + " out")
    if save:
        assert res[1].shape == (B, 2 * H) and res[1].dtype == dtype, ctx
        assert_close_rel(res[1], gu_ref, dtype, ctx + " pre_act")
        # the rounding of the saved pre-activation, propagated: ||ref|| taken as at least the
        # sensitivity norm (gated_sensitivity), which a single steep element can dominate
        err = rel_err(res[0], ref_gated(gu_ref, activation), gated_sensitivity(gu_ref, activation))
        assert err <= 2 * TOL[dtype], f"{ctx} out vs exact pre_act: relative error {err:.3e} > {2 * TOL[dtype]:.1e}"
    return True


def check_gated_dgrad(device, dtype, activation, act_out, heuristic, shape, poison=False):
    B, H, N = shape
    w = randn(N, H, dtype=dtype, device=device, scale=max(N, 1) ** -0.5)
    d_out = randn(B, N, dtype=dtype, device=device)
    gu = randn(B, 2 * H, dtype=dtype, device=device, scale=2.0)
    if poison:
        poison_cuda_cache()
    res = run_heuristic(lambda: OPS.gated_linear_dgrad(w, d_out, gu, GATED[activation], heuristic, act_out),
                        heuristic)
    if res is None:
        return False
    ctx = f"gated_linear_dgrad {activation} {dtype} shape={shape} heuristic={heuristic}"
    assert len(res) == (2 if act_out else 1), ctx
    gu64 = gu.to(torch.float64, copy=True).requires_grad_()
    h64 = ref_gated(gu64, activation)
    d_h = d_out.double() @ w.double()
    (d_ref,) = torch.autograd.grad(h64, gu64, d_h) if h64.numel() else (torch.zeros_like(gu64),)
    assert res[0].shape == (B, 2 * H) and res[0].dtype == dtype, ctx
    assert_close_rel(res[0], d_ref, dtype, ctx + " d_pre")
    if act_out:
        assert torch.equal(res[1], OPS.gated_act_forward(gu, GATED[activation])), ctx + " act_out bits"
    return True


@pytest.mark.parametrize("dtype", CPU_DTYPES, ids=str)
@pytest.mark.parametrize("activation", list(GATED))
@pytest.mark.parametrize("save", [False, True])
def test_cpu_gated_linear(dtype, activation, save):
    for shape in shapes(CPU_SHAPES):
        check_gated_forward("cpu", dtype, activation, save, random.choice([-2, -1, 0]), shape)


@pytest.mark.parametrize("dtype", CPU_DTYPES, ids=str)
@pytest.mark.parametrize("activation", list(GATED))
@pytest.mark.parametrize("act_out", [False, True])
def test_cpu_gated_linear_dgrad(dtype, activation, act_out):
    for shape in shapes(CPU_SHAPES):
        check_gated_dgrad("cpu", dtype, activation, act_out, random.choice([-2, -1, 0]), shape)


@pytest.mark.parametrize("activation", list(GATED))
def test_cpu_gated_act_forward_far_values(activation):
    """Saturated and non-finite gates: the limits, NaN kept (float32 and float64)."""
    for dtype in (torch.float32, torch.float64):
        g = torch.tensor([[-1e30, -80.0, -1.0, 0.0, 1.0, 80.0, 1e30, float("nan"), 3.0]], dtype=dtype)
        gu = R.pack_gate_up(g, torch.full_like(g, 2.0), dim=1)
        h = OPS.gated_act_forward(gu, GATED[activation])
        ref = ref_gated(gu.double(), activation)
        assert torch.allclose(h[0, :-2].double(), ref[0, :-2], rtol=1e-6, atol=1e-30), (h, ref)
        assert h[0, -2].isnan() and rel_err(h[0, -1:], ref[0, -1:]) <= TOL[dtype]


@pytest.mark.cuda
@pytest.mark.parametrize("heuristic", [-2, -1, 0, 1])
@pytest.mark.parametrize("activation", list(GATED))
@pytest.mark.parametrize("save", [False, True])
@pytest.mark.parametrize("dtype", HALF_DTYPES + [torch.float32], ids=str)
def test_cuda_gated_linear(dtype, activation, save, heuristic, no_tf32):
    """An index >= 1 may be past cuBLASLt's list for a shape (the documented ValueError); -2, -1
    and 0 must run everywhere (run_heuristic lets no refusal through for them), and index 1 on
    the largest shape, where cuBLASLt offers several algorithms."""
    ran = [check_gated_forward("cuda", dtype, activation, save, heuristic, shape, poison=True)
           for shape in CUDA_SHAPES + [(0, 64, 64), (5, 0, 24), (5, 64, 0)]]
    assert_ran(ran, heuristic)


@pytest.mark.cuda
@pytest.mark.parametrize("heuristic", [-2, -1, 0, 1])
@pytest.mark.parametrize("activation", list(GATED))
@pytest.mark.parametrize("act_out", [False, True])
@pytest.mark.parametrize("dtype", HALF_DTYPES + [torch.float32], ids=str)
def test_cuda_gated_linear_dgrad(dtype, activation, act_out, heuristic, no_tf32):
    ran = [check_gated_dgrad("cuda", dtype, activation, act_out, heuristic, shape, poison=True)
           for shape in CUDA_SHAPES + [(0, 64, 64), (5, 24, 0), (5, 0, 64)]]
    assert_ran(ran, heuristic)


def assert_ran(ran, heuristic):
    """-2, -1 and 0 ran on every shape; an index >= 1 on the largest CUDA shape at least."""
    refused = [shape for shape, r in zip(CUDA_SHAPES, ran) if not r]
    if heuristic <= 0:
        assert all(ran), f"heuristic {heuristic} refused shapes {refused}"
    else:
        assert ran[CUDA_SHAPES.index(LARGEST)], f"heuristic {heuristic} refused the largest shape {LARGEST}"


@pytest.mark.cuda
@pytest.mark.parametrize("activation", list(GATED))
@pytest.mark.parametrize("dtype", HALF_DTYPES + [torch.float32], ids=str)
def test_cuda_gated_ops_match_cpu(dtype, activation):
    """The CUDA gating kernels on a misaligned (offset) and an aligned buffer compute what the CPU
    reference computes from the same rounded inputs, within one rounding."""
    for offset in (0, 1):
        gu = randn(37, 2 * 104 + offset, dtype=dtype)[:, offset:].contiguous()
        buf = torch.empty(gu.numel() + offset, dtype=dtype, device="cuda")
        gu_cuda = buf[offset:].view_as(gu).copy_(gu)
        h_cuda = OPS.gated_act_forward(gu_cuda, GATED[activation])
        assert_close_rel(h_cuda.cpu(), OPS.gated_act_forward(gu, GATED[activation]).double(), dtype,
                         f"offset {offset}")


# ------------------------------------------------------------------ errors

def test_gated_op_errors_name_the_argument():
    x, w = torch.randn(3, 5), torch.randn(8, 5)
    with pytest.raises(ValueError, match=r"gated_linear: activation must be 4 \(swiglu\) or 5 \(geglu\), got 1 "
                                         r"\(gelu_approx\)"):
        OPS.gated_linear(x, w, 1, False, -2)
    with pytest.raises(ValueError, match=r"weight.size\(0\) must be even, got weight shape \[7, 5\]"):
        OPS.gated_linear(x, torch.randn(7, 5), 4, False, -2)
    with pytest.raises(ValueError, match=r"input.size\(1\) \(in_features\) must equal weight.size\(1\) = 6"):
        OPS.gated_linear(x, torch.randn(8, 6), 4, False, -2)
    with pytest.raises(ValueError, match="weight must have the dtype of input"):
        OPS.gated_linear(x, w.double(), 4, False, -2)
    with pytest.raises(ValueError, match="heuristic must be -2"):
        OPS.gated_linear(x, w, 4, False, -3)
    w2, g = torch.randn(6, 4), torch.randn(3, 6)
    with pytest.raises(ValueError, match=r"pre_act must have shape \[3, 8\] = \[batch, 2 \* hidden\].*got \[3, 4\]"):
        OPS.gated_linear_dgrad(w2, g, torch.randn(3, 4), 5, -2)
    with pytest.raises(ValueError, match="pre_act must have the dtype of weight"):
        OPS.gated_linear_dgrad(w2, g, torch.randn(3, 8).half(), 5, -2)
    with pytest.raises(ValueError, match=r"d_output.size\(1\) must equal weight.size\(0\) = 6"):
        OPS.gated_linear_dgrad(w2, torch.randn(3, 5), torch.randn(3, 8), 5, -2)
    with pytest.raises(ValueError, match=r"activation must be 4 \(swiglu\) or 5 \(geglu\), got 2 \(relu\)"):
        OPS.gated_linear_dgrad(w2, g, torch.randn(3, 8), 2, -2)
    with pytest.raises(ValueError, match=r"gated_act_forward: pre_act must be the packed .* got shape \[3, 5\]"):
        OPS.gated_act_forward(torch.randn(3, 5), 4)
    with pytest.raises(ValueError, match="pre_act must be 2-D"):
        OPS.gated_act_forward(torch.randn(3, 4, 2), 4)


@pytest.mark.parametrize("code,name", [(4, "swiglu"), (5, "geglu")])
def test_non_gated_ops_refuse_gated_codes(code, name):
    x, w = torch.randn(3, 5), torch.randn(8, 5)
    msg = rf"activation {code} \({name}\) is gated; it is taken by the gated ops"
    with pytest.raises(ValueError, match="linear_act: " + msg):
        OPS.linear_act(x, w, None, code, False, -2)
    with pytest.raises(ValueError, match="act_linear_dgrad: " + msg):
        OPS.act_linear_dgrad(torch.randn(4, 8), torch.randn(3, 4), torch.randn(3, 8), code, False, -2)
    with pytest.raises(ValueError, match="act_forward: " + msg):
        OPS.act_forward(torch.randn(3, 8), code)
    with pytest.raises(ValueError, match=r"activation must be one of \['gelu_approx', 'relu', 'sqrelu'\]"):
        FusedMLP(8, 16, activation=name)
    with pytest.raises(ValueError, match="linear_act: " + msg):
        ops.linear_act(x, w, None, name)


def test_fused_mlp_op_gated_shape_errors():
    x = torch.randn(3, 5)
    with pytest.raises(ValueError, match=r"for swiglu, weight2.size\(1\) must equal weight1.size\(0\) / 2 = 4"):
        OPS.fused_mlp(x, torch.randn(8, 5), None, torch.randn(6, 8), None, 4, 0, -2)
    with pytest.raises(ValueError, match=r"for geglu, weight1 is the packed .* must be even"):
        OPS.fused_mlp(x, torch.randn(7, 5), None, torch.randn(6, 3), None, 5, 0, -2)
    with pytest.raises(ValueError, match="swiglu takes no bias1"):
        OPS.fused_mlp(x, torch.randn(8, 5), torch.randn(8), torch.randn(6, 4), None, 4, 0, -2)
    with pytest.raises(ValueError, match=r"activation must be 1 \(gelu_approx\), 2 \(relu\), 3 \(sqrelu\), 4 "
                                         r"\(swiglu\) or 5 \(geglu\), got 6"):
        OPS.fused_mlp(x, torch.randn(8, 5), None, torch.randn(6, 8), None, 6, 0, -2)


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(activation="relu"), ValueError, r"activation must be one of \['swiglu', 'geglu'\], got 'relu'"),
    (dict(bias=True), ValueError, "bias must be False: the gated layers have no bias"),
    (dict(checkpoint_lvl=3), ValueError, "checkpoint_lvl must be 0, 1 or 2, got 3"),
    (dict(heuristic="fast"), ValueError, "heuristic must be 'auto'"),
])
def test_fused_gated_mlp_bad_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        FusedGatedMLP(8, 16, **kwargs)


def test_raw_gated_ops_refuse_requires_grad():
    with pytest.raises(RuntimeError, match="argument 'input' requires grad"):
        OPS.gated_linear(torch.randn(3, 5, requires_grad=True), torch.randn(8, 5), 4, False, -2)
    with pytest.raises(RuntimeError, match="argument 'pre_act' requires grad"):
        OPS.gated_act_forward(torch.randn(3, 8, requires_grad=True), 4)


# ------------------------------------------------------------------ the MLP: plan, levels, references

def test_plan_of_gated_codes_is_the_gelu_plan():
    """The checkpoint rules are written once: a gated code gets the plan of a non-ReLU activation."""
    for lvl, need in itertools.product([0, 1, 2], itertools.product([False, True], repeat=5)):
        need = list(need)
        need[2] = False  # no fc1 bias
        for code in GATED.values():
            assert ops.mlp_plan(code, lvl, need) == ops.mlp_plan(ops.ACTIVATIONS["gelu_approx"], lvl, need)


def mlp_inputs(dtype, device="cpu", batch=(5, 7), d=24, h=40, n=None):
    n = d if n is None else n
    x = randn(*batch, d, dtype=dtype, device=device).requires_grad_()
    w1 = randn(2 * h, d, dtype=dtype, device=device, scale=d ** -0.5).requires_grad_()
    w2 = randn(n, h, dtype=dtype, device=device, scale=h ** -0.5).requires_grad_()
    return x, w1, w2


def reference_mlp(x, w1, w2, activation):
    x, w1, w2 = (t.detach().double().requires_grad_() for t in (x, w1, w2))
    out = F.linear(ref_gated(F.linear(x, w1), activation), w2)
    return out, (x, w1, w2)


def check_mlp(dtype, activation, lvl, device="cpu", heuristic="auto", **shape):
    x, w1, w2 = mlp_inputs(dtype, device, **shape)
    out = fused_gated_mlp_func(x, w1, w2, activation=activation, checkpoint_lvl=lvl, heuristic=heuristic)
    g = torch.randn_like(out)
    out.backward(g)
    ref, leaves = reference_mlp(x, w1, w2, activation)
    ref.backward(g.double())
    ctx = f"{activation} lvl={lvl} {dtype}"
    tol = rounding_tol(dtype, max(x.numel() // x.shape[-1], *w1.shape, *w2.shape), MLP_ROUNDINGS)
    assert_close_rel(out, ref, dtype, ctx + " out", tol=tol)
    for name, t, r in zip(("x", "weight1", "weight2"), (x, w1, w2), leaves):
        assert_close_rel(t.grad, r.grad, dtype, f"{ctx} grad {name}", tol=tol)


@pytest.mark.parametrize("dtype", CPU_DTYPES, ids=str)
@pytest.mark.parametrize("activation", list(GATED))
@pytest.mark.parametrize("lvl", [0, 1, 2])
def test_cpu_gated_mlp_vs_reference(dtype, activation, lvl):
    check_mlp(dtype, activation, lvl)
    check_mlp(dtype, activation, lvl, batch=(random.randint(1, 40),), d=random.randint(1, 50),
              h=random.randint(1, 50), n=random.randint(1, 50))


@pytest.mark.parametrize("activation", list(GATED))
def test_checkpoint_levels_memory_and_bits(activation, device="cpu"):
    """Level 0 keeps x, gu and h; 1 keeps x and gu; 2 keeps x only (plus the weights). Level 1's
    output and gradients are level 0's bits; level 2's are within tolerance (docs/contract.md)."""
    dtype, batch, d, h = torch.float32, 64, 16, 48
    x, w1, w2 = mlp_inputs(dtype, device, batch=(batch,), d=d, h=h)
    esize = x.element_size()
    weights = (w1.numel() + w2.numel()) * esize
    results = {}
    for lvl in (0, 1, 2):
        xs, w1s, w2s = (t.detach().clone().requires_grad_() for t in (x, w1, w2))
        out, nbytes = saved_bytes(lambda: fused_gated_mlp_func(xs, w1s, w2s, activation=activation,
                                                               checkpoint_lvl=lvl))
        out.sum().backward()
        results[lvl] = (out, xs.grad, w1s.grad, w2s.grad, nbytes)
    x_bytes, gu_bytes, h_bytes = batch * d * esize, batch * 2 * h * esize, batch * h * esize
    assert results[0][4] == weights + x_bytes + gu_bytes + h_bytes
    assert results[1][4] == weights + x_bytes + gu_bytes
    assert results[2][4] == weights + x_bytes
    for a, b in zip(results[0][:4], results[1][:4]):
        assert torch.equal(a, b)
    for a, b in zip(results[0][:4], results[2][:4]):
        assert rel_err(b, a) <= TOL[dtype]


def test_eval_and_no_grad_keep_nothing_but_x():
    m = FusedGatedMLP(16, 24)
    x = torch.randn(10, 16, requires_grad=True)
    _, train_bytes = saved_bytes(lambda: m(x))
    m.eval()
    _, eval_bytes = saved_bytes(lambda: m(x))
    weights = sum(p.numel() for p in m.parameters()) * 4
    assert eval_bytes == weights + x.numel() * 4 < train_bytes
    with torch.no_grad():
        _, none_bytes = saved_bytes(lambda: m(x))
    assert none_bytes == 0


def test_only_requested_gradients():
    x, w1, w2 = mlp_inputs(torch.float64)
    x.requires_grad_(False)
    out = fused_gated_mlp_func(x, w1, w2, activation="geglu")
    out.sum().backward()
    ref, (_, r1, r2) = reference_mlp(x, w1, w2, "geglu")
    ref.sum().backward()
    assert x.grad is None
    assert_close_rel(w1.grad, r1.grad)
    assert_close_rel(w2.grad, r2.grad)


def test_module_forward_matches_function_and_repr():
    m = FusedGatedMLP(12, 20, 7, activation="geglu", checkpoint_lvl=1, dtype=torch.float64)
    assert m.gate_up_proj.weight.shape == (40, 12) and m.down_proj.weight.shape == (7, 20)
    x = torch.randn(3, 4, 12, dtype=torch.float64)
    ref, _ = reference_mlp(x, m.gate_up_proj.weight, m.down_proj.weight, "geglu")
    out = m(x)
    assert out.shape == (3, 4, 7)
    assert_close_rel(out, ref)
    assert "activation='geglu', checkpoint_lvl=1" in repr(m)


def test_state_dict_names_and_round_trip():
    m = FusedGatedMLP(12, 20, dtype=torch.float64)
    sd = m.state_dict()
    assert sorted(sd) == ["down_proj.weight", "gate_proj.weight", "up_proj.weight"]
    assert sd["gate_proj.weight"].shape == sd["up_proj.weight"].shape == (20, 12)
    gate, up = R.unpack_gate_up(m.gate_up_proj.weight.detach())
    assert torch.equal(sd["gate_proj.weight"], gate) and torch.equal(sd["up_proj.weight"], up)
    m2 = FusedGatedMLP(12, 20, dtype=torch.float64)
    m2.load_state_dict(sd)
    assert torch.equal(m2.gate_up_proj.weight, m.gate_up_proj.weight)
    # the packed name loads too, and a nested prefix works
    outer = torch.nn.Sequential(FusedGatedMLP(12, 20, dtype=torch.float64))
    outer.load_state_dict({"0.gate_up_proj.weight": m.gate_up_proj.weight.detach(),
                           "0.down_proj.weight": m.down_proj.weight.detach()})
    assert torch.equal(outer[0].gate_up_proj.weight, m.gate_up_proj.weight)
    assert sorted(outer.state_dict()) == ["0.down_proj.weight", "0.gate_proj.weight", "0.up_proj.weight"]
    with pytest.raises(RuntimeError, match="gate_proj.weight and up_proj.weight must be loaded together"):
        m2.load_state_dict({"gate_proj.weight": gate, "down_proj.weight": sd["down_proj.weight"]})


# ------------------------------------------------------------------ torch.compile, autocast

def train_step(model, x, g):
    out = model(x)
    (out * g).sum().backward()
    return out


@pytest.mark.parametrize("backend,activation,lvl", [("aot_eager", "swiglu", 0), ("aot_eager", "geglu", 1),
                                                     ("aot_eager", "swiglu", 2), ("inductor", "geglu", 0)])
def test_compile_fullgraph(backend, activation, lvl):
    torch._dynamo.reset()
    model = FusedGatedMLP(32, 48, activation=activation, checkpoint_lvl=lvl)
    eager, compiled = copy.deepcopy(model), torch.compile(copy.deepcopy(model), backend=backend, fullgraph=True)
    x = torch.randn(3, 5, 32)
    g = torch.randn(3, 5, 32)
    x_e, x_c = x.clone().requires_grad_(), x.clone().requires_grad_()
    out_e, out_c = train_step(eager, x_e, g), train_step(compiled, x_c, g)  # fullgraph: a graph break raises
    torch.testing.assert_close(out_c, out_e)
    torch.testing.assert_close(x_c.grad, x_e.grad)
    for (name, p_e), p_c in zip(eager.named_parameters(), compiled.parameters()):
        torch.testing.assert_close(p_c.grad, p_e.grad, msg=name)


def test_autocast_cpu_bf16():
    """Under autocast the float32 input and weights run in bf16, as nn.Linear's would, and the
    gradients reach the float32 leaves."""
    m = FusedGatedMLP(24, 40)
    x = torch.randn(6, 24, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = m(x)
    assert out.dtype == torch.bfloat16
    out.float().sum().backward()
    xr, w1, w2 = (t.detach().to(torch.bfloat16).double().requires_grad_()
                  for t in (x, m.gate_up_proj.weight, m.down_proj.weight))
    ref = F.linear(ref_gated(F.linear(xr, w1), "swiglu"), w2)
    ref.sum().backward()
    tol = rounding_tol(torch.bfloat16, 40, MLP_ROUNDINGS)
    assert_close_rel(out, ref, torch.bfloat16, "out", tol=tol)
    assert x.grad.dtype == torch.float32 and m.gate_up_proj.weight.grad.dtype == torch.float32
    assert_close_rel(x.grad, xr.grad, torch.bfloat16, "grad x", tol=tol)
    assert_close_rel(m.gate_up_proj.weight.grad, w1.grad, torch.bfloat16, "grad weight1", tol=tol)


# ------------------------------------------------------------------ CUDA

@pytest.mark.cuda
@pytest.mark.parametrize("heuristic", ["auto", -1, 0])
@pytest.mark.parametrize("activation", list(GATED))
@pytest.mark.parametrize("lvl", [0, 1, 2])
@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=str)
def test_cuda_gated_mlp_vs_reference(dtype, activation, lvl, heuristic):
    check_mlp(dtype, activation, lvl, device="cuda", heuristic=heuristic, batch=(4, 64), d=256, h=688)
    check_mlp(dtype, activation, lvl, device="cuda", heuristic=heuristic, batch=(37,), d=72, h=21, n=40)


@pytest.mark.cuda
@pytest.mark.parametrize("activation", list(GATED))
def test_cuda_checkpoint_levels_memory_and_bits(activation):
    test_checkpoint_levels_memory_and_bits(activation, device="cuda")


@pytest.mark.cuda
@pytest.mark.parametrize("activation", list(GATED))
def test_cuda_opcheck_gated(activation):
    code = GATED[activation]
    r = lambda *s: torch.randn(*s, device="cuda", dtype=torch.bfloat16)  # noqa: E731
    # A fixed algorithm (heuristic 0), not 'auto': opcheck compares calls of the op, and 'auto' may
    # replace a provisional choice with a measured one between them (docs/contract.md, "Where a
    # choice comes from"), which changes the bits (seen once in the whole CUDA suite under -n 4).
    torch.library.opcheck(OPS.gated_linear.default, (r(9, 32), r(48, 32), code, True, 0))
    torch.library.opcheck(OPS.gated_linear_dgrad.default, (r(16, 24), r(9, 16), r(9, 48), code, -1, True))
    torch.library.opcheck(OPS.gated_act_forward.default, (r(9, 48), code))


@pytest.mark.cuda
@needs_caching_allocator
@pytest.mark.parametrize("activation", list(GATED))
def test_cuda_graph_replay(activation):
    m = FusedGatedMLP(256, 688, activation=activation, device="cuda", dtype=torch.bfloat16)
    static_x = torch.randn(128, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    static_g = torch.randn(128, 256, device="cuda", dtype=torch.bfloat16)
    graph, static_out, static_grads = capture_training_step(m, static_x, static_g)
    for _ in range(2):
        x, g = torch.randn_like(static_x), torch.randn_like(static_g)
        with torch.no_grad():
            static_x.copy_(x)
            static_g.copy_(g)
        graph.replay()
        torch.cuda.synchronize()
        ref, leaves = reference_mlp(x, m.gate_up_proj.weight, m.down_proj.weight, activation)
        ref.backward(g.double())
        tol = rounding_tol(torch.bfloat16, 688, MLP_ROUNDINGS)
        assert_close_rel(static_out, ref, torch.bfloat16, "out", tol=tol)
        for grad, leaf in zip(static_grads, leaves[1:]):
            assert_close_rel(grad, leaf.grad, torch.bfloat16, "grad", tol=tol)
