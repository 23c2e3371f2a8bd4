"""Tests of fused_dense.modules: FusedDense / FusedMLP against nn.Linear-based modules.

References run in float64 from the same parameters; errors are relative, within conftest.TOL.
Inputs are random normals from each test's own fixed seed (conftest's _seeded names it on failure).
"""
import copy
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fused_dense import FusedDense, FusedMLP

from conftest import assert_close_rel, needs_caching_allocator

ACTIVATIONS = ["gelu_approx", "relu", "sqrelu"]


class PlainMLP(nn.Module):
    """The unfused model FusedMLP's state_dict must load into and from."""

    def __init__(self, in_features, hidden_features, out_features, bias1=True, bias2=True,
                 activation="gelu_approx", device=None, dtype=None):
        super().__init__()
        self.fc1 = nn.Linear(in_features, hidden_features, bias=bias1, device=device, dtype=dtype)
        self.fc2 = nn.Linear(hidden_features, out_features, bias=bias2, device=device, dtype=dtype)
        self.activation = activation

    def forward(self, x):
        h = self.fc1(x)
        if self.activation == "gelu_approx":
            h = F.gelu(h, approximate="tanh")
        elif self.activation == "relu":
            h = F.relu(h)
        else:
            h = F.relu(h).square()
        return self.fc2(h)


def rounded(state_dict, dtype):
    """The parameters as autocast feeds them to the GEMMs: rounded to `dtype`."""
    return {k: v.to(dtype) for k, v in state_dict.items()}


def compare_modules(fused, ref64, x, dtype, return_residual=False):
    """Runs fused on x and ref64 (float64 copy) on x in float64; compares output and grads."""
    x = x.detach().requires_grad_()
    x64 = x.detach().double().requires_grad_()
    res = fused(x)
    out, resid = res if return_residual else (res, None)
    assert out.dtype == x.dtype
    ref = ref64(x64)
    g = torch.randn_like(out)
    wide = (lambda t: t) if dtype == torch.float64 else (lambda t: t.float())
    loss = (wide(out) * wide(g)).sum()
    ref_loss = (ref * g.double()).sum()
    if return_residual:
        assert resid is x or torch.equal(resid, x)
        gr = torch.randn_like(resid)
        loss = loss + (wide(resid) * wide(gr)).sum()
        ref_loss = ref_loss + (x64 * gr.double()).sum()
    loss.backward()
    ref_loss.backward()
    assert_close_rel(out, ref, dtype)
    assert_close_rel(x.grad, x64.grad, dtype, what="grad x")
    ref_params = dict(ref64.named_parameters())
    for name, p in fused.named_parameters():
        assert p.grad is not None and p.grad.dtype == p.dtype, name
        assert_close_rel(p.grad, ref_params[name].grad, dtype, what=f"grad {name}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("return_residual", [False, True])
def test_fused_dense_vs_linear(dtype, bias, return_residual):
    fused = FusedDense(33, 48, bias=bias, return_residual=return_residual, dtype=dtype)
    assert isinstance(fused, nn.Linear)
    ref64 = nn.Linear(33, 48, bias=bias, dtype=torch.float64)
    ref64.load_state_dict(fused.state_dict())  # also the state_dict round trip
    compare_modules(fused, ref64, torch.randn(4, 7, 33, dtype=dtype), dtype, return_residual)


def test_fused_dense_state_dict_round_trip():
    plain = nn.Linear(16, 8)
    fused = FusedDense(16, 8)
    fused.load_state_dict(plain.state_dict())
    x = torch.randn(5, 16)
    torch.testing.assert_close(fused(x), plain(x))
    assert set(fused.state_dict()) == set(plain.state_dict())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("checkpoint_lvl", [0, 1, 2])
@pytest.mark.parametrize("features,bias1,bias2,return_residual,heuristic", [
    ((32, 128, 32), True, True, False, "auto"),
    ((33, 65, 17), False, True, True, -1),
    ((64, 40, 64), True, False, True, 0),
])
def test_fused_mlp_vs_plain(features, bias1, bias2, return_residual, heuristic, checkpoint_lvl, activation, dtype):
    in_f, hidden, out_f = features
    fused = FusedMLP(in_f, hidden, out_f, bias1=bias1, bias2=bias2, activation=activation,
                     return_residual=return_residual, checkpoint_lvl=checkpoint_lvl, heuristic=heuristic,
                     dtype=dtype)
    ref64 = PlainMLP(in_f, hidden, out_f, bias1, bias2, activation, dtype=torch.float64)
    ref64.load_state_dict(fused.state_dict())
    compare_modules(fused, ref64, torch.randn(3, 5, in_f, dtype=dtype), dtype, return_residual)


@pytest.mark.parametrize("bias1,bias2", [(True, True), (False, True), (True, False), (False, False)])
def test_fused_mlp_state_dict_round_trip(bias1, bias2):
    plain = PlainMLP(24, 96, 24, bias1, bias2, "relu")
    fused = FusedMLP(24, bias1=bias1, bias2=bias2, activation="relu")
    assert fused.fc1.out_features == 96 and fused.fc2.out_features == 24  # defaults: 4x, in
    assert fused.state_dict().keys() == plain.state_dict().keys()
    fused.load_state_dict(plain.state_dict())
    x = torch.randn(7, 24)
    torch.testing.assert_close(fused(x), plain(x))
    # ... and back, after the fused model changed its weights.
    with torch.no_grad():
        for p in fused.parameters():
            p.add_(torch.randn_like(p))
    plain2 = PlainMLP(24, 96, 24, bias1, bias2, "relu")
    plain2.load_state_dict(fused.state_dict())
    torch.testing.assert_close(plain2(x), fused(x))


def test_fused_mlp_defaults_and_repr():
    m = FusedMLP(10)
    assert (m.fc1.in_features, m.fc1.out_features, m.fc2.out_features) == (10, 40, 10)
    assert m.activation == "gelu_approx" and m.checkpoint_lvl == 0 and m.heuristic == "auto"
    m = FusedMLP(10, out_features=3)
    assert (m.fc1.out_features, m.fc2.out_features) == (40, 3)
    assert "gelu_approx" in repr(m)


@pytest.mark.parametrize("kwargs,match", [
    (dict(activation="gelu"), "activation"),
    (dict(activation="tanh"), "activation"),
    (dict(checkpoint_lvl=3), "checkpoint_lvl"),
    (dict(checkpoint_lvl="0"), "checkpoint_lvl"),
    (dict(heuristic="best"), "heuristic"),
    (dict(heuristic=-5), "heuristic"),
])
def test_fused_mlp_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        FusedMLP(8, **kwargs)


def _saved(module, x):
    params = {p.untyped_storage().data_ptr() for p in module.parameters()}
    params.add(x.untyped_storage().data_ptr())
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = module(x)
    new = [t for t in saved if t.untyped_storage().data_ptr() not in params]
    return out, saved, new


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("checkpoint_lvl", [0, 1, 2])
def test_fused_mlp_eval_saves_nothing(activation, checkpoint_lvl):
    m = FusedMLP(16, 64, activation=activation, checkpoint_lvl=checkpoint_lvl).eval()
    x = torch.randn(6, 16, requires_grad=True)
    # Eval mode with autograd on: nothing beyond the input and the parameters themselves.
    out, saved, new = _saved(m, x)
    assert new == []
    # ... and backward still works (fc1 is recomputed).
    out.sum().backward()
    ref64 = PlainMLP(16, 64, 16, activation=activation, dtype=torch.float64)
    ref64.load_state_dict(m.state_dict())
    x64 = x.detach().double().requires_grad_()
    ref64(x64).sum().backward()
    assert_close_rel(x.grad, x64.grad, torch.float32)
    # No gradient needed at all: nothing is saved.
    with torch.no_grad():
        _, saved, _ = _saved(m, x)
    assert saved == []
    m.train()
    with torch.inference_mode():
        _, saved, _ = _saved(m, torch.randn(6, 16))
    assert saved == []
    _, _, new = _saved(m, x)  # training mode keeps activations (level 0 and 1)
    assert (new != []) == (checkpoint_lvl < 2)


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_fused_mlp_autocast_cpu(activation):
    fused = FusedMLP(32, 96, activation=activation)
    ref64 = PlainMLP(32, 96, 32, activation=activation, dtype=torch.float64)
    ref64.load_state_dict(rounded(fused.state_dict(), torch.bfloat16))  # what autocast computes with
    plain = PlainMLP(32, 96, 32, activation=activation)
    plain.load_state_dict(fused.state_dict())
    x = torch.randn(4, 8, 32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = fused(x)
        assert out.dtype == plain(x).dtype == torch.bfloat16
    out.float().sum().backward()
    x64 = x.to(torch.bfloat16).double()
    ref = ref64(x64)
    ref.sum().backward()
    assert_close_rel(out, ref, torch.bfloat16)
    for name, p in fused.named_parameters():
        assert p.grad.dtype == torch.float32
        assert_close_rel(p.grad, dict(ref64.named_parameters())[name].grad, torch.bfloat16, what=name)


# ------------------------------------------------------------------------------------------------
# torch.compile


def _train_step(model, x, g):
    res = model(x)
    out = res[0] if isinstance(res, tuple) else res
    (out * g).sum().backward()
    return out


def _check_compiled(model, backend, x):
    eager = copy.deepcopy(model)
    compiled = torch.compile(copy.deepcopy(model), backend=backend, fullgraph=True)
    x_e = x.clone().requires_grad_()
    x_c = x.clone().requires_grad_()
    g = torch.randn(*x.shape[:-1], model.fc2.out_features)
    out_e = _train_step(eager, x_e, g)
    out_c = _train_step(compiled, x_c, g)  # fullgraph=True: any graph break raises
    torch.testing.assert_close(out_c, out_e)
    torch.testing.assert_close(x_c.grad, x_e.grad)
    for (name, p_e), p_c in zip(eager.named_parameters(), compiled.parameters()):
        torch.testing.assert_close(p_c.grad, p_e.grad, msg=name)


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("checkpoint_lvl", [0, 1, 2])
def test_compile_aot_eager(activation, checkpoint_lvl):
    torch._dynamo.reset()
    model = FusedMLP(32, 64, activation=activation, checkpoint_lvl=checkpoint_lvl, return_residual=True)
    _check_compiled(model, "aot_eager", torch.randn(3, 5, 32))


@pytest.mark.parametrize("activation,checkpoint_lvl", [("gelu_approx", 0), ("relu", 1), ("sqrelu", 2)])
def test_compile_inductor(activation, checkpoint_lvl):
    torch._dynamo.reset()
    model = FusedMLP(32, 64, activation=activation, checkpoint_lvl=checkpoint_lvl)
    _check_compiled(model, "inductor", torch.randn(3, 5, 32))


def test_compile_fused_dense_and_autocast():
    torch._dynamo.reset()
    dense = FusedDense(32, 16)
    compiled = torch.compile(copy.deepcopy(dense), backend="aot_eager", fullgraph=True)
    x = torch.randn(4, 32)
    torch.testing.assert_close(compiled(x), dense(x))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out_c = compiled(x)
        out_e = dense(x)
    assert out_c.dtype == out_e.dtype == torch.bfloat16
    torch.testing.assert_close(out_c, out_e)


# ------------------------------------------------------------------------------------------------
# CUDA (the GPU machine)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("features", [1024, 4096])
@pytest.mark.parametrize("return_residual", [False, True])
def test_fused_dense_cuda(dtype, features, return_residual):
    fused = FusedDense(features, features, return_residual=return_residual, device="cuda", dtype=dtype)
    ref64 = nn.Linear(features, features, device="cuda", dtype=torch.float64)
    ref64.load_state_dict(fused.state_dict())
    compare_modules(fused, ref64, torch.randn(8, 512, features, device="cuda", dtype=dtype), dtype,
                    return_residual)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("features", [1024, 4096])
@pytest.mark.parametrize("activation,checkpoint_lvl,heuristic", [("gelu_approx", 0, "auto"), ("relu", 1, -1),
                                                                  ("sqrelu", 2, 0), ("relu", 0, "auto")])
def test_fused_mlp_cuda(heuristic, checkpoint_lvl, activation, features, dtype):
    # The full matrix runs in test_functional.py::test_mlp_cuda; here the module around it.
    fused = FusedMLP(features, activation=activation, checkpoint_lvl=checkpoint_lvl, heuristic=heuristic,
                     device="cuda", dtype=dtype)
    ref64 = PlainMLP(features, 4 * features, features, activation=activation, device="cuda", dtype=torch.float64)
    ref64.load_state_dict(fused.state_dict())
    compare_modules(fused, ref64, torch.randn(8, 512, features, device="cuda", dtype=dtype), dtype)


@pytest.mark.cuda
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_fused_mlp_autocast_cuda_fp16(activation):
    fused = FusedMLP(1024, activation=activation, device="cuda")
    ref64 = PlainMLP(1024, 4096, 1024, activation=activation, device="cuda", dtype=torch.float64)
    ref64.load_state_dict(rounded(fused.state_dict(), torch.float16))
    x = torch.randn(4, 512, 1024, device="cuda")
    with torch.autocast("cuda", dtype=torch.float16):
        out = fused(x)
    assert out.dtype == torch.float16
    out.float().sum().backward()
    ref = ref64(x.half().double())
    ref.sum().backward()
    assert_close_rel(out, ref, torch.float16)
    for name, p in fused.named_parameters():
        assert p.grad.dtype == torch.float32
        assert_close_rel(p.grad, dict(ref64.named_parameters())[name].grad, torch.float16, what=name)


@pytest.mark.cuda
@needs_caching_allocator
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_fused_mlp_eval_cuda_memory(activation):
    m = FusedMLP(1024, activation=activation, device="cuda", dtype=torch.bfloat16).eval()
    x = torch.randn(4096, 1024, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        m(x)
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        out = m(x)
        torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() - base == out.numel() * out.element_size()


@pytest.mark.cuda
@pytest.mark.parametrize("activation,checkpoint_lvl", [("gelu_approx", 0), ("relu", 1), ("sqrelu", 2)])
def test_compile_inductor_cuda(activation, checkpoint_lvl):
    torch._dynamo.reset()
    model = FusedMLP(1024, activation=activation, checkpoint_lvl=checkpoint_lvl, device="cuda",
                     dtype=torch.bfloat16)
    eager = copy.deepcopy(model)
    compiled = torch.compile(model, fullgraph=True)
    x = torch.randn(2, 256, 1024, device="cuda", dtype=torch.bfloat16)
    g = torch.randn_like(x)
    x_e, x_c = x.clone().requires_grad_(), x.clone().requires_grad_()
    out_e = _train_step(eager, x_e, g)
    out_c = _train_step(compiled, x_c, g)
    assert_close_rel(out_c, out_e, torch.bfloat16)
    assert_close_rel(x_c.grad, x_e.grad, torch.bfloat16, what="grad x")
    for (name, p_e), p_c in zip(eager.named_parameters(), compiled.parameters()):
        assert_close_rel(p_c.grad, p_e.grad, torch.bfloat16, what=name)


def test_compile_fullgraph_backward_in_a_fresh_process():
    """torch.compile(fullgraph=True) of FusedDense forward + backward where nothing ran eagerly
    before. Looking the ops' overloads up lazily (and caching them in a dict) on first use is
    something Dynamo refuses inside a traced autograd.Function; in-process tests cannot see that
    once any other test has called the ops, so this one runs in a new interpreter."""
    script = (
        "import torch, fused_dense\n"
        "m = fused_dense.FusedDense(32, 16)\n"
        "c = torch.compile(m, backend='aot_eager', fullgraph=True)\n"
        "x = torch.randn(4, 32, requires_grad=True)\n"
        "c(x).sum().backward()\n"
        "ref = torch.nn.functional.linear(x.detach(), m.weight.detach(), m.bias.detach())\n"
        "torch.testing.assert_close(c(x), ref)\n"
        "print('ok', x.grad.shape)\n")
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert res.returncode == 0 and "ok torch.Size([4, 32])" in res.stdout, res.stdout + res.stderr[-3000:]
