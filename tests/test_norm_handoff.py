"""FusedRMSNorm and FusedLayerNorm (fused_dense/norm.py): Hugging Face's LlamaRMSNorm and
nn.LayerNorm by default; with fp8_handoff their FP8 output copy reaches the FP8 layers that read it
(fused_dense.fp8.hand_off), and they compute the same bits as when they quantize that output
themselves."""
import copy
import functools

import pytest
import torch

import fused_dense
from conftest import rel_err
from fused_dense import Float8Recipe, FusedDense, FusedGatedMLP, FusedMLP, convert_model
from fused_dense.norm import FusedLayerNorm, FusedRMSNorm

transformers = pytest.importorskip("transformers")

C = 64
RECIPE = Float8Recipe(scaling="current", min_features=0)


@pytest.fixture
def hits(monkeypatch):
    """Counts the FP8 layers that took handed-over copies."""
    count = {"n": 0}
    real = fused_dense.fp8.quantized_copies

    def counting(*args, **kwargs):
        copies = real(*args, **kwargs)
        count["n"] += bool(copies)
        return copies

    monkeypatch.setattr(fused_dense.fp8, "quantized_copies", counting)
    return count


def stack(dtype=torch.bfloat16, layer_norm=False):
    if layer_norm:
        norm = FusedLayerNorm(C, 1e-5, fp8_handoff=True, dtype=dtype)
        with torch.no_grad():
            norm.bias.normal_(0, 0.1)
    else:
        norm = FusedRMSNorm(C, 1e-5, fp8_handoff=True, dtype=dtype)
    with torch.no_grad():
        norm.weight.normal_(1, 0.1)
    layers = [FusedDense(C, 32, bias=False, dtype=dtype, fp8=RECIPE), FusedDense(C, 48, dtype=dtype, fp8=RECIPE),
              FusedGatedMLP(C, 48, dtype=dtype, fp8=RECIPE), FusedMLP(C, 64, dtype=dtype, fp8=RECIPE)]
    return norm, layers


def run(norm, layers, x, fresh_copy):
    h = norm(x)
    if fresh_copy:
        h = h.clone()  # another tensor: nothing handed over, the layers quantize it themselves
    loss = sum((layer(h).float() * (i + 1)).square().mean() for i, layer in enumerate(layers))
    params = [x, norm.weight] + [p for layer in layers for p in layer.parameters()]
    return loss, torch.autograd.grad(loss, params)


@pytest.mark.parametrize("layer_norm", [False, True], ids=["rms", "layer"])
def test_handed_copies_give_the_same_bits(hits, layer_norm):
    norm, layers = stack(layer_norm=layer_norm)
    x = torch.randn(3, 20, C, dtype=torch.bfloat16, requires_grad=True)
    loss, grads = run(norm, layers, x, fresh_copy=False)
    assert hits["n"] == 4
    loss2, grads2 = run(norm, layers, x, fresh_copy=True)
    assert hits["n"] == 4
    if layer_norm:
        assert len(grads) == len(grads2) and grads[2] is not None  # the bias is among the parameters
    assert torch.equal(loss, loss2)
    for a, b in zip(grads, grads2):
        assert torch.equal(a, b)


def test_in_place_change_voids_the_copies(hits):
    norm, layers = stack()
    x = torch.randn(40, C, dtype=torch.bfloat16)
    with torch.no_grad():
        h = norm.train()(x)
        h.mul_(2)
        layers[0](h)
    assert hits["n"] == 0


def test_delayed_scaling_and_eval_take_no_copies(hits):
    norm, layers = stack()
    x = torch.randn(40, C, dtype=torch.bfloat16)
    delayed = FusedDense(C, 32, dtype=torch.bfloat16, fp8=Float8Recipe(scaling="delayed", min_features=0))
    delayed(norm(x))
    norm.eval()
    layers[0](norm(x))
    norm.train()
    with torch.autocast("cpu", dtype=torch.bfloat16):  # the layers read a cast of an fp32 output
        out = FusedRMSNorm(C, fp8_handoff=True)(x.float())
        layers[0](out)
    assert hits["n"] == 0
    # and the norm made no copies for it (its output, read as it is, finds none)
    assert fused_dense.fp8.quantized_copies(out, out, RECIPE, out.reshape(-1, C), True) == []


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_without_handoff_it_is_llamas_norm(dtype):
    ref = transformers.models.llama.modeling_llama.LlamaRMSNorm(C, eps=1e-5).to(dtype)
    with torch.no_grad():
        ref.weight.normal_(1, 0.1)
    ours = fused_dense.norm.fused_rms_norm_from(ref, fp8_handoff=False)
    assert ours.weight is ref.weight
    x = torch.randn(5, 7, C, dtype=dtype)
    assert torch.equal(ours(x), ref(x))


def test_handoff_output_and_gradients():
    norm, _ = stack(torch.bfloat16)
    x = torch.randn(50, C, dtype=torch.bfloat16, requires_grad=True)
    out = norm(x)
    xd, wd = x.detach().double().requires_grad_(), norm.weight.detach().double().requires_grad_()
    ref = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-5) * wd
    u = torch.finfo(torch.bfloat16).eps / 2
    assert rel_err(out, ref) <= 0.6 * u  # one rounding from fp32 (0.44 u measured)
    g = torch.randn_like(out)
    got = torch.autograd.grad(out, (x, norm.weight), g)
    want = torch.autograd.grad(ref, (xd, wd), g.double())
    for a, b in zip(got, want):
        assert rel_err(a, b) <= u  # 0.48 u measured (tests/test_norm_fp8.py)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_layer_norm_without_handoff_is_nn_layer_norm(dtype, bias):
    ref = torch.nn.LayerNorm(C, eps=1e-5, bias=bias, dtype=dtype)
    with torch.no_grad():
        ref.weight.normal_(1, 0.1)
        if bias:
            ref.bias.normal_(0, 0.1)
    ours = fused_dense.norm.fused_layer_norm_from(ref, fp8_handoff=False)
    assert isinstance(ours, torch.nn.LayerNorm) and ours.weight is ref.weight and ours.bias is ref.bias
    assert ours.state_dict().keys() == ref.state_dict().keys()
    x = torch.randn(5, 7, C, dtype=dtype)
    assert torch.equal(ours(x), ref(x))
    assert fused_dense.norm.fused_layer_norm_from(torch.nn.LayerNorm((4, C)), fp8_handoff=True) is None
    assert fused_dense.norm.fused_layer_norm_from(torch.nn.LayerNorm(C, elementwise_affine=False), True) is None
    with pytest.raises(ValueError, match="normalized_shape must be one width"):
        FusedLayerNorm((4, C))


@pytest.mark.parametrize("bias", [True, False])
def test_layer_norm_handoff_output_and_gradients(bias):
    norm = FusedLayerNorm(C, 1e-5, bias=bias, fp8_handoff=True, dtype=torch.bfloat16)
    with torch.no_grad():
        norm.weight.normal_(1, 0.1)
        if bias:
            norm.bias.normal_(0, 0.1)
    x = (torch.randn(50, C) * 2 + 0.7).to(torch.bfloat16).requires_grad_()
    out = norm(x)
    params = [x, norm.weight] + ([norm.bias] if bias else [])
    refs = [p.detach().double().requires_grad_() for p in params]
    ref = torch.nn.functional.layer_norm(refs[0], (C,), refs[1], refs[2] if bias else None, 1e-5)
    u = torch.finfo(torch.bfloat16).eps / 2
    assert rel_err(out, ref) <= 0.6 * u  # one rounding from fp32
    g = torch.randn_like(out)
    got = torch.autograd.grad(out, params, g)
    want = torch.autograd.grad(ref, refs, g.double())
    for a, b in zip(got, want):
        assert rel_err(a, b) <= u


def tiny_gpt2(d=C):
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=97, n_embd=d, n_layer=2, n_head=4, n_positions=64)
    return transformers.GPT2LMHeadModel(cfg).to(torch.bfloat16).train()


def test_convert_model_hands_gpt2s_layer_norms_over(hits):
    model = tiny_gpt2()
    report = convert_model(model, fp8=RECIPE)
    converted = {n for n, _, what in report.converted if what.startswith("FusedLayerNorm")}
    assert converted == {f"transformer.h.{i}.{n}" for i in range(2) for n in ("ln_1", "ln_2")}
    assert isinstance(model.transformer.ln_f, torch.nn.LayerNorm) and not isinstance(model.transformer.ln_f,
                                                                                     FusedLayerNorm)
    ids = torch.randint(0, 97, (2, 16))
    model(input_ids=ids, labels=ids).loss.backward()
    # per block: c_attn from ln_1, the MLP from ln_2
    assert hits["n"] == 2 * 2


def test_convert_model_leaves_norms_whose_layers_stay_bf16():
    model = tiny_gpt2()
    report = convert_model(model, fp8=Float8Recipe(scaling="current", min_features=2 * C))
    assert not any(what.startswith("Fused") and "Norm" in what for _, _, what in report.converted)
    left = {n: why for n, _, why in report.left}
    assert "min_features 128" in left["transformer.h.0.ln_1"]


def tiny_llama():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=97, hidden_size=C, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return transformers.LlamaForCausalLM(cfg).to(torch.bfloat16).train()


@pytest.mark.parametrize("fuse_qkv", [False, True])
def test_convert_model_hands_the_decoder_norms_over(hits, fuse_qkv):
    model = tiny_llama()
    report = convert_model(model, fp8=RECIPE, fuse_qkv=fuse_qkv)
    converted = {n for n, _, what in report.converted if what.startswith("FusedRMSNorm")}
    assert converted == {f"model.layers.{i}.{n}" for i in range(2) for n in ("input_layernorm",
                                                                              "post_attention_layernorm")}
    assert type(model.model.norm).__name__ == "LlamaRMSNorm"  # the final norm feeds the bf16 LM head
    assert "model.layers.0.input_layernorm.weight" in model.state_dict()
    ids = torch.randint(0, 97, (2, 16))
    model(input_ids=ids, labels=ids).loss.backward()
    # per layer: q, k, v (or the one FusedQKV) from the first norm, the MLP from the second
    assert hits["n"] == 2 * (2 if fuse_qkv else 4)


def test_convert_model_keeps_the_norms_without_current_scaling():
    for fp8 in (None, Float8Recipe(scaling="delayed", min_features=0)):
        model = tiny_llama()
        report = convert_model(model, fp8=fp8)
        assert not any(what.startswith("FusedRMSNorm") for _, _, what in report.converted)


def test_converted_model_close_to_unconverted():
    model = tiny_llama()
    ref = tiny_llama()
    ref.load_state_dict(model.state_dict())
    convert_model(model, fp8=RECIPE)
    ids = torch.randint(0, 97, (2, 16))
    loss, ref_loss = model(input_ids=ids, labels=ids).loss, ref(input_ids=ids, labels=ids).loss
    # FP8 (e4m3) activations and weights at this size: within 1% of the bf16 model's loss
    assert abs(loss.item() - ref_loss.item()) <= 0.01 * ref_loss.item()


@pytest.mark.parametrize("scale", [None, 3.7, 200.0], ids=["current", "delayed", "delayed_saturating"])
@pytest.mark.parametrize("columnwise", [True, False])
@pytest.mark.parametrize("rows", [40, 37, 0])  # 0: an empty batch, amax 0 as the op's
@pytest.mark.parametrize("cols", [C, 24])  # 24: not a multiple of 16, the transposed copy traced
def test_traced_quantize_gives_fp8_quantizes_bytes(rows, cols, columnwise, scale):
    x = torch.randn(rows, cols, dtype=torch.bfloat16) * 5
    if rows:
        x[3, 4] = 0.0
    s = None if scale is None else torch.tensor([scale], dtype=torch.float32)
    want = torch.ops.fused_dense.fp8_quantize(x, None, 0, False, 0, s, True, columnwise, False)
    got = fused_dense.fp8.traced_quantize(x, columnwise, None if s is None else s[0])
    for i, (a, b) in enumerate(zip(got, (want[0], want[1], want[3], want[4]))):
        assert a.shape == b.shape and a.dtype == b.dtype, i
        assert torch.equal(a.view(torch.uint8) if a.dtype == torch.float8_e4m3fn else a,
                           b.view(torch.uint8) if b.dtype == torch.float8_e4m3fn else b), i
    tiny = fused_dense.fp8.traced_quantize(torch.full((16, C), 1e-30, dtype=torch.float32), False)
    assert tiny[2].item() == pytest.approx(ops_min_amax() / 448.0)


@pytest.mark.parametrize("compiled", [False, True])
def test_traced_quantize_scales_are_the_ops_at_every_amax(compiled):
    """The traced quantize's scale_inv (and bytes) are fp8_quantize's for tensors of many amaxes,
    eager and under torch.compile, amaxes at and below the rule's clamp included: its scale is the
    scaling rule divided in float64 (fused_dense.fp8.scale_from_amax), not a float32 division
    that PyTorch (448 / amax: a reciprocal and a product) or Inductor rounds otherwise (a scale
    one ulp off changed the compiled layers' weight gradients at some seeds)."""
    traced = fused_dense.fp8.traced_quantize
    fn = torch.compile(traced, fullgraph=True, dynamic=False) if compiled else traced
    g = torch.Generator().manual_seed(11)
    amaxes = torch.exp(torch.empty(40 if compiled else 300, dtype=torch.float64).uniform_(-10, 10, generator=g))
    for a in [3.421875, 0.0, 1e-30, 1e-12, 448.0] + amaxes.float().tolist():
        x = torch.randn(32, C, generator=g).clamp(-1, 1) * a
        x[7, 3] = a
        want = torch.ops.fused_dense.fp8_quantize(x, None, 0, False, 0, None, True, True, False)
        got = fn(x, True)
        assert torch.equal(got[2], want[3]), (a, got[2].item(), want[3].item())
        assert torch.equal(got[0].view(torch.uint8), want[0].view(torch.uint8)), a
        assert torch.equal(got[1].view(torch.uint8), want[1].view(torch.uint8)), a


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
@pytest.mark.parametrize("compiled", [False, True])
def test_delayed_scales_follow_the_scaling_rule_at_every_amax(device, compiled):
    """Delayed scaling's scales (fused_dense.fp8.delayed_scales) are the scaling rule's for the
    history's amaxes, bit for bit the op fp8_scales's (what fp8_quantize takes from an amax, the
    rule's clamp at FP8_MIN_AMAX included), eager and under torch.compile: a float32 division
    there is Inductor's, which on the GPU is not correctly rounded."""
    recipe = Float8Recipe(scaling="delayed", min_features=0, amax_history_len=1)
    layer = FusedMLP(C, 2 * C, device=device, dtype=torch.bfloat16, fp8=recipe)
    slots = fused_dense.fp8.MLP_SLOTS
    formats = [fused_dense.ops.FP8_FORMATS["e4m3" if s in ("x", "act") else recipe.grad_format] for s in slots]
    derive = functools.partial(fused_dense.fp8.delayed_scales, layer, recipe, slots)
    fn = torch.compile(derive, fullgraph=True, dynamic=False) if compiled else derive
    g = torch.Generator().manual_seed(12)
    amaxes = torch.exp(torch.empty(4 * (30 if compiled else 200), dtype=torch.float64).uniform_(-40, 40, generator=g))
    amaxes = torch.cat([torch.tensor([3.421875, 1e-13, 1e-12, 448.0]), amaxes.float()]).view(-1, 4)
    for row in amaxes:
        with torch.no_grad():
            layer.fp8_amax.copy_(row)
        got = fn()
        want = torch.stack([torch.ops.fused_dense.fp8_scales(a.reshape(()).to(device), False, f)[0]
                            for a, f in zip(row, formats)])
        assert torch.equal(got, want), (row.tolist(), got.tolist(), want.tolist())
    # where no finite positive amax is recorded the scale is kept
    with torch.no_grad():
        layer.fp8_amax.copy_(torch.tensor([0.0, float("nan"), float("inf"), 2.0]))
    kept = layer.fp8_scales.clone()
    got = fn()
    assert torch.equal(got[:3], kept[:3]) and not torch.equal(got[3], kept[3])


def ops_min_amax():
    return fused_dense.ops.FP8_MIN_AMAX


def fp8_device(device):
    if device == "cuda" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 needs a GPU of compute capability 8.9+")
    return torch.device(device)


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("scaling", ["current", "delayed"])
@pytest.mark.parametrize("mode", ["traced", "traced_rowwise", "op"])
def test_compiled_fp8_layers_match_eager(mode, scaling, device, monkeypatch):
    """Under torch.compile (fullgraph) the layers' inputs are quantized in traced PyTorch ops (or by
    the op): the same bits as eager, forward and backward; delayed scaling's traced quantize at each
    layer's x scale, with the history and amaxes the op leaves in eager. 'traced_rowwise' traces the
    row-major copy only: the ops transpose it in backward for the weight gradients."""
    device = fp8_device(device)
    recipe = Float8Recipe(scaling=scaling, min_features=0, compiled_input_quantize=mode)
    torch.manual_seed(0)
    kw = dict(dtype=torch.bfloat16, device=device, fp8=recipe)
    layers = [FusedDense(C, 32, bias=False, **kw), FusedDense(C, 48, **kw), FusedGatedMLP(C, 48, **kw)]
    if scaling == "delayed":  # a history whose scales are not 1: x's copy then differs from current scaling's
        for layer in layers:
            layer.fp8_amax.copy_(torch.rand_like(layer.fp8_amax) * 4 + 1)
            fused_dense.fp8.scaling_started(layer, True)  # amaxes recorded: not a first step
    twins = copy.deepcopy(layers)  # the compiled step starts from the same scaling state

    def step(mods, x):
        h = x * 2  # exact: a producer Inductor fuses the quantization into, the same bits as eager
        return tuple(layer(h) for layer in mods)

    x = torch.randn(40, C, dtype=torch.bfloat16, device=device, requires_grad=True)
    # the parameters' gradients (x's sums three layers' in an order Inductor picks: not compared)
    eager = step(layers, x)
    grad_outs = [torch.randn_like(y) for y in eager]
    eager_grads = torch.autograd.grad(eager, [p for m in layers for p in m.parameters()], grad_outs)
    traced = []
    real = fused_dense.fp8.traced_quantize
    monkeypatch.setattr(fused_dense.fp8, "traced_quantize", lambda *a: traced.append(a[1]) or real(*a))
    torch._dynamo.reset()
    compiled = torch.compile(functools.partial(step, twins), fullgraph=True)(x)
    compiled_grads = torch.autograd.grad(compiled, [p for m in twins for p in m.parameters()], grad_outs)
    # one per layer, traced once; the transposed copy traced only in 'traced' (the weights need grads)
    assert traced == {"traced": [True] * 3, "traced_rowwise": [False] * 3, "op": []}[mode]
    for a, b in zip(eager + eager_grads, compiled + compiled_grads):
        assert torch.equal(a, b)
    for mod, twin in zip(layers, twins):
        for name, buf in mod.named_buffers():
            assert torch.equal(buf, dict(twin.named_buffers())[name]), name


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("scaling", ["current", "delayed"])
@pytest.mark.parametrize("mode", ["traced", "traced_rowwise"])
def test_compiled_fp8_layers_take_an_empty_batch(mode, scaling, device):
    """An empty batch under torch.compile: the traced quantize's amax is 0, as the op's (amax() of
    no elements raises), and the compiled layers give eager's outputs, gradients and scaling state."""
    device = fp8_device(device)
    recipe = Float8Recipe(scaling=scaling, min_features=0, compiled_input_quantize=mode)
    torch.manual_seed(0)
    kw = dict(dtype=torch.bfloat16, device=device, fp8=recipe)
    layers = [FusedDense(C, 32, **kw), FusedGatedMLP(C, 48, **kw)]
    twins = copy.deepcopy(layers)

    def step(mods, x):
        h = x * 2
        return tuple(layer(h) for layer in mods)

    x = torch.randn(0, C, dtype=torch.bfloat16, device=device, requires_grad=True)
    eager = step(layers, x)
    grad_outs = [torch.randn_like(y) for y in eager]
    eager_grads = torch.autograd.grad(eager, [p for m in layers for p in m.parameters()], grad_outs)
    torch._dynamo.reset()
    compiled = torch.compile(functools.partial(step, twins), fullgraph=True)(x)
    compiled_grads = torch.autograd.grad(compiled, [p for m in twins for p in m.parameters()], grad_outs)
    assert [y.shape for y in compiled] == [(0, 32), (0, C)]
    for a, b in zip(eager + eager_grads, compiled + compiled_grads):
        assert a.shape == b.shape and torch.equal(a, b)
    for mod, twin in zip(layers, twins):
        for name, buf in mod.named_buffers():
            assert torch.equal(buf, dict(twin.named_buffers())[name]), name


def test_ops_name_a_bad_x_fp8():
    """x_fp8 that is not x's copies: a ValueError naming the element, the expected and the actual."""
    from fused_dense.fp8 import quantize_weight, traced_quantize
    x = torch.randn(40, C, dtype=torch.bfloat16)
    w = torch.randn(32, C, dtype=torch.bfloat16) / 8
    weights = quantize_weight(w)
    good = traced_quantize(x, True)

    def call(x_fp8):
        return torch.ops.fused_dense.fp8_dense(x, w, None, weights, 1, None, None, x_fp8)

    assert torch.isfinite(call(good)).all() and torch.isfinite(call([good[0], good[1][:0], *good[2:]])).all()
    f8 = torch.float8_e4m3fn
    cases = [
        (good[:3], r"x_fp8 must be empty or hold 4 tensors .* got 3"),
        ([good[0][:39], *good[1:]], r"x_fp8\[0\] must be x's float8_e4m3fn copy of shape \[40, 64\], got .* \[39, 64\]"),
        ([good[0], torch.zeros(C, 40, dtype=f8), *good[2:]],
         r"x_fp8\[1\] must be x's transposed float8_e4m3fn copy \[64, 48\] or empty, got .* \[64, 40\]"),
        ([*good[:2], torch.ones(2), good[3]], r"x_fp8\[2\] must be a float32 scalar \(scale_inv\), got .* \[2\]"),
        ([*good[:3], good[3].double()], r"x_fp8\[3\] must be a float32 scalar \(amax\), got Double"),
    ]
    for x_fp8, match in cases:
        with pytest.raises(ValueError, match=match):
            call(x_fp8)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", ["traced", "traced_rowwise"])
def test_compiled_fp8_layers_take_a_second_token_count(mode, device):
    """torch.compile makes the token count symbolic from a function's second count on (automatic
    dynamic shapes): the ops' checks read the traced copies' sizes symbolically (a transposed copy's
    numel() raised there), and each count gives eager's outputs and gradients."""
    device = fp8_device(device)
    recipe = Float8Recipe(scaling="current", min_features=0, compiled_input_quantize=mode)
    torch.manual_seed(0)
    kw = dict(dtype=torch.bfloat16, device=device, fp8=recipe)
    layers = [FusedDense(C, 32, **kw), FusedGatedMLP(C, 48, **kw)]

    def step(x):
        h = x * 2
        return tuple(layer(h) for layer in layers)

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True)
    params = [p for m in layers for p in m.parameters()]
    for rows in (40, 37):  # 37: the second count, and tokens not a multiple of 16
        x = torch.randn(rows, C, dtype=torch.bfloat16, device=device, requires_grad=True)
        eager = step(x)
        grad_outs = [torch.randn_like(y) for y in eager]
        want = list(eager) + list(torch.autograd.grad(eager, params, grad_outs))
        got = compiled(x)
        got = list(got) + list(torch.autograd.grad(got, params, grad_outs))
        for a, b in zip(want, got):
            assert a.shape == b.shape and torch.equal(a, b), rows


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("rows", [40, 37])  # 37: the transposed copy's tokens padded to 48
@pytest.mark.parametrize("op,lvl", [("dense", 0), ("gelu_approx", 0), ("gelu_approx", 1), ("gelu_approx", 2),
                                    ("swiglu", 0), ("swiglu", 2)])
def test_ops_transpose_x_in_backward_when_handed_its_rows_only(op, lvl, rows, device):
    """x_fp8 without its transposed copy (compiled_input_quantize='traced_rowwise'): the op keeps
    x's row-major copy and transposes it in backward for the weight gradient. The same bits as with
    the transposed copy handed over, output and every gradient."""
    from fused_dense.fp8 import quantize_weight, traced_quantize
    device = fp8_device(device)
    torch.manual_seed(1)
    kw = dict(dtype=torch.bfloat16, device=device)
    x = torch.randn(rows, C, **kw)
    hidden = 48
    if op == "dense":
        params = [torch.randn(32, C, **kw) / 8, torch.randn(32, **kw)]
    else:
        width = 2 * hidden if op == "swiglu" else hidden
        params = [torch.randn(width, C, **kw) / 8, torch.randn(width, **kw), torch.randn(C, hidden, **kw) / 8,
                  torch.randn(C, **kw)]
        if op == "swiglu":
            params[1] = None  # the gated GEMM takes no bias
    weights = [t for w in params[::2] for t in quantize_weight(w)]
    act = fused_dense.ops.mlp_activation_code(op, "any") if op != "dense" else None

    def run(x_fp8):
        xs = x.clone().requires_grad_()
        ps = [None if p is None else p.clone().requires_grad_() for p in params]
        if op == "dense":
            out = torch.ops.fused_dense.fp8_dense(xs, ps[0], ps[1], weights, 1, None, None, x_fp8)
        else:
            out = torch.ops.fused_dense.fused_mlp_fp8(xs, ps[0], ps[1], ps[2], ps[3], act, lvl, weights, 1, None,
                                                      None, x_fp8, False)
        grads = torch.autograd.grad(out, [xs] + [p for p in ps if p is not None], g_out(out))
        return [out, *grads]

    def g_out(out):
        # random, not uniform: with one gradient row for every token the weight gradient would not
        # see x's tokens reordered (the sum over tokens of a constant row times x's rows)
        gen = torch.Generator(device=out.device).manual_seed(2)
        return torch.randn(out.shape, generator=gen, device=out.device, dtype=out.dtype) / 16

    full, rows_only = traced_quantize(x, True), traced_quantize(x, False)
    assert rows_only[1].numel() == 0 and torch.equal(rows_only[0].view(torch.uint8), full[0].view(torch.uint8))
    want, got = run(full), run(rows_only)
    assert len(want) == len(got) == {"dense": 4, "gelu_approx": 6, "swiglu": 5}[op]  # out, x's grad, params' grads
    for a, b in zip(want, got):
        assert a.dtype == b.dtype and torch.equal(a, b)
    assert all(torch.isfinite(a).all() and a.abs().sum() > 0 for a in want)
