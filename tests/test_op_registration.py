"""How the ops are registered with PyTorch's dispatcher: every op has CPU and Meta kernels (shapes
without data, for torch.compile and FakeTensor), passes torch.library.opcheck (schema, fake tensor,
autograd registration, AOT dispatch) on CPU and CUDA, and the raw ops, which have no derivative,
refuse inputs that require grad instead of silently dropping them from the graph (the autograd layer
is fused_dense.functional, tested in test_functional.py). fused_mlp has its own C++ derivative.
"""
import pytest
import torch

from op_checks import ACT_CODE, OPS, random_mask, tensor
from conftest import TOL, rel_err
from fused_dense import ops

LA, AD, WG, AF = OPS.linear_act, OPS.act_linear_dgrad, OPS.linear_bias_wgrad, OPS.act_forward


def test_meta_shapes():
    out, mask = LA(tensor(6, 5, device="meta"), tensor(17, 5, device="meta"), None, ACT_CODE["relu"], True, -2)
    assert out.shape == (6, 17) and mask.shape == (6, 3) and mask.dtype == torch.uint8
    out, pre = LA(tensor(6, 5, device="meta", dtype=torch.bfloat16), tensor(17, 5, device="meta", dtype=torch.bfloat16),
                  None, ACT_CODE["sqrelu"], True, -2)
    assert pre.shape == (6, 17) and pre.dtype == torch.bfloat16
    d_in, d_b = AD(tensor(6, 5, device="meta"), tensor(4, 6, device="meta"), random_mask(4, 5).to("meta"), 2, True, 0)
    assert d_in.shape == (4, 5) and d_b.shape == (5,)
    d_in, d_b, act_out = AD(tensor(6, 5, device="meta"), tensor(4, 6, device="meta"), tensor(4, 5, device="meta"),
                            1, True, 0, True)
    assert d_in.shape == act_out.shape == (4, 5) and d_b.shape == (5,)
    d_in, act_out = AD(tensor(6, 5, device="meta"), tensor(4, 6, device="meta"), tensor(4, 5, device="meta"),
                       3, False, 0, True)
    assert d_in.shape == act_out.shape == (4, 5)
    d_w, = WG(tensor(4, 5, device="meta"), tensor(4, 6, device="meta"), False)
    assert d_w.shape == (6, 5)
    assert AF(tensor(2, 3, 4, device="meta"), 1).shape == (2, 3, 4)
    out, gu = OPS.gated_linear(tensor(6, 5, device="meta"), tensor(18, 5, device="meta"), 4, True, -2)
    assert out.shape == (6, 9) and gu.shape == (6, 18)
    d_pre, h = OPS.gated_linear_dgrad(tensor(7, 9, device="meta"), tensor(6, 7, device="meta"),
                                      tensor(6, 18, device="meta"), 5, -1, True)
    assert d_pre.shape == (6, 18) and h.shape == (6, 9)
    assert OPS.gated_act_forward(tensor(4, 18, device="meta"), 4).shape == (4, 9)


def opcheck_cases(device="cpu"):
    f32, bf16 = torch.float32, torch.bfloat16
    r = lambda *s, dtype=f32: tensor(*s, dtype=dtype, device=device)  # noqa: E731
    m = lambda rows, cols: random_mask(rows, cols).to(device)  # noqa: E731
    g = lambda t: t.requires_grad_()  # noqa: E731
    return [
        ("linear_act-gelu-save", OPS.linear_act.default, (r(3, 5), r(7, 5), r(7), 1, True, -2)),
        ("linear_act-relu-mask", OPS.linear_act.default, (r(4, 8), r(13, 8), None, 2, True, -1)),
        ("linear_act-sqrelu-bf16", OPS.linear_act.default, (r(5, 16, dtype=bf16), r(9, 16, dtype=bf16),
                                                           r(9, dtype=bf16), 3, False, 0)),
        ("linear_act-none", OPS.linear_act.default, (r(2, 3), r(4, 3), None, 0, False, -2)),
        ("linear_act-empty-batch", OPS.linear_act.default, (r(0, 6), r(5, 6), r(5), 2, True, -1)),
        ("act_linear_dgrad-gelu", OPS.act_linear_dgrad.default, (r(7, 5), r(3, 7), r(3, 5), 1, True, -2)),
        ("act_linear_dgrad-relu", OPS.act_linear_dgrad.default, (r(6, 11), r(4, 6), m(4, 11), 2, False, -1)),
        ("act_linear_dgrad-none", OPS.act_linear_dgrad.default, (r(6, 11), r(4, 6), None, 0, True, 0)),
        ("act_linear_dgrad-sqrelu-bf16", OPS.act_linear_dgrad.default,
         (r(8, 16, dtype=bf16), r(2, 8, dtype=bf16), r(2, 16, dtype=bf16), 3, True, -1)),
        ("act_linear_dgrad-gelu-act-out", OPS.act_linear_dgrad.default, (r(7, 5), r(3, 7), r(3, 5), 1, True, -2, True)),
        ("act_linear_dgrad-sqrelu-act-out-bf16", OPS.act_linear_dgrad.default,
         (r(8, 16, dtype=bf16), r(2, 8, dtype=bf16), r(2, 16, dtype=bf16), 3, False, -1, True)),
        ("linear_bias_wgrad-bias", OPS.linear_bias_wgrad.default, (r(5, 3), r(5, 4), True)),
        ("linear_bias_wgrad-nobias", OPS.linear_bias_wgrad.default, (r(5, 3), r(5, 4), False)),
        ("linear_bias_wgrad-empty", OPS.linear_bias_wgrad.default, (r(0, 3), r(0, 4), True)),
        ("act_forward-gelu", OPS.act_forward.default, (r(3, 5), 1)),
        ("act_forward-sqrelu-3d", OPS.act_forward.default, (r(2, 3, 4), 3)),
        ("act_forward-relu-bf16", OPS.act_forward.default, (r(9, dtype=bf16), 2)),
        ("act_forward-none-fp16", OPS.act_forward.default, (r(4, 4, dtype=torch.float16), 0)),
        ("act_forward-none-fp32", OPS.act_forward.default, (r(4, 4), 0)),
        ("linear_act_forward-gelu", OPS.linear_act_forward.default, (r(3, 5), r(7, 5), r(7), True, True, 0)),
        ("linear_act_forward-relu", OPS.linear_act_forward.default, (r(3, 5), r(16, 5), None, False, True, -1)),
        ("linear_act_forward-nosave", OPS.linear_act_forward.default, (r(3, 5), r(7, 5), r(7), False, False, 0)),
        ("bias_act_linear_dgrad_bgrad-gelu", OPS.bias_act_linear_dgrad_bgrad.default,
         (r(7, 5), r(3, 7), r(3, 5), True, 0)),
        ("bias_act_linear_dgrad_bgrad-relu", OPS.bias_act_linear_dgrad_bgrad.default,
         (r(7, 9), r(3, 7), m(3, 9), False, -1)),
        # dense and fused_mlp have a C++ derivative: inputs that require grad exercise it
        ("dense-bias", OPS.dense.default, (g(r(3, 5)), g(r(7, 5)), g(r(7)))),
        ("dense-nobias-bf16", OPS.dense.default, (g(r(4, 16, dtype=bf16)), g(r(9, 16, dtype=bf16)), None)),
        ("dense-bias-only-grad", OPS.dense.default, (r(3, 5), r(7, 5), g(r(7)))),
        ("dense-nograd", OPS.dense.default, (r(3, 5), r(7, 5), r(7))),
        ("dense-empty-batch", OPS.dense.default, (g(r(0, 6)), g(r(5, 6)), g(r(5)))),
        ("dense-3d", OPS.dense.default, (g(r(2, 3, 5)), g(r(7, 5)), g(r(7)))),
        ("dense-1d-nobias", OPS.dense.default, (g(r(5)), g(r(4, 5)), None)),
        ("fused_mlp-gelu-lvl0", OPS.fused_mlp.default,
         (g(r(3, 5)), g(r(8, 5)), g(r(8)), g(r(4, 8)), g(r(4)), 1, 0, -2)),
        ("fused_mlp-relu-lvl1-nobias", OPS.fused_mlp.default, (g(r(6, 5)), r(16, 5), None, g(r(3, 16)), None, 2, 1, -1)),
        ("fused_mlp-sqrelu-lvl2-bf16", OPS.fused_mlp.default,
         (r(4, 16, dtype=bf16), g(r(8, 16, dtype=bf16)), g(r(8, dtype=bf16)), r(5, 8, dtype=bf16), None, 3, 2, 0)),
        ("fused_mlp-nograd", OPS.fused_mlp.default, (r(3, 5), r(8, 5), r(8), r(4, 8), r(4), 1, 0, -2)),
        ("fused_mlp-swiglu-lvl0", OPS.fused_mlp.default, (g(r(3, 5)), g(r(18, 5)), None, g(r(4, 9)), g(r(4)), 4, 0, -2)),
        ("fused_mlp-geglu-lvl1-bf16", OPS.fused_mlp.default,
         (g(r(4, 16, dtype=bf16)), g(r(32, 16, dtype=bf16)), None, g(r(5, 16, dtype=bf16)), None, 5, 1, -1)),
        ("fused_mlp-swiglu-lvl2", OPS.fused_mlp.default, (g(r(6, 5)), r(10, 5), None, g(r(3, 5)), None, 4, 2, 0)),
        ("gated_linear-swiglu-save", OPS.gated_linear.default, (r(3, 5), r(18, 5), 4, True, -2)),
        ("gated_linear-geglu-bf16", OPS.gated_linear.default, (r(4, 16, dtype=bf16), r(32, 16, dtype=bf16), 5, False, -1)),
        ("gated_linear-empty-batch", OPS.gated_linear.default, (r(0, 6), r(10, 6), 4, True, 0)),
        ("gated_linear_dgrad-swiglu", OPS.gated_linear_dgrad.default, (r(7, 9), r(3, 7), r(3, 18), 4, -2)),
        ("gated_linear_dgrad-geglu-act-out-bf16", OPS.gated_linear_dgrad.default,
         (r(8, 16, dtype=bf16), r(2, 8, dtype=bf16), r(2, 32, dtype=bf16), 5, -1, True)),
        ("gated_linear_dgrad_-swiglu", OPS.gated_linear_dgrad_.default, (r(3, 18), r(7, 9), r(3, 7), 4, -2)),
        ("gated_linear_dgrad_-geglu-bf16", OPS.gated_linear_dgrad_.default,
         (r(2, 32, dtype=bf16), r(8, 16, dtype=bf16), r(2, 8, dtype=bf16), 5, -1)),
        ("gated_act_forward-swiglu", OPS.gated_act_forward.default, (r(3, 26), 4)),
        ("gated_act_forward-geglu-fp16", OPS.gated_act_forward.default, (r(5, 16, dtype=torch.float16), 5)),
    ]


OPCHECK_IDS = [c[0] for c in opcheck_cases("meta")]


@pytest.mark.parametrize("index", list(range(len(OPCHECK_IDS))), ids=OPCHECK_IDS)
def test_cpu_opcheck(index):
    _, op, args = opcheck_cases("cpu")[index]
    torch.library.opcheck(op, args)


@pytest.mark.cuda
@pytest.mark.parametrize("index", list(range(len(OPCHECK_IDS))), ids=OPCHECK_IDS)
def test_cuda_opcheck(index, deterministic_tuning):
    """In deterministic mode: opcheck compares calls bit for bit, and heuristic='auto' (-2) may
    otherwise replace a provisional choice with a measured one between them."""
    _, op, args = opcheck_cases("cuda")[index]
    torch.library.opcheck(op, args)


def test_every_op_has_opcheck_and_kernels():
    names = {c[1]._schema.name.split("::")[1] for c in opcheck_cases("meta")}
    expected = {"linear_act", "act_linear_dgrad", "linear_bias_wgrad", "act_forward", "linear_act_forward",
                "bias_act_linear_dgrad_bgrad", "dense", "fused_mlp", "gated_linear", "gated_linear_dgrad",
                "gated_linear_dgrad_", "gated_act_forward"}
    assert names == expected
    for name in ["dense", "fused_mlp"]:
        for key in ["CompositeExplicitAutograd", "Autograd"]:
            assert torch._C._dispatch_has_kernel_for_dispatch_key(f"fused_dense::{name}", key), (name, key)
    for name in ["linear_act", "act_linear_dgrad", "linear_bias_wgrad", "act_forward", "gated_linear",
                 "gated_linear_dgrad", "gated_linear_dgrad_", "gated_act_forward"]:
        for key in ["CPU", "Meta"]:
            assert torch._C._dispatch_has_kernel_for_dispatch_key(f"fused_dense::{name}", key), (name, key)


@pytest.mark.parametrize("which", ["input", "weight", "bias"])
def test_cpu_raw_op_refuses_requires_grad(which):
    x, w, b = torch.randn(3, 5), torch.randn(7, 5), torch.randn(7)
    dict(input=x, weight=w, bias=b)[which].requires_grad_()
    with pytest.raises(RuntimeError, match=rf"argument '{which}' requires grad.*no derivative"):
        OPS.linear_act(x, w, b, 1, True, -2)
    with pytest.raises(RuntimeError, match="requires grad"):
        OPS.linear_act_forward(x, w, b, True, True, 0)
    with torch.no_grad():  # below autograd the op runs as usual
        out = OPS.linear_act(x, w, b, 1, True, -2)[0]
    ref = torch.nn.functional.gelu(torch.nn.functional.linear(x.detach().double(), w.detach().double(),
                                                             b.detach().double()), approximate="tanh")
    assert rel_err(out, ref) <= TOL[torch.float32]


def test_cpu_raw_backward_ops_refuse_requires_grad():
    x, g, w = torch.randn(4, 6), torch.randn(4, 3, requires_grad=True), torch.randn(3, 6)
    with pytest.raises(RuntimeError, match="argument 'd_output' requires grad"):
        OPS.linear_bias_wgrad(x, g, True)
    with pytest.raises(RuntimeError, match="argument 'd_output' requires grad"):
        OPS.act_linear_dgrad(w, g, None, 0, False, -1)
    with pytest.raises(RuntimeError, match="argument 'pre_act' requires grad"):
        OPS.act_forward(torch.randn(2, 3, requires_grad=True), 1)


def _namespace_ops():
    """Every op of the fused_dense namespace, with whether its schema takes a tensor."""
    ops = {}
    for qualified in torch._C._dispatch_get_all_op_names():
        if qualified.startswith("fused_dense::"):
            name = qualified.split("::")[1].split(".")[0]
            schema = getattr(torch.ops.fused_dense, name).default._schema
            ops[name] = any("Tensor" in str(a.type) for a in schema.arguments)
    return ops


def autograd_unguarded(ops):
    """The ops among `ops` that take tensors and have neither an Autograd kernel (the guard of the
    raw ops, or a C++ derivative) nor a CompositeImplicitAutograd one (a composite of guarded ops)."""
    has = torch._C._dispatch_has_kernel_for_dispatch_key
    return sorted(name for name, takes_tensors in ops.items() if takes_tensors
                  and not has(f"fused_dense::{name}", "Autograd")
                  and not has(f"fused_dense::{name}", "CompositeImplicitAutograd"))


def test_every_op_that_takes_tensors_has_an_autograd_kernel():
    ops = _namespace_ops()
    assert {"linear_act", "gated_linear", "fp8_quantize", "fp8_linear_act", "fused_mlp_fp8"} <= set(ops)
    assert autograd_unguarded(ops) == []


def test_unguarded_check_sees_a_missing_guard():
    """An op defined without its guard (here a plain m.def from Python) is reported."""
    lib = torch.library.Library("fused_dense", "FRAGMENT")
    lib.define("unguarded_probe(Tensor x) -> Tensor")
    lib.impl("unguarded_probe", lambda x: x.clone(), "CPU")
    assert autograd_unguarded({"unguarded_probe": True, "linear_act": True}) == ["unguarded_probe"]
    lib._destroy()


@pytest.mark.parametrize("op", ["gated_linear", "fp8_quantize", "fp8_linear"])
def test_cpu_guard_refuses_requires_grad_on_gated_and_fp8_ops(op):
    x = torch.randn(4, 32, requires_grad=True)
    call = {"gated_linear": lambda: OPS.gated_linear(x, torch.randn(16, 32), 4, False, -2),
            "fp8_quantize": lambda: torch.ops.fused_dense.fp8_quantize(x, None, 0, False, 0, None, True, False, False),
            "fp8_linear": lambda: torch.ops.fused_dense.fp8_linear(
                x.detach().to(torch.float8_e4m3fn), torch.randn(16, 32).to(torch.float8_e4m3fn),
                torch.ones((), requires_grad=True), torch.ones(()), None, torch.float32, False, -2)}[op]
    with pytest.raises(RuntimeError, match="requires grad.*no derivative"):
        call()


def test_fp8_format_max_is_the_formats_largest_finite_value():
    """Published for Python (fused_dense.fp8): each format's largest finite value, as torch's own
    float8 dtypes define it."""
    assert torch.ops.fused_dense.fp8_format_max(0) == torch.finfo(torch.float8_e4m3fn).max
    assert torch.ops.fused_dense.fp8_format_max(1) == torch.finfo(torch.float8_e5m2).max
    with pytest.raises(ValueError, match="fp8_format must be 0 .* got 2"):
        torch.ops.fused_dense.fp8_format_max(2)


def test_fp8_formats_are_published_in_code_order():
    """fused_dense.ops reads the FP8 format names and maxima from the library, never restates them:
    code 0 is e4m3 (float8_e4m3fn), code 1 e5m2."""
    assert torch.ops.fused_dense.fp8_formats() == ["e4m3", "e5m2"]
    assert ops.FP8_FORMATS == {"e4m3": 0, "e5m2": 1}
    assert ops.FP8_FORMAT_MAX == {"e4m3": torch.finfo(torch.float8_e4m3fn).max,
                                  "e5m2": torch.finfo(torch.float8_e5m2).max}
