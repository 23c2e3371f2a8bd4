"""The MLP's one autograd: the C++ checkpoint plan (csrc/torch/mlp.h), the op
fused_dense::fused_mlp with its C++ derivative, and FusedMLPFunc, which adds only tensor-parallel
communication around the same C++ halves (fused_mlp_train_forward / fused_mlp_backward). Rules
under test: docs/contract.md, "Checkpoint levels". These tests compare the two entries with each other;
tests/test_mlp_reference.py compares every checkpoint path of both with float64 references."""
import itertools

import pytest
import torch

from conftest import OpLog, saved_bytes, saved_tensors
from fused_dense import FusedDense, FusedMLP, ops
from fused_dense.functional import FusedMLPFunc, fused_mlp_func

NATIVE = torch.ops.fused_dense.fused_mlp.default
ACT = {"gelu_approx": 1, "relu": 2, "sqrelu": 3}


def _expected_plan(activation, lvl, need):
    """The checkpoint rules of docs/contract.md, written out independently of the C++ plan."""
    need_x, need_w1, need_b1, need_w2, _ = need
    need_d_pre = need_x or need_w1 or need_b1
    outputs_kept = lvl == 0 or (lvl == 1 and activation == "relu")
    if lvl == 2:
        keep_pre = False
    elif outputs_kept:
        keep_pre = need_d_pre
    else:
        keep_pre = need_d_pre or need_w2
    recompute = lvl == 2 and (need_d_pre or need_w2)
    return dict(keep_pre=keep_pre, keep_act_out=outputs_kept and need_w2, recompute_fc1=recompute,
                save_x=need_w1 or recompute, save_weight1=need_x or recompute, save_bias1=recompute,
                save_weight2=need_d_pre)


@pytest.mark.parametrize("activation", list(ACT))
@pytest.mark.parametrize("lvl", [0, 1, 2])
def test_plan_follows_the_checkpoint_rules(activation, lvl):
    for need in itertools.product([False, True], repeat=5):
        assert ops.mlp_plan(ACT[activation], lvl, need) == _expected_plan(activation, lvl, need), need


def test_plan_errors_name_the_argument():
    with pytest.raises(ValueError, match=r"activation must be 1 \(gelu_approx\), 2 \(relu\), 3 \(sqrelu\), 4 "
                                         r"\(swiglu\) or 5 \(geglu\), got 0"):
        ops.mlp_plan(0, 0, [True] * 5)
    with pytest.raises(ValueError, match="checkpoint_lvl must be 0, 1 or 2, got 3"):
        ops.mlp_plan(1, 3, [True] * 5)
    with pytest.raises(ValueError, match="needs_input_grad must hold 5 flags"):
        ops.mlp_plan(1, 0, [True] * 4)


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
    """The C++ Function and FusedMLPFunc run the same C++ halves: bit-identical outputs and
    gradients, and the same saved bytes."""
    ts = _inputs(device, dtype, grads, bias1, bias2)
    code = ops.heuristic_code(heuristic)
    out, native_bytes = saved_bytes(lambda: NATIVE(*ts[:5], ACT[activation], lvl, code))
    ref, function_bytes = saved_bytes(
        lambda: FusedMLPFunc.apply(*ts, activation, True, False, lvl, heuristic, None, True))
    assert torch.equal(out, ref)
    wants = [x for x in ts if x is not None and x.requires_grad]
    if not wants:
        assert out.grad_fn is None
        return
    assert "FusedMLPFunction" in out.grad_fn.name()
    assert native_bytes == function_bytes
    dy = torch.randn_like(out)
    got = torch.autograd.grad(out, wants, dy)
    exp = torch.autograd.grad(ref, wants, dy)
    for a, b in zip(got, exp):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("activation", list(ACT))
@pytest.mark.parametrize("lvl", [0, 1, 2])
def test_function_and_op_share_the_halves_cpu(dtype, activation, lvl):
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
def test_function_and_op_share_the_halves_cuda(dtype, activation, lvl, heuristic):
    torch.manual_seed(0)
    for grads in [(True,) * 5, (False, True, True, True, True), (True, False, False, True, False),
                  (False, False, False, False, True), (True, True, True, False, False)]:
        _compare("cuda", dtype, activation, lvl, grads, heuristic=heuristic)
    _compare("cuda", dtype, activation, lvl, [True] * 5, bias1=False, bias2=False, heuristic=heuristic)


def _gated_or_plain_inputs(activation, device, batch=37, d_in=24, hidden=64, d_out=16):
    """x, weight1 (packed [2h, d] for a gated activation, which takes no bias1), bias1, weight2,
    bias2, all requiring grad; bf16 on CUDA, float32 on the CPU."""
    gated = activation in ("swiglu", "geglu")
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    ts = [torch.randn(batch, d_in), torch.randn(2 * hidden if gated else hidden, d_in) * d_in ** -0.5,
          None if gated else torch.randn(hidden), torch.randn(d_out, hidden) * hidden ** -0.5, torch.randn(d_out)]
    return [t.to(device, dtype).requires_grad_() if t is not None else None for t in ts]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("activation", ["gelu_approx", "relu", "swiglu"])
@pytest.mark.parametrize("lvl", [0, 1, 2])
def test_backward_frees_its_saved_intermediates_unless_the_graph_is_kept(device, activation, lvl):
    """The C++ node empties the storages of its saved pre-activation and activation output once
    their last reader has run, where the graph task keeps no graph (the memory torch.compile's
    backward frees likewise); with retain_graph=True it keeps them, and the next backward gives
    the same bits. The inputs (x, weights, biases) are never freed; freeing changes no bit."""
    torch.manual_seed(0)
    code = {**ACT, "swiglu": 4, "geglu": 5}[activation]
    ts = _gated_or_plain_inputs(activation, device)
    inputs = [t for t in ts if t is not None]
    def step():
        # a fixed algorithm: the three backwards compare bits
        out, saved = saved_tensors(lambda: NATIVE(*ts, code, lvl, 0))
        input_ptrs = {t.untyped_storage().data_ptr() for t in inputs}
        own = [t for t in saved if t.untyped_storage().data_ptr() not in input_ptrs]
        return out, own

    dy = torch.randn(inputs[0].shape[0], ts[3].shape[0]).to(device, inputs[0].dtype)
    out, own = step()
    assert len(own) == {0: 2, 1: 2 if activation == "relu" else 1, 2: 0}[lvl]
    kept = torch.autograd.grad(out, inputs, dy, retain_graph=True)
    assert all(t.untyped_storage().nbytes() > 0 for t in own)
    again = torch.autograd.grad(out, inputs, dy)
    assert all(t.untyped_storage().nbytes() == 0 for t in own)
    assert all(t.untyped_storage().nbytes() > 0 for t in inputs)
    out, own = step()
    freed = torch.autograd.grad(out, inputs, dy)
    assert all(t.untyped_storage().nbytes() == 0 for t in own)
    for a, b, c in zip(kept, again, freed):
        assert torch.equal(a, b) and torch.equal(a, c)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("activation", ["swiglu", "geglu"])
@pytest.mark.parametrize("lvl", [0, 1, 2])
def test_gated_backward_writes_d_gu_over_gu_where_nothing_reads_gu_after(device, activation, lvl):
    """Level 0 without retain_graph, and level 2 (gu recomputed) always: the gating backward writes
    its gradient over gu (gated_linear_dgrad_), so the step never holds both; level 1 (gu read
    again to rebuild the activation) and a kept graph: out of place. Same bits either way."""
    torch.manual_seed(0)
    ts = _gated_or_plain_inputs(activation, device)
    inputs = [t for t in ts if t is not None]
    code = {"swiglu": 4, "geglu": 5}[activation]
    dy = torch.randn(inputs[0].shape[0], ts[3].shape[0]).to(device, inputs[0].dtype)
    runs = {}
    for retain in (True, False):
        out = NATIVE(*ts, code, lvl, 0)
        with OpLog() as log:
            runs[retain] = torch.autograd.grad(out, inputs, dy, retain_graph=retain)
        in_place = "gated_linear_dgrad_" in log.names
        assert in_place == (lvl == 2 or (lvl == 0 and not retain)), (retain, log.names)
        assert in_place != ("gated_linear_dgrad" in log.names), log.names
    for a, b in zip(runs[True], runs[False]):
        assert torch.equal(a, b)


def test_gated_dgrad_in_place_refuses_an_operand_as_pre_act():
    w, g = torch.randn(8, 4), torch.randn(3, 8)  # out_features 8 = 2 * hidden: g has pre_act's shape
    with pytest.raises(ValueError, match="pre_act is overwritten with the gradient, so it must be neither d_output"):
        torch.ops.fused_dense.gated_linear_dgrad_(g, w, g, 4, -2)
    gu = torch.randn(3, 8)
    before = gu.clone()
    with pytest.raises(ValueError, match=r"pre_act must have shape \[3, 8\]"):
        torch.ops.fused_dense.gated_linear_dgrad_(gu[:, :6].contiguous(), w, g, 4, -2)
    assert torch.equal(gu, before)


def _path(out):
    """Which Function made out: the graph is searched a few nodes deep (casts and reshapes come
    first)."""
    todo, seen = [out.grad_fn], 0
    while todo and seen < 12:
        fn = todo.pop()
        if fn is None:
            continue
        seen += 1
        if "FusedMLPFunction" in fn.name():
            return "native"
        if "FusedMLPFuncBackward" in fn.name():
            return "function"
        todo += [f for f, _ in fn.next_functions]
    return "other"


def test_every_single_process_path_runs_the_cpp_autograd():
    torch.manual_seed(0)
    m = FusedMLP(8, 32, 4)
    x = torch.randn(2, 3, 8, requires_grad=True)
    assert _path(m(x)) == "native"
    assert m(x).shape == (2, 3, 4)
    out, res = FusedMLP(8, 32, 4, return_residual=True)(x)
    assert _path(out) == "native" and res is x
    assert _path(m(x.transpose(0, 1))) == "native"  # made row-major before the op
    with torch.autocast("cpu", dtype=torch.bfloat16):  # cast before the op
        out = m(x)
    assert _path(out) == "native" and out.dtype == torch.bfloat16
    assert _path(m.double()(x.double())) == "native"


def test_unserved_devices_run_plain_pytorch(monkeypatch):
    """Tensors the ops do not serve (forced here by hiding the CPU kernels) run plain PyTorch
    operators in fused_mlp_func, and FusedMLPFunc, which runs on the ops only, says so."""
    from fused_dense import _common
    monkeypatch.setattr(_common, "OP_DEVICES", ())
    torch.manual_seed(0)
    x, w1, b1, w2, b2 = _inputs("cpu", torch.float64, [True] * 5)
    out = fused_mlp_func(x, w1, w2, b1, b2, activation="sqrelu")
    assert _path(out) == "other"
    ref = torch.relu(x @ w1.T + b1).square() @ w2.T + b2
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    with pytest.raises(TypeError, match="FusedMLPFunc: the fused_dense ops serve tensors of one dtype"):
        FusedMLPFunc.apply(x, w1, b1, w2, b2, "relu")


def test_autocast_gradients_reach_the_float32_leaves():
    torch.manual_seed(0)
    m = FusedMLP(8, 32, 8)
    x = torch.randn(5, 8, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = m(x)
    out.float().square().sum().backward()
    for t in (x, m.fc1.weight, m.fc1.bias, m.fc2.weight, m.fc2.bias):
        assert t.grad is not None and t.grad.dtype == torch.float32 and t.grad.abs().sum() > 0


def test_return_residual_gradient_sums():
    torch.manual_seed(0)
    m = FusedMLP(8, 32, 8, return_residual=True).double()
    x = torch.randn(5, 8, dtype=torch.float64, requires_grad=True)
    out, res = m(x)
    assert res is x
    (out.sum() + (res * 3).sum()).backward()
    x2 = x.detach().clone().requires_grad_()
    out2, res2 = FusedMLPFunc.apply(x2, m.fc1.weight, m.fc1.bias, m.fc2.weight, m.fc2.bias, "gelu_approx",
                                    True, True, 0, "auto")
    (out2.sum() + (res2 * 3).sum()).backward()
    torch.testing.assert_close(x.grad, x2.grad, rtol=0, atol=0)


def test_eval_and_no_grad_save_nothing():
    m = FusedMLP(8, 32, 4).eval()
    x = torch.randn(3, 8, requires_grad=True)
    with torch.no_grad():
        assert m(x).grad_fn is None
    out, saved = saved_bytes(lambda: m(x))  # eval: save_pre_act=False behaves as level 2
    assert saved == x.numel() * x.element_size() + sum(p.numel() * p.element_size() for p in
                                                       (m.fc1.weight, m.fc1.bias, m.fc2.weight))
    out.sum().backward()
    assert x.grad is not None and m.fc1.weight.grad is not None


def test_op_errors_name_the_argument():
    x, w1, w2 = torch.randn(5, 8), torch.randn(16, 8), torch.randn(4, 16)
    with pytest.raises(ValueError, match="activation must be 1"):
        NATIVE(x, w1, None, w2, None, 0, 0, -2)
    with pytest.raises(ValueError, match="checkpoint_lvl must be 0, 1 or 2, got 3"):
        NATIVE(x, w1, None, w2, None, 1, 3, -2)
    with pytest.raises(ValueError, match=r"weight1.size\(1\) must equal x.size\(1\) = 8"):
        NATIVE(x, torch.randn(16, 9), None, w2, None, 1, 0, -2)
    with pytest.raises(ValueError, match=r"weight2.size\(1\) must equal weight1.size\(0\) = 16"):
        NATIVE(x, w1, None, torch.randn(4, 15), None, 1, 0, -2)
    with pytest.raises(ValueError, match="x must be 2-D"):
        NATIVE(x[None], w1, None, w2, None, 1, 0, -2)
    with pytest.raises(ValueError, match="bias"):
        NATIVE(x, w1, torch.randn(15), w2, None, 1, 0, -2)


def test_backward_half_checks_what_it_is_given():
    x, w1, w2 = torch.randn(5, 8), torch.randn(16, 8), torch.randn(4, 16)
    g = torch.randn(5, 4)
    bwd = torch.ops.fused_dense.fused_mlp_backward
    with pytest.raises(ValueError, match="saved must hold the 1 tensor"):
        bwd(g, None, w1, None, w2, [], 1, 1, -2, [True, True, False, True, False])
    with pytest.raises(ValueError, match="x is required by this plan"):
        bwd(g, None, w1, None, w2, [], 1, 2, -2, [True, True, False, True, False])
    with pytest.raises(ValueError, match="weight2 is required by this plan"):
        bwd(g, x, w1, None, None, [], 1, 2, -2, [True, True, False, True, False])


def test_python_argument_checks_use_the_library_codes():
    assert ops.MLP_ACTIVATIONS == ("gelu_approx", "relu", "sqrelu")
    assert ops.CHECKPOINT_LEVELS == (0, 1, 2)
    assert ops.ACTIVATIONS["none"] == 0 and ops.HEURISTIC_AUTO == -2 and ops.HEURISTIC_UNFUSED == -1
    assert [ops.relu_mask_row_bytes(c) for c in (1, 8, 9, 128)] == [1, 1, 2, 16]
    assert ops.FP8_ROW_PAD == 16  # cuBLASLt's FP8 operands: K and leading dimensions multiples of 16
    for bad in ("none", "gelu", None):
        with pytest.raises(ValueError, match="activation must be one of"):
            FusedMLP(8, 16, activation=bad)
    for bad in (3, -1, True, 1.0):
        with pytest.raises(ValueError, match="checkpoint_lvl must be 0, 1 or 2"):
            FusedMLP(8, 16, checkpoint_lvl=bad)


def test_double_backward_is_a_clear_error():
    m = FusedMLP(8, 16, 4).double()
    x = torch.randn(3, 8, dtype=torch.float64, requires_grad=True)
    with pytest.raises(RuntimeError, match="double backward"):
        torch.autograd.grad(m(x).sum(), x, create_graph=True)


# FusedMLPFunc.apply itself reshapes inside the Function (flash-attn's contract), so its outputs
# take in-place ops for 2-D inputs only; the modules and fused_mlp_func reshape outside.
@pytest.mark.parametrize("shape,path", [(s, p) for s in [(5, 8), (2, 3, 8)] for p in ["op", "function", "autocast"]
                                        if not (p == "function" and len(s) != 2)])
@pytest.mark.parametrize("kind", ["mlp", "mlp-residual", "dense", "dense-residual"])
def test_outputs_take_inplace_ops(shape, path, kind):
    """Outputs are ordinary tensors, not views made inside an autograd Function: in-place ops on
    them work as on nn.Linear's output, and the gradients are those of the same ops done out of
    place. The residual is x itself (the cast x under autocast, as in flash-attn)."""
    torch.manual_seed(0)
    residual = kind.endswith("residual")
    mod = (FusedMLP(8, 16, 8, return_residual=residual) if kind.startswith("mlp")
           else FusedDense(8, 8, return_residual=residual))
    # float64 is never autocast: the autocast case runs float32 weights and input in bf16
    mod = mod.float() if path == "autocast" else mod.double()
    x = torch.randn(*shape, dtype=torch.float32 if path == "autocast" else torch.float64)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=path == "autocast")

    def call(xg):
        if path == "function" and kind.startswith("mlp"):
            return FusedMLPFunc.apply(xg, mod.fc1.weight, mod.fc1.bias, mod.fc2.weight, mod.fc2.bias,
                                      "gelu_approx", True, residual, 0, "auto")
        return mod(xg)

    def run(inplace):
        xg = x.clone().requires_grad_()
        with autocast:
            res = call(xg)
        out, res_x = res if residual else (res, None)
        if res_x is not None and path != "function":
            # the residual is x itself, or under autocast the cast input
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
    torch.testing.assert_close(out_i, out_o, rtol=0, atol=0)
    for a, b in zip(g_i, g_o):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
