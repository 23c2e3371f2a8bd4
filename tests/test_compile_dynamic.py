"""torch.compile with a changing token count: the library's layers trace it as a symbol.

Dynamo compiles a function for its first token count, and at the second marks the count dynamic
(automatic dynamic shapes): nn.Linear's function then has 2 graphs for any number of counts. The
ops' Meta kernels, checks and C++ autograd Functions read the token dimension symbolically
(sym_size), so the library's layers do the same; a read of Tensor::size() or sizes() on a traced
tensor would specialise the graph to each count (a recompile each, and eager execution past
torch._dynamo.config.recompile_limit counts). Each compiled call must also give eager's outputs
and gradients: the same kernels run (backend aot_eager), so the bits are equal.
"""
import copy
import functools

import pytest
import torch
from torch._dynamo.utils import counters

from fused_dense import Float8Recipe, FusedDense, FusedGatedMLP, FusedMLP
from fused_dense.loss import linear_cross_entropy
from fused_dense.modules import fuse_qkv_projections

C = 64
COUNTS = (40, 37, 64, 19)  # FP8 transposed copies padded to 48, 48, 64 (none), 32 tokens
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]
# bit-for-bit between calls: no measured choice may replace a provisional one in between
pytestmark = pytest.mark.usefixtures("deterministic_tuning")
BF16 = torch.bfloat16


def fp8_recipe(scaling="current", mode="traced"):
    return Float8Recipe(scaling=scaling, min_features=0, compiled_input_quantize=mode)


def layer_cases():
    for act in ("gelu_approx", "relu", "sqrelu"):
        for lvl in (0, 1, 2):
            yield f"mlp-{act}-{lvl}", functools.partial(FusedMLP, C, 96, activation=act, checkpoint_lvl=lvl)
    for act in ("swiglu", "geglu"):
        for lvl in (0, 1, 2):
            yield f"gated-{act}-{lvl}", functools.partial(FusedGatedMLP, C, 48, activation=act, checkpoint_lvl=lvl)
    yield "dense", functools.partial(FusedDense, C, 32)
    for scaling in ("current", "delayed"):
        for mode in ("traced", "traced_rowwise", "op"):
            kw = dict(fp8=fp8_recipe(scaling, mode))
            yield f"fp8-dense-{scaling}-{mode}", functools.partial(FusedDense, C, 32, **kw)
            yield f"fp8-mlp-{scaling}-{mode}", functools.partial(FusedMLP, C, 96, **kw)
            yield f"fp8-gated-{scaling}-{mode}", functools.partial(FusedGatedMLP, C, 48, **kw)
    # the FP8 MLPs' other saved-tensor plans: checkpoint levels, the e4m3 pre-activation
    for cls, act, width in ((FusedMLP, "gelu_approx", 96), (FusedMLP, "relu", 96), (FusedGatedMLP, "swiglu", 48)):
        for lvl in (1, 2):
            yield f"fp8-{act}-{lvl}", functools.partial(cls, C, width, activation=act, checkpoint_lvl=lvl,
                                                        fp8=fp8_recipe())
        yield f"fp8-{act}-save_pre_fp8", functools.partial(
            cls, C, width, activation=act, fp8=Float8Recipe(min_features=0, save_pre_fp8=True))
        # the weights quantized again in backward (no transposed copy held through the step)
        for lvl in (0, 2):
            yield f"fp8-{act}-{lvl}-no_weight_copy", functools.partial(
                cls, C, width, activation=act, checkpoint_lvl=lvl,
                fp8=Float8Recipe(min_features=0, save_weight_fp8=False))
    yield "fp8-dense-no_weight_copy", functools.partial(FusedDense, C, 32,
                                                        fp8=Float8Recipe(min_features=0, save_weight_fp8=False))


CASES = dict(layer_cases())


def fp8_device(device, name):
    if device == "cuda" and "fp8" in name and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 needs a GPU of compute capability 8.9+")
    return torch.device(device)


def graphs_over_counts(fn, params, make_input, twin=None, counts=COUNTS):
    """Run fn compiled at each token count against fn eager: outputs, the gradients of the input
    and of params, bit for bit; return the number of graphs dynamo compiled. twin: (fn, params)
    compiled instead, for layers whose state each call advances (delayed scaling), with their
    buffers compared after each call."""
    torch._dynamo.reset()
    counters.clear()
    twin_fn, twin_params = twin if twin is not None else (fn, params)
    compiled = torch.compile(twin_fn, backend="aot_eager")
    for rows in counts:
        x = make_input(rows)
        want = fn(x)
        grad_out = torch.randn_like(want)
        want_grads = torch.autograd.grad(want, [x] + params, grad_out)
        got = compiled(x)
        got_grads = torch.autograd.grad(got, [x] + twin_params, grad_out)
        for a, b in zip((want,) + want_grads, (got,) + got_grads):
            assert a.shape == b.shape and torch.equal(a, b), rows
        if twin is not None:
            for (name, a), b in zip(fn.named_buffers(), twin_fn.buffers()):
                assert torch.equal(a, b), (rows, name)
    return counters["stats"]["unique_graphs"]


def nn_linear_graphs(device):
    linear = torch.nn.Linear(C, 32, dtype=BF16, device=device)
    return graphs_over_counts(linear, list(linear.parameters()),
                              lambda n: torch.randn(n, C, dtype=BF16, device=device, requires_grad=True))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", list(CASES))
def test_layers_trace_the_token_count_once(name, device):
    device = fp8_device(device, name)
    torch.manual_seed(0)
    layer = CASES[name](dtype=BF16, device=device)
    twin = copy.deepcopy(layer)
    graphs = graphs_over_counts(layer, list(layer.parameters()),
                                lambda n: torch.randn(n, C, dtype=BF16, device=device, requires_grad=True),
                                twin=(twin, list(twin.parameters())))
    assert graphs == 2 == nn_linear_graphs(device), name


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_batched_input_traces_the_sequence_length_once(fp8, device):
    """[batch, tokens, d] inputs, the tokens changing: the layer folds them to rows in C++."""
    device = fp8_device(device, "fp8" if fp8 else "")
    torch.manual_seed(0)
    kw = dict(dtype=BF16, device=device, fp8=fp8_recipe() if fp8 else None)
    layers = [FusedDense(C, 32, **kw), FusedGatedMLP(C, 48, **kw)]

    def step(x):
        return sum(layer(x).float().square().mean(-1) for layer in layers)

    graphs = graphs_over_counts(step, [p for m in layers for p in m.parameters()],
                                lambda n: torch.randn(2, n, C, dtype=BF16, device=device, requires_grad=True))
    assert graphs == 2


@pytest.mark.parametrize("device", DEVICES)
def test_fused_qkv_traces_the_token_count_once(device):
    """q / k / v projections fused into one FP8 GEMM, read through their three parts."""
    device = fp8_device(device, "fp8")
    torch.manual_seed(0)
    kw = dict(dtype=BF16, device=device)
    attn = torch.nn.Module()
    for name, width in (("q_proj", 64), ("k_proj", 32), ("v_proj", 32)):
        setattr(attn, name, torch.nn.Linear(C, width, bias=False, **kw))
    qkv = fuse_qkv_projections(attn, fp8=fp8_recipe())

    def step(x):
        h = x * 2
        q, k, v = attn.q_proj(h), attn.k_proj(h), attn.v_proj(h)
        return (q[:, :32] * k + v).float()

    graphs = graphs_over_counts(step, list(qkv.parameters()), lambda n: torch.randn(n, C, **kw, requires_grad=True))
    assert graphs == 2


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_lm_head_loss_traces_the_token_count_once(fp8, device):
    device = fp8_device(device, "fp8" if fp8 else "")
    torch.manual_seed(0)
    vocab = 160
    weight = (torch.randn(vocab, C, dtype=BF16, device=device) / 8).requires_grad_()

    def loss(x):
        target = (x.detach()[:, 0].float() * 1e4).long().remainder(vocab)  # made from x: no size in Python
        return linear_cross_entropy(x, weight, target, reduction="none", chunk_size=16, fp8=fp8)

    assert graphs_over_counts(loss, [weight],
                              lambda n: torch.randn(n, C, dtype=BF16, device=device, requires_grad=True)) == 2
