"""fused_dense::fused_mlp, the MLP with its derivative in C++ (csrc/torch/mlp_autograd.cpp), must
compute exactly what the Python FusedMLPFunc computes -- the same ops in the same order, so the
results are bit-identical -- for every activation, checkpoint level and set of inputs that need
a gradient; and fused_mlp_func must take it exactly when it applies."""
import itertools

import pytest
import torch

import fused_dense
from fused_dense import FusedMLP, functional
from fused_dense.functional import FusedMLPFunc, fused_mlp_func

NATIVE = torch.ops.fused_dense.fused_mlp.default
ACT = {"gelu_approx": 1, "relu": 2, "sqrelu": 3}


def _inputs(device, dtype, grads, bias1=True, bias2=True, batch=37, d_in=24, hidden=64, d_out=16):
    def t(*shape, scale=1.0):
        return torch.randn(*shape, device=device, dtype=torch.float32).mul(scale).to(dtype)
    ts = [t(batch, d_in), t(hidden, d_in, scale=d_in ** -0.5), t(hidden) if bias1 else None,
          t(d_out, hidden, scale=hidden ** -0.5), t(d_out) if bias2 else None]
    for x, g in zip(ts, grads):
        if x is not None and g:
            x.requires_grad_()
    return ts


def _compare(device, dtype, activation, lvl, grads, bias1=True, bias2=True, heuristic="auto"):
    ts = _inputs(device, dtype, grads, bias1, bias2)
    code = functional.ops.heuristic_code(heuristic)
    out = NATIVE(*ts[:5], ACT[activation], lvl, code)
    ref = FusedMLPFunc.apply(*ts, activation, True, False, lvl, heuristic, None, True)
    assert torch.equal(out, ref)
    wants = [x for x in ts if x is not None and x.requires_grad]
    if not wants:
        assert out.grad_fn is None
        return
    assert "FusedMLPFunction" in out.grad_fn.name()
    dy = torch.randn_like(out)
    got = torch.autograd.grad(out, wants, dy)
    exp = torch.autograd.grad(ref, wants, dy)
    for a, b in zip(got, exp):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("activation", list(ACT))
@pytest.mark.parametrize("lvl", [0, 1, 2])
def test_native_matches_python_function_cpu(dtype, activation, lvl):
    torch.manual_seed(0)
    for grads in itertools.product([False, True], repeat=5):
        _compare("cpu", dtype, activation, lvl, grads)
    _compare("cpu", dtype, activation, lvl, [True] * 5, bias1=False)
    _compare("cpu", dtype, activation, lvl, [True, False, True, True, True], bias2=False)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("activation", list(ACT))
@pytest.mark.parametrize("lvl", [0, 1, 2])
@pytest.mark.parametrize("heuristic", ["auto", -1, 0])
def test_native_matches_python_function_cuda(dtype, activation, lvl, heuristic):
    torch.manual_seed(0)
    for grads in [(True,) * 5, (False, True, True, True, True), (True, False, False, True, False),
                  (False, False, False, False, True), (True, True, True, False, False)]:
        _compare("cuda", dtype, activation, lvl, grads, heuristic=heuristic)
    _compare("cuda", dtype, activation, lvl, [True] * 5, bias1=False, bias2=False, heuristic=heuristic)


def _path(out):
    """Which Function made out: the graph is searched a few nodes deep (reshapes come first)."""
    todo, seen = [out.grad_fn], 0
    while todo and seen < 8:
        fn = todo.pop()
        if fn is None:
            continue
        seen += 1
        if "FusedMLPFunction" in fn.name():
            return "native"
        if "FusedMLPFuncBackward" in fn.name():
            return "python"
        todo += [f for f, _ in fn.next_functions]
    return "other"


def test_fused_mlp_func_routing():
    torch.manual_seed(0)
    m = FusedMLP(8, 32, 4)
    x = torch.randn(2, 3, 8, requires_grad=True)
    assert _path(m(x)) == "native"
    assert m(x).shape == (2, 3, 4)
    out, res = FusedMLP(8, 32, 4, return_residual=True)(x)
    assert _path(out) == "native" and res is x
    # non-contiguous input: FusedMLPFunc makes it row-major
    assert _path(m(x.transpose(0, 1))) == "python"
    # autocast casts the inputs: FusedMLPFunc's job
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = m(x)
    assert _path(out) == "python" and out.dtype == torch.bfloat16
    # float64 is an op dtype too
    assert _path(m.double()(x.double())) == "native"


def test_return_residual_gradient_sums_both_paths():
    torch.manual_seed(0)
    m = FusedMLP(8, 32, 8, return_residual=True).double()
    x = torch.randn(5, 8, dtype=torch.float64, requires_grad=True)
    out, res = m(x)
    (out.sum() + (res * 3).sum()).backward()
    x2 = x.detach().clone().requires_grad_()
    functional_native, functional._NATIVE_MLP = functional._NATIVE_MLP, None
    try:
        out2, res2 = m(x2)
    finally:
        functional._NATIVE_MLP = functional_native
    assert _path(out2) == "python"
    (out2.sum() + (res2 * 3).sum()).backward()
    torch.testing.assert_close(x.grad, x2.grad, rtol=0, atol=0)


def test_eval_and_no_grad_save_nothing():
    m = FusedMLP(8, 32, 4).eval()
    x = torch.randn(3, 8, requires_grad=True)
    with torch.no_grad():
        assert m(x).grad_fn is None
    out = m(x)  # eval: save_pre_act=False behaves as level 2 (only x kept), backward still works
    out.sum().backward()
    assert x.grad is not None and m.fc1.weight.grad is not None


def test_native_errors_name_the_argument():
    x, w1, w2 = torch.randn(5, 8), torch.randn(16, 8), torch.randn(4, 16)
    with pytest.raises(ValueError, match="activation must be 1"):
        NATIVE(x, w1, None, w2, None, 0, 0, -2)
    with pytest.raises(ValueError, match="checkpoint_lvl must be 0, 1 or 2, got 3"):
        NATIVE(x, w1, None, w2, None, 1, 3, -2)
    with pytest.raises(RuntimeError, match=r"weight1.size\(1\) must equal x.size\(1\) = 8"):
        NATIVE(x, torch.randn(16, 9), None, w2, None, 1, 0, -2)
    with pytest.raises(RuntimeError, match=r"weight2.size\(1\) must equal weight1.size\(0\) = 16"):
        NATIVE(x, w1, None, torch.randn(4, 15), None, 1, 0, -2)
    with pytest.raises(RuntimeError, match="x must be 2-D"):
        NATIVE(x[None], w1, None, w2, None, 1, 0, -2)
    with pytest.raises(RuntimeError, match="bias"):
        NATIVE(x, w1, torch.randn(15), w2, None, 1, 0, -2)
    assert fused_dense.has_cuda_kernels() in (True, False)


def test_double_backward_is_a_clear_error():
    m = FusedMLP(8, 16, 4).double()
    x = torch.randn(3, 8, dtype=torch.float64, requires_grad=True)
    with pytest.raises(RuntimeError, match="double backward"):
        torch.autograd.grad(m(x).sum(), x, create_graph=True)


@pytest.mark.parametrize("shape", [(5, 8), (2, 3, 8)])
@pytest.mark.parametrize("path", ["native", "python", "autocast"])
@pytest.mark.parametrize("kind", ["mlp", "mlp-residual", "dense", "dense-residual"])
def test_outputs_take_inplace_ops(shape, path, kind):
    """Outputs are ordinary tensors, not views made inside an autograd Function: in-place ops on
    them work as on nn.Linear's output, and the gradients are those of the same ops done out of
    place. The residual is x itself (the cast x under autocast, as in flash-attn)."""
    from fused_dense import FusedDense
    torch.manual_seed(0)
    residual = kind.endswith("residual")
    mod = (FusedMLP(8, 16, 8, return_residual=residual) if kind.startswith("mlp")
           else FusedDense(8, 8, return_residual=residual))
    # float64 is never autocast: the autocast case runs float32 weights and input in bf16
    mod = mod.float() if path == "autocast" else mod.double()
    x = torch.randn(*shape, dtype=torch.float32 if path == "autocast" else torch.float64)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=path == "autocast")
    saved = functional._NATIVE_MLP
    if path == "python":
        functional._NATIVE_MLP = None
    try:
        def run(inplace):
            xg = x.clone().requires_grad_()
            with autocast:
                res = mod(xg)
            out, res_x = res if residual else (res, None)
            if res_x is not None:
                # the residual is x itself, or under autocast the cast input (which the layer also
                # saves for backward, so it is not one to modify in place: autograd would refuse)
                assert (res_x is xg) == (path != "autocast")
            if inplace:
                out.mul_(2).add_(1)
            else:
                out = out * 2 + 1
            loss = out.square().sum() + (0 if res_x is None else (3 * res_x).sum())
            grads = torch.autograd.grad(loss, [xg] + list(mod.parameters()))
            return out.detach(), grads
        out_i, g_i = run(True)
        out_o, g_o = run(False)
    finally:
        functional._NATIVE_MLP = saved
    torch.testing.assert_close(out_i, out_o, rtol=0, atol=0)
    for a, b in zip(g_i, g_o):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
