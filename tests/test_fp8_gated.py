"""FP8 for the gated MLP: fp8_quantize's gated modes (act(g) * u, and the packed gate / up gradient)
and FusedGatedMLP(fp8=...), against float64 references of the same quantized computation.

The references and tolerances are test_fp8.py's (its docstring states where the remaining
differences come from); the gated values add no rounding of their own: the pass computes
act(g) * u and d_h * u * act'(g), d_h * act(g) in fp32 from the bf16 gu and d_h, as the
references do in float64.
"""
import math

import pytest
import torch

import fused_dense
from conftest import poison_cuda_cache, rel_err
from fused_dense import Float8Recipe, FusedGatedMLP
from test_fp8 import (F8, FP8_CPU_TOL, QUANTIZED, StepQuantizer, assert_fp8_close, compile_matches_eager, cuda, devices, fake_quant,
                      fp8_gpu, fp8_tol, graph_replay_matches_eager, levels_are_bit_identical, randn)

GATED = {"swiglu": 4, "geglu": 5}


def gate_act(g, act):
    return torch.nn.functional.silu(g) if act == "swiglu" else torch.nn.functional.gelu(g, approximate="tanh")


def gate_act_grad(g, act):
    p = g.detach().clone().requires_grad_(True)
    gate_act(p, act).backward(torch.ones_like(p))
    return p.grad


# The packed gate / up layout of gu [R, 2h] and of its gradient, written out from its definition
# (docs/contract.md, "Gated layout"): blocks of G = 8 units, each block's gate columns, then the
# up columns of the same units; only the last block may be short.
G = 8


def gate_up_columns(hidden):
    """(gate, up): the packed columns of each unit's gate and up values."""
    gate = [j // G * 2 * G + j % G for j in range(hidden)]
    up = [c + min(G, hidden - j // G * G) for j, c in enumerate(gate)]
    return torch.tensor(gate, dtype=torch.long), torch.tensor(up, dtype=torch.long)


def split_gu(gu):
    """(g, u) [R, h] of a packed [R, 2h] activation."""
    gate, up = gate_up_columns(gu.shape[1] // 2)
    return gu[:, gate.to(gu.device)], gu[:, up.to(gu.device)]


def pack_columns(gate_part, up_part):
    """The packed [R, 2h] of the gate and up parts [R, h]."""
    gate, up = gate_up_columns(gate_part.shape[1])
    packed = gate_part.new_empty(gate_part.shape[0], 2 * gate_part.shape[1])
    packed[:, gate.to(packed.device)] = gate_part
    packed[:, up.to(packed.device)] = up_part
    return packed


def gated_value(gu, act):
    g, u = split_gu(gu)
    return gate_act(g, act) * u


def gated_value_grad(d_h, gu, act):
    g, u = split_gu(gu)
    return pack_columns(d_h * u * gate_act_grad(g, act), d_h * gate_act(g, act))


def ref_gated_mlp(x, w1, w2, g, act, grad_fmt, dtype, scales=None, skip=(), pre_fp8=False):
    """Outputs and gradients of the gated FP8 MLP step, float64, rounded to `dtype` where the op
    rounds (the GEMMs' gu and d_h), and 'amax' as test_fp8.ref_mlp's; scales: delayed scaling's
    [x, act, grad_out, grad_pre]; skip:
    the quantizations left out (test_fp8.QUANTIZED; 'act' is act(g) * u, 'grad_pre' the packed
    gate / up gradient); pre_fp8: the gating's derivative taken at gu's e4m3 copy (its own amax),
    dequantized and rounded to `dtype` (save_pre_fp8)."""
    d = lambda t: t.detach().double().cpu()  # noqa: E731
    x, w1, w2, g = map(d, (x, w1, w2, g))
    q = StepQuantizer(None if scales is None else dict(zip(QUANTIZED, scales)), skip)
    xq, w1q, w2q = q("x", x, 0), q("w1", w1, 0), q("w2", w2, 0)
    gu = (xq @ w1q.T).to(dtype).double()
    aq = q("act", gated_value(gu, act), 0)
    out = aq @ w2q.T
    gq = q("grad_out", g, grad_fmt)
    d_h = (gq @ w2q).to(dtype).double()
    kept = fake_quant(gu, 0)[0].to(dtype).double() if pre_fp8 else gu
    dq = q("grad_pre", gated_value_grad(d_h, kept, act), grad_fmt)
    return {"out": out, "x": dq @ w1q, "w1": dq.T @ xq, "w2": gq.T @ aq,
            "amax": torch.stack([q.amax[k] for k in QUANTIZED[:4]])}


# ---- fp8_quantize, gated modes ----

@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("fmt", [0, 1])
@pytest.mark.parametrize("act", list(GATED))
@pytest.mark.parametrize("backward", [False, True])
@pytest.mark.parametrize("rows,hidden", [(1, 8), (37, 24), (130, 104), (64, 64)])
def test_gated_quantize_matches_reference(device, fmt, act, backward, rows, hidden):
    if device == "cuda":
        poison_cuda_cache()
    gu = randn(rows, 2 * hidden, device=device, scale=2.0)
    if backward:
        d_h = randn(rows, hidden, device=device, scale=3.0)
        res = torch.ops.fused_dense.fp8_quantize(d_h, gu, GATED[act], True, fmt, None, True, True, True)
        v = gated_value_grad(d_h.double().cpu(), gu.double().cpu(), act)
    else:
        res = torch.ops.fused_dense.fp8_quantize(gu, None, GATED[act], False, fmt, None, True, True, True)
        v = gated_value(gu.double().cpu(), act)
    data, data_t, scale, scale_inv, amax, sums = res
    cols = 2 * hidden if backward else hidden
    assert data.dtype == F8[fmt] and data.shape == (rows, cols)
    assert data_t.shape == (cols, (rows + 15) // 16 * 16)
    deq, s = fake_quant(v, fmt)
    assert math.isclose(amax.item(), v.abs().max().item(), rel_tol=1e-5)
    assert math.isclose(scale.item(), s.item(), rel_tol=1e-5)
    assert scale_inv.item() == pytest.approx(1.0 / scale.item(), rel=1e-6)
    assert_fp8_close(data.cpu().double() / scale.item(), deq, "data", fp8_tol(device))
    assert torch.equal(data_t[:, :rows].cpu().view(torch.uint8), data.cpu().t().contiguous().view(torch.uint8))
    assert torch.all(data_t[:, rows:].cpu().view(torch.uint8) == 0)
    assert rel_err(sums.double().cpu(), v.sum(0)) <= 1e-2


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("backward", [False, True])
def test_gated_quantize_cpu_and_cuda_agree_bit_for_bit_mostly(device, backward):
    """The kernel and the CPU reference agree byte for byte except where the fast sigmoid / GELU
    lands on the other side of a rounding boundary: < 0.1% of the elements in the forward, as
    test_fp8.py's rule; the backward's d_h * u * act'(g) multiplies three rounded fp32 factors in
    another order than ATen's silu / gelu backward (measured 0.26% on the H200), so 0.5% there."""
    for act in GATED.values():
        gu = randn(300, 192, device=device, scale=2.0)
        args = (randn(300, 96, device=device), gu) if backward else (gu, None)
        res = torch.ops.fused_dense.fp8_quantize(*args, act, backward, 0, None, True, False, False)
        ref = torch.ops.fused_dense.fp8_quantize(*(a.cpu() if a is not None else None for a in args), act, backward,
                                                 0, None, True, False, False)
        differ = (res[0].cpu().view(torch.uint8) != ref[0].view(torch.uint8)).double().mean().item()
        assert differ <= (5e-3 if backward else 1e-3)
        assert math.isclose(res[2].item(), ref[2].item(), rel_tol=1e-6)


@pytest.mark.parametrize("device", devices())
def test_gated_quantize_delayed_saturates_and_nan_propagates(device):
    gu = randn(32, 64, device=device)
    g_col, u_col = gate_up_columns(32)
    gu[2, g_col[5]] = 30.0  # silu(30) * u with u = 100: 3000, saturates at 448
    gu[2, u_col[5]] = 100.0
    scale = torch.tensor(1.0, device=device)
    data, _, _, _, amax, _ = torch.ops.fused_dense.fp8_quantize(gu, None, 4, False, 0, scale, True, False, False)
    assert data[2, 5].float().item() == 448.0 and torch.isfinite(data.float()).all()
    assert amax.item() == pytest.approx(3000.0, rel=1e-3)
    d_h = randn(32, 32, device=device)
    d_h[7, 3] = float("nan")
    data, _, s, _, amax, _ = torch.ops.fused_dense.fp8_quantize(d_h, gu, 5, True, 1, None, True, False, False)
    assert math.isnan(amax.item()) and math.isnan(s.item()) and torch.isnan(data.float()).all()


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("act", list(GATED))
@pytest.mark.parametrize("pre_fp8", [False, True])
def test_gated_backward_amax_sees_every_column(device, act, pre_fp8):
    """The backward's amax pass (current scaling) measures both halves of every interleave block in
    every row: a spike planted in one gate or up column is the amax, wherever it sits (the first
    block's gate half, a middle block's up half, both halves of the last row's last block), with gu
    in the model's dtype (mode 4) and as its e4m3 copy (mode 6). 37 rows: no multiple of a tile."""
    rows, hidden = 37, 40
    g_col, u_col = gate_up_columns(hidden)
    from test_fp8 import e4m3_copy

    for r, j, half in ((0, 0, "gate"), (17, 20, "up"), (36, 39, "up"), (36, 39, "gate"), (3, 31, "gate")):
        d_h = randn(rows, hidden, device=device)
        gu = randn(rows, 2 * hidden, device=device)
        d_h[r, j] = 1000.0
        # gate column: d_h * u * act'(0) = 1000 * 50 * 0.5; up column: d_h * act(10), about 1000 * 10
        gu[r, g_col[j]], gu[r, u_col[j]] = (0.0, 50.0) if half == "gate" else (10.0, 0.0)
        if pre_fp8:
            pre, psi = e4m3_copy(gu)
            used = (pre.float() * psi).to(gu.dtype)
        else:
            pre, psi, used = gu, None, gu
        res = torch.ops.fused_dense.fp8_quantize(d_h, pre, GATED[act], True, 0, None, True, False, False, psi)
        v = gated_value_grad(d_h.double().cpu(), used.double().cpu(), act).abs()
        col = (g_col if half == "gate" else u_col)[j].item()
        assert v.max().item() == v[r, col].item() > 5000, "the spike is the reference's amax"
        assert math.isclose(res[4].item(), v[r, col].item(), rel_tol=1e-5), (r, j, half, res[4].item())


def test_gated_quantize_errors():
    q = torch.ops.fused_dense.fp8_quantize
    with pytest.raises(ValueError, match="packed gu .* multiple of 16 .* got 24"):
        q(randn(4, 24), None, 4, False, 0, None, True, False, False)
    with pytest.raises(ValueError, match=r"gated backward's pre_act must be the packed gu \[4, 32\]"):
        q(randn(4, 16), randn(4, 16), 5, True, 0, None, True, False, False)
    with pytest.raises(ValueError, match="activation must be .* got 6"):
        q(randn(4, 16), None, 6, False, 0, None, True, False, False)


@pytest.mark.parametrize("device", devices())
def test_gated_quantize_opcheck(device):
    gu = randn(40, 64, device=device)
    d_h = randn(40, 32, device=device)
    scale = torch.tensor(3.0, device=device)
    for args in [(gu, None, 4, False, 0, None, True, True, True), (d_h, gu, 5, True, 1, scale, True, True, True)]:
        torch.library.opcheck(torch.ops.fused_dense.fp8_quantize.default, args)


# ---- FusedGatedMLP(fp8=...) ----

def make_gated(device, act="swiglu", recipe=None, d=64, h=96, lvl=0, dtype=torch.bfloat16):
    return FusedGatedMLP(d, h, activation=act, checkpoint_lvl=lvl, device=device, dtype=dtype,
                         fp8=recipe or Float8Recipe(min_features=0))


def run_gated_step(m, x, g, **kw):
    x = x.detach().requires_grad_(True)
    for p in m.parameters():
        p.grad = None
    out = m(x, **kw)
    out.backward(g)
    return out, {"x": x.grad, "w1": m.gate_up_proj.weight.grad, "w2": m.down_proj.weight.grad}


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("act", list(GATED))
def test_gated_mlp_save_pre_fp8_matches_reference(device, act):
    """save_pre_fp8 in the gated MLP: gu kept as its e4m3 copy, the gating's derivative taken there;
    the forward's bits unchanged."""
    m = make_gated(device, act, Float8Recipe(min_features=0, save_pre_fp8=True))
    m_default = make_gated(device, act, Float8Recipe(min_features=0))
    m_default.load_state_dict(m.state_dict())
    x, g = randn(77, 64, device=device, scale=2.0), randn(77, 64, device=device)
    out, grads = run_gated_step(m, x, g)
    out_default, _ = run_gated_step(m_default, x, g)
    assert torch.equal(out, out_default), "save_pre_fp8 changed the forward"
    args = (x, m.gate_up_proj.weight, m.down_proj.weight, g, act, 1, torch.bfloat16)
    ref, ref_default = ref_gated_mlp(*args, pre_fp8=True), ref_gated_mlp(*args)
    for k, v in grads.items():
        assert_fp8_close(v, ref[k], f"grad {k}", fp8_tol(device, "e5m2"))
    if device == "cpu":  # negative control: the derivative at the kept copy moves the gradients
        assert rel_err(grads["w1"], ref_default["w1"]) > FP8_CPU_TOL, "gu was not quantized"


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("act", list(GATED))
@pytest.mark.parametrize("grad_format", ["e5m2", "e4m3"])
@pytest.mark.parametrize("rows", [1, 77, 256])
def test_gated_mlp_current_scaling_matches_reference(device, act, grad_format, rows):
    if device == "cuda":
        poison_cuda_cache()
    m = make_gated(device, act, Float8Recipe(grad_format=grad_format, min_features=0))
    x = randn(rows, 64, device=device)
    g = randn(rows, 64, device=device)
    out, grads = run_gated_step(m, x, g)
    ref = ref_gated_mlp(x, m.gate_up_proj.weight, m.down_proj.weight, g, act, 1 if grad_format == "e5m2" else 0,
                        torch.bfloat16)
    assert out.dtype == torch.bfloat16 and out.shape == (rows, 64)
    assert_fp8_close(out, ref["out"], "out", fp8_tol(device))
    for k, v in grads.items():
        assert v.dtype == torch.bfloat16
        assert_fp8_close(v, ref[k], f"grad {k}", fp8_tol(device, grad_format))


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("scaling", ["current", "delayed"])
def test_gated_checkpoint_levels_are_bit_identical(device, scaling):
    recipe = Float8Recipe(scaling=scaling, min_features=0)
    levels_are_bit_identical(lambda lvl: make_gated(device, "geglu", recipe, lvl=lvl), run_gated_step,
                             randn(96, 64, device=device), randn(96, 64, device=device))


@pytest.mark.parametrize("device", devices())
def test_gated_delayed_scaling_state_and_state_dict(device):
    recipe = Float8Recipe(scaling="delayed", amax_history_len=4, min_features=0)
    m = make_gated(device, recipe=recipe)
    x = randn(64, 64, device=device, scale=2.0)
    g = randn(64, 64, device=device, scale=0.01)
    run_gated_step(m, x, g)
    amax1 = m.fp8_amax.clone()
    assert amax1[0].item() == pytest.approx(x.abs().max().item())
    assert amax1[2].item() == pytest.approx(g.abs().max().item())
    assert torch.all(amax1 > 0)
    out2, grads2 = run_gated_step(m, x, g)
    expect = torch.tensor([448.0, 448.0, 57344.0, 57344.0]) / amax1.cpu()
    assert torch.allclose(m.fp8_scales.cpu(), expect, rtol=1e-6)
    ref = ref_gated_mlp(x, m.gate_up_proj.weight, m.down_proj.weight, g, "swiglu", 1, torch.bfloat16,
                        scales=m.fp8_scales.cpu())
    assert_fp8_close(out2, ref["out"], "out with delayed scales", fp8_tol(device))
    for k, v in grads2.items():
        assert_fp8_close(v, ref[k], f"grad {k} with delayed scales", fp8_tol(device, "e5m2"))
    # LlamaMLP's names plus the scaling state, into a layer built with or without the recipe
    sd = m.state_dict()
    assert {"gate_proj.weight", "up_proj.weight", "down_proj.weight", "fp8_amax_history", "fp8_scales",
            "fp8_amax"} <= set(sd)
    for fresh in (make_gated(device, recipe=recipe), FusedGatedMLP(64, 96, device=device, dtype=torch.bfloat16)):
        fresh.load_state_dict(sd)
        assert torch.equal(fresh.fp8_scales, m.fp8_scales) and torch.equal(fresh.gate_up_proj.weight,
                                                                           m.gate_up_proj.weight)


@pytest.mark.parametrize("device", devices())
def test_gated_first_microbatch_keeps_weight_copies(device):
    m = make_gated(device)
    x = randn(32, 64, device=device)
    a = m(x, is_first_microbatch=True)
    with torch.no_grad():
        m.gate_up_proj.weight.mul_(2)
    assert torch.equal(m(x, is_first_microbatch=False), a)
    assert not torch.equal(m(x), a)


def test_gated_ways_in_and_size_rule():
    torch.manual_seed(0)
    plain = FusedGatedMLP(64, 96, dtype=torch.bfloat16)
    forced = FusedGatedMLP(64, 96, dtype=torch.bfloat16, fp8=Float8Recipe(min_features=0))
    forced.load_state_dict(plain.state_dict())
    x = randn(3, 8, 64)
    ref = forced(x)
    assert ref.shape == (3, 8, 64)
    # the size rule (min_features 2048 by default) keeps the narrow layer in the model's dtype
    narrow = FusedGatedMLP(64, 96, dtype=torch.bfloat16, fp8=True)
    narrow.load_state_dict(plain.state_dict())
    assert torch.equal(narrow(x), plain(x)) and not torch.equal(ref, plain(x))
    with fused_dense.fp8_autocast(recipe=Float8Recipe(min_features=0)):
        assert torch.equal(plain(x), ref)
    model = torch.nn.Sequential(plain)
    fused_dense.convert_to_fp8(model, Float8Recipe(min_features=0))
    assert plain.fp8 == Float8Recipe(min_features=0) and torch.equal(plain(x), ref)
    # torchao's converter swapping the projections: this library's FP8, with a warning
    Float8Linear = type("Float8Linear", (torch.nn.Linear,), {"__module__": "torchao.float8.float8_linear"})
    swapped = FusedGatedMLP(64, 96, dtype=torch.bfloat16)
    swapped.load_state_dict(forced.state_dict())
    for name in ("gate_up_proj", "down_proj"):
        old = getattr(swapped, name)
        new = Float8Linear(old.in_features, old.out_features, bias=False, dtype=torch.bfloat16)
        new.load_state_dict(old.state_dict())
        setattr(swapped, name, new)
    fused_dense.fp8._TORCHAO_WARNED[0] = False
    with pytest.warns(UserWarning, match="torchao's convert_to_float8_training"):
        assert torch.equal(swapped(x), ref)


def test_replace_llama_mlps_with_fp8():
    class LlamaLike(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.gate_proj = torch.nn.Linear(64, 96, bias=False)
            self.up_proj = torch.nn.Linear(64, 96, bias=False)
            self.down_proj = torch.nn.Linear(96, 64, bias=False)
            self.act_fn = torch.nn.SiLU()

    model = torch.nn.Sequential(LlamaLike()).to(torch.bfloat16)
    recipe = Float8Recipe(scaling="delayed", min_features=0)
    assert fused_dense.replace_llama_mlps(model, fp8=recipe) == 1
    assert isinstance(model[0], FusedGatedMLP) and model[0].fp8 == recipe
    x = randn(16, 64).requires_grad_(True)
    model(x).sum().backward()
    assert torch.all(model[0].fp8_amax > 0)
    with pytest.raises(TypeError, match="fp8 must be None, a bool or a fused_dense.Float8Recipe"):
        fused_dense.replace_llama_mlps(model, fp8="e4m3")
    with pytest.raises(ValueError, match="the model itself is an MLP"):
        fused_dense.replace_llama_mlps(LlamaLike())


@pytest.mark.parametrize("scaling", ["current", "delayed"])
def test_gated_compile_fullgraph(scaling):
    recipe = Float8Recipe(scaling=scaling, min_features=0)
    compile_matches_eager(lambda: make_gated("cpu", recipe=recipe), run_gated_step)


@cuda
@fp8_gpu
@pytest.mark.parametrize("scaling", ["current", "delayed"])
def test_gated_cuda_graph_replays_fp8_step(scaling):
    recipe = Float8Recipe(scaling=scaling, min_features=0)
    graph_replay_matches_eager(lambda: make_gated("cuda", recipe=recipe, d=128, h=192), run_gated_step, 128)


def test_delayed_recipe_set_after_build_compiles():
    """A delayed recipe set on built layers (convert_to_fp8, replace_llama_mlps) makes their scaling
    buffers at once, so the first step may be a torch.compile(fullgraph=True) one; set by hand on
    the attribute, the buffers come on the first step, which fullgraph refuses with a message
    naming the fix (and a plain torch.compile runs, that part eagerly)."""
    recipe = Float8Recipe(scaling="delayed", min_features=0)

    def make():
        m = fused_dense.convert_to_fp8(FusedGatedMLP(64, 96, dtype=torch.bfloat16), recipe)
        assert m.fp8_amax_history.shape == (recipe.amax_history_len, 4)
        return m
    compile_matches_eager(make, run_gated_step)
    torch._dynamo.reset()
    lazy = FusedGatedMLP(64, 96, dtype=torch.bfloat16)
    lazy.fp8 = recipe
    with pytest.raises(Exception, match="delayed scaling, whose buffers are made on the layer's first FP8 step"):
        torch.compile(lazy, fullgraph=True)(randn(8, 64))
    torch._dynamo.reset()
    run_gated_step(torch.compile(lazy), randn(8, 64), randn(8, 64))
    assert torch.all(lazy.fp8_amax > 0)
