"""linear_cross_entropy: the LM head's loss without the logits (fused_dense/loss.py, the op
fused_dense::linear_cross_entropy), against a float64 reference written here in plain PyTorch."""
import math

import pytest
import torch

import fused_dense
from conftest import rel_err, rounding_tol
from fused_dense import FusedLinearCrossEntropyLoss, linear_cross_entropy

OPS = torch.ops.fused_dense
IGNORE = -100


def row_losses(z, target, *, label_smoothing=0.0, z_loss=0.0, softcap=None, ignore_index=IGNORE):
    """Each row's loss from the definition (0 at ignored rows): log-softmax of the (capped) logits z."""
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    valid = target != ignore_index
    logp = z - torch.logsumexp(z, dim=-1, keepdim=True)
    picked = logp.gather(-1, torch.where(valid, target, 0).unsqueeze(-1)).squeeze(-1)
    loss = -(1 - label_smoothing) * picked - label_smoothing * logp.mean(-1)
    if z_loss:
        loss = loss + z_loss * torch.logsumexp(z, dim=-1) ** 2
    return torch.where(valid, loss, torch.zeros_like(loss))


def reference(x, weight, target, bias=None, *, label_smoothing=0.0, z_loss=0.0, softcap=None, reduction="mean",
              num_items_in_batch=None, ignore_index=IGNORE):
    """The loss in float64 from the definition: log-softmax of the (capped) logits."""
    z = x.double() @ weight.double().T
    if bias is not None:
        z = z + bias.double()
    loss = row_losses(z, target, label_smoothing=label_smoothing, z_loss=z_loss, softcap=softcap,
                      ignore_index=ignore_index)
    valid = target != ignore_index
    if reduction == "none":
        return loss
    if num_items_in_batch is not None:
        return loss.sum() / num_items_in_batch
    return loss.sum() / valid.sum() if reduction == "mean" else loss.sum()


def problem(device, dtype, n=37, d=24, vocab=50, bias=True, ignored=5):
    x = torch.randn(n, d, device=device, dtype=dtype)
    weight = torch.randn(vocab, d, device=device, dtype=dtype) / math.sqrt(d) * 2
    b = torch.randn(vocab, device=device, dtype=dtype) if bias else None
    target = torch.randint(0, vocab, (n,), device=device)
    target[::ignored] = IGNORE
    return x, weight, b, target


# Tolerances, from the dtype and the error measured on the CPU (37 x 24 -> 50, chunks of 8):
# float64 results are off by <= 4e-16 and float32 by <= 1.6e-7 (2.7 u), well inside
# rounding_tol(k = the longest sum, 2 roundings); bf16 / fp16 gradients go through two roundings
# (the logits, their gradient) and one of the GEMM's result: <= 1.1 u measured, 3 roundings
# allowed (bf16 6.8e-3: a 1% error fails). The loss is computed in float32 from the rounded
# logits: measured <= 0.09 u (bf16); allowed u / 4.
def grad_tol(dtype, k):
    return rounding_tol(dtype, k, 2 if dtype in (torch.float32, torch.float64) else 3)


def loss_tol(dtype, k):
    if dtype in (torch.float32, torch.float64):
        return rounding_tol(dtype, k, 2)
    return torch.finfo(dtype).eps / 2 / 4


FEATURES = {
    "plain": {},
    "smoothing": {"label_smoothing": 0.1},
    "z_loss": {"z_loss": 1e-2},
    "softcap": {"softcap": 3.0},
    "all": {"label_smoothing": 0.05, "z_loss": 1e-3, "softcap": 5.0},
}


def check_against_reference(device, dtype, reduction, feature, chunk_size=8, bias=True, **shape):
    x, weight, b, target = problem(device, dtype, bias=bias, **shape)
    kw = FEATURES[feature]
    leaves = [t.clone().requires_grad_() for t in (x, weight) + ((b,) if bias else ())]
    loss = linear_cross_entropy(leaves[0], leaves[1], target, leaves[2] if bias else None, reduction=reduction,
                                chunk_size=chunk_size, **kw)
    assert loss.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    grad_out = torch.randn(loss.shape, device=device, dtype=loss.dtype) if reduction == "none" else \
        torch.tensor(1.7, device=device, dtype=loss.dtype)
    grads = torch.autograd.grad(loss, leaves, grad_out)
    refs = [t.detach().double().requires_grad_() for t in leaves]
    ref = reference(refs[0], refs[1], target, refs[2] if bias else None, reduction=reduction, **kw)
    ref_grads = torch.autograd.grad(ref, refs, grad_out.double())
    k = max(x.shape[0], x.shape[1], weight.shape[0])
    assert rel_err(loss, ref) <= loss_tol(dtype, k), f"loss: {rel_err(loss, ref):.3e}"
    for name, g, r in zip(("x", "weight", "bias"), grads, ref_grads):
        assert g.dtype == dtype
        assert rel_err(g, r) <= grad_tol(dtype, k), f"grad {name}: {rel_err(g, r):.3e} > {grad_tol(dtype, k):.3e}"


@pytest.mark.parametrize("feature", sorted(FEATURES))
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=str)
def test_cpu_matches_float64_reference(dtype, reduction, feature):
    check_against_reference("cpu", dtype, reduction, feature)


@pytest.mark.parametrize("chunk_size", [1, 7, 36, 37, 1000, None])
def test_cpu_any_chunk_size(chunk_size):
    check_against_reference("cpu", torch.float64, "mean", "all", chunk_size=chunk_size)


def test_cpu_without_bias_and_leading_dims():
    x, weight, _, target = problem("cpu", torch.float64, n=24, bias=False)
    xs = x.reshape(2, 3, 4, -1).requires_grad_()
    w = weight.clone().requires_grad_()
    loss = linear_cross_entropy(xs, w, target.reshape(2, 3, 4), reduction="none", chunk_size=5)
    assert loss.shape == (2, 3, 4)
    ref = reference(x, weight, target, reduction="none").reshape(2, 3, 4)
    assert rel_err(loss, ref) <= 1e-14
    loss.sum().backward()
    assert xs.grad.shape == xs.shape and w.grad.shape == w.shape


def test_cpu_num_items_in_batch_divides_the_sum():
    x, weight, b, target = problem("cpu", torch.float64)
    loss = linear_cross_entropy(x, weight, target, b, num_items_in_batch=torch.tensor(100))
    assert rel_err(loss, reference(x, weight, target, b, num_items_in_batch=100)) <= 1e-14
    assert rel_err(linear_cross_entropy(x, weight, target, b, num_items_in_batch=100.0), loss) == 0
    with pytest.raises(ValueError, match="num_items_in_batch .* needs reduction='mean'"):
        linear_cross_entropy(x, weight, target, b, reduction="sum", num_items_in_batch=100)


def test_cpu_all_ignored_rows():
    x, weight, b, target = problem("cpu", torch.float64)
    target.fill_(IGNORE)
    w = weight.clone().requires_grad_()
    loss = linear_cross_entropy(x, w, target, b)
    assert torch.isnan(loss)  # 0 / 0, as torch.nn.functional.cross_entropy gives
    loss.backward()
    assert torch.equal(w.grad, torch.zeros_like(w))
    assert linear_cross_entropy(x, weight, target, b, reduction="sum").item() == 0.0


def test_cpu_custom_ignore_index():
    x, weight, b, target = problem("cpu", torch.float64, ignored=1000)
    target[::3] = 7
    loss = linear_cross_entropy(x, weight, target, b, ignore_index=7)
    assert rel_err(loss, reference(x, weight, target, b, ignore_index=7)) <= 1e-14


def test_cpu_no_grad_computes_no_gradients():
    x, weight, b, target = problem("cpu", torch.float64)
    res = OPS.linear_cross_entropy_forward(x, weight, b, target, IGNORE, 0.0, 0.0, 0.0, 1, None, 8,
                                           [False, False, False])
    assert [t.numel() for t in res[2:]] == [0, 0, 0]
    with torch.no_grad():
        loss = linear_cross_entropy(x.requires_grad_(), weight, target, b)
    assert loss.grad_fn is None
    assert rel_err(loss, reference(x.detach(), weight, target, b)) <= 1e-14


def test_cpu_frozen_weight_gets_no_gradient():
    x, weight, b, target = problem("cpu", torch.float64)
    xl = x.clone().requires_grad_()
    linear_cross_entropy(xl, weight, target, b).backward()
    assert xl.grad is not None and weight.grad is None and b.grad is None


def test_cpu_second_backward_is_refused_for_the_mean():
    x, weight, b, target = problem("cpu", torch.float64)
    w = weight.clone().requires_grad_()
    loss = linear_cross_entropy(x, w, target, b)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="second backward"):
        loss.backward()
    # reduction none recomputes, so it can go twice
    loss = linear_cross_entropy(x, w, target, b, reduction="none").sum()
    w.grad = None
    loss.backward(retain_graph=True)
    first = w.grad.clone()
    loss.backward()
    assert torch.allclose(w.grad, 2 * first, rtol=1e-14, atol=0)


def test_cpu_autocast_runs_the_head_in_bf16():
    x, weight, b, target = problem("cpu", torch.float32)
    w = weight.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = linear_cross_entropy(x, w, target, b)
    loss.backward()
    assert w.grad.dtype == torch.float32
    ref = linear_cross_entropy(x.bfloat16(), weight.bfloat16(), target, b.bfloat16())
    assert torch.equal(loss, ref)


def test_cpu_module_form():
    x, weight, b, target = problem("cpu", torch.float64)
    fn = FusedLinearCrossEntropyLoss(label_smoothing=0.1, z_loss=1e-3, softcap=4.0, chunk_size=5)
    assert "label_smoothing=0.1" in repr(fn)
    expect = linear_cross_entropy(x, weight, target, b, label_smoothing=0.1, z_loss=1e-3, softcap=4.0)
    assert rel_err(fn(x, weight, target, b), expect) <= 1e-14
    assert list(fn.parameters()) == []


def test_chunk_rule():
    rows = OPS.linear_cross_entropy_chunk_rows
    # the largest power of two of rows whose logits fit max(a quarter of the weight gradient, 256 MiB)
    assert rows(8192, 4096, 128256, 2, 0) == 1024  # 1,024 rows are 250.5 MiB, under both allowances
    assert rows(8192, 8192, 128256, 2, 0) == 2048  # d / 4: 2,048 rows are 501 MiB, a quarter of 2,004
    assert rows(8192, 5120, 128256, 2, 0) == 1024
    assert rows(8192, 2048, 128256, 2, 0) == 1024  # the floor: a quarter alone gave 512
    assert rows(8192, 4096, 128256, 4, 0) == 1024  # float32 logits: a quarter of a float32 weight gradient
    assert rows(8192, 4096, 32000, 2, 0) == 4096  # the 256 MiB floor: 4,096 rows are 250 MiB, 8,192 500
    assert rows(8192, 2048, 32000, 2, 0) == 4096
    assert rows(8192, 4096, 32000, 4, 0) == 2048
    assert rows(65536, 4096, 32768, 2, 0) == 4096  # exactly 256 MiB fits
    assert rows(65536, 4096, 32769, 2, 0) == 2048
    assert rows(8192, 512, 1048576, 2, 0) == 256  # the floor of rows (both allowances give 128)
    assert rows(100, 4096, 32000, 2, 0) == 100
    assert rows(8192, 4096, 32000, 2, 300) == 300
    for bad in ((8192, 0, 32000, 2, 0), (8192, 4096, 0, 2, 0), (8192, 4096, 32000, 0, 0)):
        with pytest.raises(ValueError, match="d, vocab and element_bytes must be positive"):
            rows(*bad)


def scaled(t, g):
    """t * g in fp32 (fp64 for float64) rounded once: the scale op's definition."""
    math = torch.float64 if t.dtype == torch.float64 else torch.float32
    return (t.to(math) * g.to(math)).to(t.dtype)


def assert_same_bytes(got, want):
    assert got.dtype == want.dtype and got.shape == want.shape
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64], ids=str)
def test_cpu_scale_grads_rounds_once(dtype):
    g = torch.tensor(1 / 3, dtype=torch.float64 if dtype == torch.float64 else torch.float32)
    ts = [torch.randn(37, 5, dtype=dtype), torch.randn(11, dtype=dtype)]
    want = [scaled(t, g) for t in ts]
    OPS.linear_cross_entropy_scale_grads_(ts, g)
    for got, w in zip(ts, want):
        assert_same_bytes(got, w)
    torch.library.opcheck(OPS.linear_cross_entropy_scale_grads_, ([t.clone() for t in ts], g))


@pytest.mark.parametrize("args, match", [
    (lambda: ([torch.randn(3)], torch.ones(2)), "grad_loss must be one floating-point number"),
    (lambda: ([torch.randn(3)], torch.ones((), dtype=torch.int64)), "grad_loss must be one floating-point number"),
    (lambda: ([torch.ones(3, dtype=torch.int32)], torch.ones(())), r"grads\[0\] must be floating point"),
    (lambda: ([torch.randn(3), torch.randn(2, device="meta")], torch.ones(())), r"grads\[1\] must be on"),
])
def test_scale_grads_bad_input(args, match):
    grads, g = args()
    with pytest.raises(ValueError, match=match):
        OPS.linear_cross_entropy_scale_grads_(grads, g)


def _bad(**over):
    x, weight, b, target = problem("cpu", torch.float32)
    args = dict(x=x, weight=weight, target=target, bias=b)
    args.update(over)
    return args


ERRORS = [
    ("target-range", dict(target=torch.full((37,), 50)), ValueError, "class indices in \\[0, 50\\).*got 50 at row 0"),
    ("target-negative", dict(target=torch.tensor([3] * 36 + [-2])), ValueError, "got -2 at row 36"),
    ("target-dtype", dict(target=torch.zeros(37, dtype=torch.int32)), ValueError, "target must be int64"),
    ("target-shape", dict(target=torch.zeros(36, dtype=torch.long)), ValueError, "target must have input's leading"),
    ("weight-width", dict(weight=torch.randn(50, 23)), ValueError, "weight must be \\[vocab, d\\] with d = .* 24"),
    ("weight-dtype", dict(weight=torch.randn(50, 24, dtype=torch.float64)), ValueError, "weight must have the dtype"),
    ("bias-shape", dict(bias=torch.randn(49)), ValueError, "bias must be \\[vocab\\] = \\[50\\]"),
]


@pytest.mark.parametrize("over,exc,match", [e[1:] for e in ERRORS], ids=[e[0] for e in ERRORS])
def test_cpu_bad_input(over, exc, match):
    a = _bad(**over)
    with pytest.raises(exc, match=match):
        linear_cross_entropy(a["x"], a["weight"], a["target"], a["bias"])


@pytest.mark.parametrize("kw,match", [
    (dict(reduction="avg"), "reduction must be one of"),
    (dict(label_smoothing=1.5), "label_smoothing must be in \\[0, 1\\], got 1.5"),
    (dict(z_loss=-1.0), "z_loss must be finite and >= 0"),
    (dict(softcap=0.0), "softcap must be positive or None"),
    (dict(chunk_size=0), "chunk_size must be a positive int or None"),
])
def test_cpu_bad_settings(kw, match):
    a = _bad()
    with pytest.raises(ValueError, match=match):
        linear_cross_entropy(a["x"], a["weight"], a["target"], a["bias"], **kw)


def test_meta_shapes_and_checks():
    x, weight, b, target = (t.to("meta") if t is not None else None for t in problem("cpu", torch.bfloat16))
    loss, lse, gi, gw, gb = OPS.linear_cross_entropy_forward(x, weight, b, target, IGNORE, 0.0, 0.0, 0.0, 1, None, 0,
                                                             [True, True, True])
    assert (loss.shape, lse.shape, lse.dtype) == ((), (37,), torch.float32)
    assert (gi.shape, gw.shape, gb.shape, gw.dtype) == (x.shape, weight.shape, (50,), torch.bfloat16)
    with pytest.raises(ValueError, match="weight must be \\[vocab, d\\]"):
        OPS.linear_cross_entropy_forward(x, weight[:, :3], b, target, IGNORE, 0.0, 0.0, 0.0, 1, None, 0,
                                         [True, True, True])
    gi, gw, gb = OPS.linear_cross_entropy_backward(torch.ones(37, device="meta"), x, weight, b, target, lse, IGNORE,
                                                   0.0, 0.0, 0.0, 0, None, 0, [True, False, True])
    assert (gi.shape, gw.numel(), gb.shape) == (x.shape, 0, (50,))


def test_opcheck():
    x, weight, b, target = problem("cpu", torch.float32, n=9, d=8, vocab=12)
    torch.library.opcheck(OPS.linear_cross_entropy_forward.default,
                          (x, weight, b, target, IGNORE, 0.1, 1e-3, 3.0, 1, None, 4, [True, True, True]))
    lse = OPS.linear_cross_entropy_forward(x, weight, b, target, IGNORE, 0.0, 0.0, 0.0, 0, None, 4,
                                           [False, False, False])[1]
    torch.library.opcheck(OPS.linear_cross_entropy_backward.default,
                          (torch.randn(9), x, weight, b, target, lse, IGNORE, 0.0, 0.0, 0.0, 0, None, 4,
                           [True, True, True]))
    torch.library.opcheck(OPS.linear_cross_entropy.default,
                          (x.requires_grad_(), weight.requires_grad_(), b, target, IGNORE, 0.0, 0.0, 0.0, 1, None, 4),
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))


def test_cpu_compiles_fullgraph():
    x, weight, b, target = problem("cpu", torch.float32)
    w = weight.clone().requires_grad_()

    def step(x, w):
        return linear_cross_entropy(torch.tanh(x), w, target, b, chunk_size=8)

    compiled = torch.compile(step, fullgraph=True)
    loss = compiled(x, w)
    loss.backward()
    w_ref = weight.clone().requires_grad_()
    ref = step(x, w_ref)
    ref.backward()
    assert rel_err(loss, ref) <= 1e-6 and rel_err(w.grad, w_ref.grad) <= 1e-5


# ---- CUDA: the core's rows kernel (vectorised rows and the scalar path of odd vocabularies) ----

@pytest.mark.cuda
@pytest.mark.parametrize("vocab", [64, 50, 1003])
@pytest.mark.parametrize("feature", ["plain", "all"])
@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64], ids=str)
def test_cuda_matches_float64_reference(dtype, reduction, feature, vocab, no_tf32):
    check_against_reference("cuda", dtype, reduction, feature, chunk_size=16, n=70, d=40, vocab=vocab)


@pytest.mark.cuda
def test_cuda_rows_kernel_equals_the_cpu_reference_per_row():
    # one chunk, the same bf16 logits on both devices: loss and gradient from the rows kernel
    x, weight, b, target = problem("cpu", torch.bfloat16, n=64, d=64, vocab=4000)
    cpu = OPS.linear_cross_entropy_forward(x, weight, b, target, IGNORE, 0.05, 1e-3, 5.0, 0, None, 64,
                                           [True, True, True])
    cuda = OPS.linear_cross_entropy_forward(x.cuda(), weight.cuda(), b.cuda(), target.cuda(), IGNORE, 0.05, 1e-3, 5.0,
                                            0, None, 64, [True, True, True])
    assert rel_err(cuda[0].cpu(), cpu[0]) <= 1e-3  # the logits GEMM's bf16 rounding may differ by one unit
    assert rel_err(cuda[1].cpu(), cpu[1]) <= 1e-3
    for got, want in zip(cuda[2:], cpu[2:]):
        assert rel_err(got.cpu(), want) <= 2 * torch.finfo(torch.bfloat16).eps


@pytest.mark.cuda
@pytest.mark.parametrize("offset", [0, 1], ids=["vectors", "unaligned"])
@pytest.mark.parametrize("g", [1 / 3, 1.0, -2.5])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64], ids=str)
def test_cuda_scale_grads_rounds_once(dtype, g, offset):
    # the core's in-place kernel (the reference for float64): t * g in fp32 rounded once, byte for
    # byte (PyTorch's CUDA t.mul_(g) would round g to t's dtype first), g read on the device,
    # nothing outside the tensors written; 3M elements run the grid-stride loop
    n = 3 * 2 ** 20 + 8
    flat = torch.randn(n + 16, device="cuda", dtype=dtype)
    a = flat[offset:offset + n - (3 if offset else 0)]
    b = torch.randn(1000, device="cuda", dtype=dtype)
    loss_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    gt = torch.tensor(g, device="cuda", dtype=loss_dtype)
    outside = torch.cat([flat[:offset], flat[offset + a.numel():]]).clone()
    want = [scaled(a, gt), scaled(b, gt)]
    OPS.linear_cross_entropy_scale_grads_([a, b], gt)
    assert_same_bytes(a, want[0])
    assert_same_bytes(b, want[1])
    assert_same_bytes(torch.cat([flat[:offset], flat[offset + a.numel():]]), outside)


@pytest.mark.cuda
def test_cuda_out_of_range_target_is_an_error():
    x, weight, b, target = problem("cuda", torch.bfloat16)
    target[3] = 50
    with pytest.raises(ValueError, match="got 50 at row 3"):
        linear_cross_entropy(x, weight, target, b)


@pytest.mark.cuda
def test_cuda_never_holds_the_logits():
    n, d, vocab = 4096, 256, 32768
    x = torch.randn(n, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(vocab, d, device="cuda", dtype=torch.bfloat16) / 16).requires_grad_()
    target = torch.randint(0, vocab, (n,), device="cuda")
    chunk = 512
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    linear_cross_entropy(x, w, target, chunk_size=chunk).backward()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    logits_bytes = n * vocab * 2
    grads = (x.numel() + w.numel()) * 2
    # the gradients, one chunk of logits and small vectors: far from the [n, vocab] logits
    assert peak <= grads + chunk * vocab * 2 + (8 << 20), (peak, logits_bytes)
    assert peak < logits_bytes / 2
