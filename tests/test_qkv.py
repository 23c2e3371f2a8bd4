"""FusedQKV: an attention's q / k / v projections as one GEMM (fuse_qkv_projections,
convert_model(fuse_qkv=True)). On real transformers models (random init, small configs, CPU,
float64, where the CPU kernels are the float64 reference): outputs and gradients equal to the
unconverted model's, one GEMM per attention, state-dict names and checkpoints unchanged, and the
fallbacks of ``project`` (another input, a part asked twice, an input changed in place) correct.
The reference is plain F.linear over the original q / k / v weights, never the stacked layer."""
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fused_dense
from fused_dense import FusedQKV, QKVPart, convert_model, fuse_qkv_projections

transformers = pytest.importorskip("transformers")

from test_convert import SMALL, gpt2, llama_family, llama_with_biases  # noqa: E402


def build(kind):
    if kind == "llama_bias":
        return llama_with_biases()
    if kind == "qwen3":  # q_norm / k_norm after the projections
        return transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**SMALL, head_dim=16))
    return llama_family(kind)  # llama, mistral, qwen2 (q / k / v with biases), gemma


def prepared(kind):
    torch.manual_seed(0)
    model = build(kind).to(torch.float64).eval()
    return model, copy.deepcopy(model)


def grads_by_model_names(model):
    """Every parameter's gradient under the unconverted model's names: a FusedQKV's stacked
    gradient split into its attention's q_proj / k_proj / v_proj; a FusedGatedMLP's kept packed."""
    out = {}
    for module_name, module in model.named_modules():
        prefix = f"{module_name}." if module_name else ""
        for n, p in module.named_parameters(recurse=False):
            out[prefix + n] = p.grad
        if isinstance(module, FusedQKV):
            parent = module_name.rpartition(".")[0]
            for kind in ("weight", "bias"):
                t = getattr(module, kind)
                if t is not None:
                    for name, g in zip(("q_proj", "k_proj", "v_proj"), t.grad.split(module.out_splits)):
                        out[f"{parent}.{name}.{kind}"] = g
    return out


def run(model, ids, forward=None):
    model.zero_grad(set_to_none=True)
    logits = (model if forward is None else forward)(input_ids=ids).logits
    logits.backward(torch.ones_like(logits) / logits.numel() ** 0.5)
    return logits.detach(), grads_by_model_names(model)


def assert_same(ref, model, ids):
    (y_ref, g_ref), (y, g) = run(ref, ids), run(model, ids)
    assert torch.allclose(y, y_ref, rtol=1e-10, atol=1e-12), (y - y_ref).abs().max()
    for name, want in g_ref.items():
        if name.endswith(("gate_proj.weight", "up_proj.weight")):
            continue  # a FusedGatedMLP's packed weight (its gradients: tests/test_convert.py)
        assert name in g, name
        assert torch.allclose(g[name], want, rtol=1e-10, atol=1e-12), name


IDS = torch.randint(0, 97, (2, 11), generator=torch.Generator().manual_seed(5))


@pytest.mark.parametrize("kind", ["llama", "mistral", "qwen2", "qwen3", "gemma"])
def test_families_fuse_and_compute_the_same(kind):
    ref, model = prepared(kind)
    keys = set(model.state_dict())
    report = convert_model(model, fuse_qkv=True)
    fused = [n for n, _, now in report.converted if now.startswith("FusedQKV")]
    assert fused == [f"model.layers.{i}.self_attn" for i in range(2)], report
    attn = model.model.layers[0].self_attn
    assert isinstance(attn.qkv_proj, FusedQKV) and all(isinstance(getattr(attn, f"{p}_proj"), QKVPart) for p in "qkv")
    heads = attn.head_dim
    assert attn.qkv_proj.out_splits == (4 * heads, 2 * heads, 2 * heads)
    # the projections were not converted one by one as well
    assert not any(n.endswith(("q_proj", "k_proj", "v_proj")) for n, _, _ in report.converted)
    assert set(model.state_dict()) == keys
    model.train(), ref.train()
    assert_same(ref, model, IDS)
    # checkpoints load both ways under the model's own names, the same values byte for byte
    for (n, a), b in zip(ref.state_dict().items(), [model.state_dict()[n] for n in ref.state_dict()]):
        assert torch.equal(a, b), n
    fresh = copy.deepcopy(ref)
    fresh.load_state_dict(model.state_dict())
    model.load_state_dict(ref.state_dict())
    assert_same(fresh, model, IDS)


def test_one_gemm_per_attention_and_nothing_held_after():
    ref, model = prepared("llama")
    convert_model(model, fuse_qkv=True)
    calls = []
    for layer in model.model.layers:
        layer.self_attn.qkv_proj.register_forward_hook(lambda m, i, o: calls.append(m))
    model.train()
    run(model, IDS)
    assert len(calls) == 2 and calls[0] is not calls[1]
    assert all(layer.self_attn.qkv_proj._pending is None for layer in model.model.layers)


def stacked_reference(layers, x):
    return [F.linear(x, layer.weight, layer.bias) for layer in layers]


def attention_like(bias=True, widths=(32, 16, 16), d=24):
    torch.manual_seed(1)
    attn = nn.Module()
    for name, n in zip(("q_proj", "k_proj", "v_proj"), widths):
        setattr(attn, name, nn.Linear(d, n, bias=bias, dtype=torch.float64))
    return attn


def test_project_fallbacks_are_correct():
    """Parts of one input from one GEMM; another input, a part asked twice, or an input changed
    in place in between gets a fresh GEMM, never a stale part."""
    attn = attention_like()
    plain = [copy.deepcopy(getattr(attn, n)) for n in ("q_proj", "k_proj", "v_proj")]
    fused = fuse_qkv_projections(attn)
    gemms = []
    fused.register_forward_hook(lambda m, i, o: gemms.append(1))
    x = torch.randn(5, 24, dtype=torch.float64)
    y = torch.randn(5, 24, dtype=torch.float64)
    want_x, want_y = stacked_reference(plain, x), stacked_reference(plain, y)
    q, k, v = attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)
    assert len(gemms) == 1
    for got, want in zip((q, k, v), want_x):
        assert torch.allclose(got, want, rtol=1e-12, atol=1e-12)
    # cross attention: q of x, k / v of y
    q, k, v = attn.q_proj(x), attn.k_proj(y), attn.v_proj(y)
    assert len(gemms) == 3
    assert torch.allclose(q, want_x[0], rtol=1e-12, atol=1e-12)
    assert torch.allclose(k, want_y[1], rtol=1e-12, atol=1e-12) and torch.allclose(v, want_y[2], rtol=1e-12,
                                                                                       atol=1e-12)
    # a part asked twice: a new tensor, not the one handed out before
    fused._pending = None
    a, b = attn.q_proj(x), attn.q_proj(x)
    assert a is not b and torch.equal(a, b)
    # x changed in place between the parts: k is x's new projection
    fused._pending = None
    x2 = x.clone()
    attn.q_proj(x2)
    x2.mul_(2)
    assert torch.allclose(attn.k_proj(x2), want_x[1] * 2 - plain[1].bias, rtol=1e-12, atol=1e-12)
    # inference tensors (no version counter)
    fused._pending = None
    with torch.inference_mode():
        xi = x.clone()
        parts = [attn.q_proj(xi), attn.k_proj(xi), attn.v_proj(xi)]
    for got, want in zip(parts, want_x):
        assert torch.allclose(got, want, rtol=1e-12, atol=1e-12)


def test_parts_gradients_join_in_one_backward():
    attn = attention_like(bias=True)
    plain = [copy.deepcopy(getattr(attn, n)) for n in ("q_proj", "k_proj", "v_proj")]
    fused = fuse_qkv_projections(attn)
    x = torch.randn(7, 24, dtype=torch.float64, requires_grad=True)
    xr = x.detach().clone().requires_grad_()
    outs = [attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)]
    refs = stacked_reference(plain, xr)
    dys = [torch.randn_like(o) for o in outs]
    torch.autograd.backward(outs, dys)
    torch.autograd.backward(refs, dys)
    assert torch.allclose(x.grad, xr.grad, rtol=1e-12, atol=1e-12)
    assert torch.allclose(fused.weight.grad, torch.cat([p.weight.grad for p in plain]), rtol=1e-12, atol=1e-12)
    assert torch.allclose(fused.bias.grad, torch.cat([p.bias.grad for p in plain]), rtol=1e-12, atol=1e-12)
    # k / v alone (q not used): their gradients still reach the stacked weight's rows, q's rows are zero
    fused.zero_grad(set_to_none=True)
    attn.q_proj(x), attn.k_proj(x)
    attn.v_proj(x).sum().backward()
    rows = fused.weight.grad.split(fused.out_splits)
    assert torch.count_nonzero(rows[0]) == 0 and torch.count_nonzero(rows[1]) == 0 and torch.count_nonzero(rows[2])


def test_parts_look_like_the_projections():
    attn = attention_like()
    plain = [copy.deepcopy(getattr(attn, n)) for n in ("q_proj", "k_proj", "v_proj")]
    fuse_qkv_projections(attn)
    for part, layer in zip((attn.q_proj, attn.k_proj, attn.v_proj), plain):
        assert (part.in_features, part.out_features) == (layer.in_features, layer.out_features)
        assert torch.equal(part.weight, layer.weight) and torch.equal(part.bias, layer.bias)
        assert not part.weight.requires_grad and list(part.parameters()) == []
    # moved and cast with the attention: the parts read the stacked parameters wherever they are
    attn.float()
    assert attn.k_proj.weight.dtype == torch.float32 and attn.qkv_proj.weight.dtype == torch.float32
    clone = copy.deepcopy(attn)
    assert clone.v_proj._fused is clone.qkv_proj and clone.qkv_proj is not attn.qkv_proj


def test_state_dict_errors_name_the_keys():
    attn = attention_like()
    state = copy.deepcopy(attn.state_dict())
    fuse_qkv_projections(attn)
    assert set(attn.state_dict()) == set(state)
    partial = {k: v for k, v in state.items() if not k.startswith("v_proj.")}
    with pytest.raises(RuntimeError, match=r"must be loaded together .*got only \['q_proj.weight', 'k_proj.weight'\]"):
        attn.load_state_dict(partial)
    bad = dict(state)
    bad["k_proj.weight"] = torch.zeros(17, 24, dtype=torch.float64)
    with pytest.raises(RuntimeError, match=r"k_proj.weight: expected shape \(16, 24\), got \(17, 24\)"):
        attn.load_state_dict(bad)
    # the stacked names load too
    stacked = {"qkv_proj.weight": torch.cat([state[f"{p}_proj.weight"] for p in "qkv"]),
               "qkv_proj.bias": torch.cat([state[f"{p}_proj.bias"] for p in "qkv"])}
    attn.load_state_dict(stacked)
    assert all(torch.equal(attn.state_dict()[k], v) for k, v in state.items())


def test_bad_arguments_are_clear():
    with pytest.raises(ValueError, match=r"out_splits must be three widths >= 1"):
        FusedQKV(8, (4, 4))
    with pytest.raises(ValueError, match=r"out_splits must be three widths >= 1"):
        FusedQKV(8, (4, 0, 4))
    mixed = attention_like()
    mixed.k_proj = nn.Linear(24, 16, bias=False, dtype=torch.float64)
    with pytest.raises(ValueError, match="some of q_proj, k_proj, v_proj have a bias and some not"):
        fuse_qkv_projections(mixed)
    other = attention_like()
    other.v_proj = nn.Linear(24, 16, dtype=torch.float32)
    with pytest.raises(ValueError, match="differ in input width, dtype or device"):
        fuse_qkv_projections(other)
    with pytest.raises(ValueError, match="not all nn.Linear"):
        fuse_qkv_projections(nn.Module())


def test_converter_reports_and_module_filter():
    """A self_attn that cannot be fused is reported with the reason; one the filter refuses keeps
    its projections as candidates (converted one by one where the rules convert them)."""
    model = nn.Module()
    model.self_attn = attention_like()
    model.self_attn.k_proj = nn.Linear(24, 16, bias=False, dtype=torch.float64)
    report = convert_model(model, fuse_qkv=True)
    left = {n: why for n, _, why in report.left}
    assert "bias and some not" in left["self_attn"]
    assert ("self_attn.q_proj", "Linear", "FusedDense") in report.converted
    _, model = prepared("qwen2")
    report = convert_model(model, fuse_qkv=True, module_filter=lambda name, m: not name.endswith("self_attn"))
    assert not any(now.startswith("FusedQKV") for _, _, now in report.converted)
    assert ("model.layers.0.self_attn.q_proj", "Linear", "FusedDense") in report.converted
    # a model without such attentions (GPT-2: one c_attn) says so
    report = convert_model(gpt2(), fuse_qkv=True)
    assert ("fuse_qkv", "q / k / v", "no module named self_attn with nn.Linear q_proj, k_proj, v_proj") in report.left
    # converting again finds the fused attention converted already
    _, model = prepared("llama")
    convert_model(model, fuse_qkv=True)
    with pytest.raises(ValueError, match="found nothing to convert"):
        convert_model(model, fuse_qkv=True)


def test_fp8_size_rule_reads_the_stacked_width():
    """GQA's narrow k / v (32 wide here) below the recipe's min_features run in FP8 once stacked
    with q (64 + 32 + 32); the parts equal the stacked FP8 output's slices bit for bit."""
    _, model = prepared("llama")
    model.float()
    recipe = fused_dense.Float8Recipe(scaling="current", min_features=48)
    convert_model(model, fp8=recipe, fuse_qkv=True)
    attn = model.model.layers[0].self_attn
    assert attn.qkv_proj.fp8 is recipe and attn.qkv_proj._fp8_recipe() is recipe
    x = torch.randn(2, 5, 64)
    attn.train()
    whole = attn.qkv_proj(x)
    parts = [attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)]
    for got, want in zip(parts, whole.split(attn.qkv_proj.out_splits, -1)):
        assert torch.equal(got, want)


@pytest.mark.parametrize("reentrant", [False, True])
def test_gradient_checkpointing_bit_for_bit(reentrant):
    _, model = prepared("llama_bias")
    convert_model(model, fuse_qkv=True)
    plain = copy.deepcopy(model)
    model.train(), plain.train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    (y_a, g_a), (y_b, g_b) = run(model, IDS), run(plain, IDS)
    assert torch.equal(y_a, y_b) and g_a.keys() == g_b.keys()
    assert all(torch.equal(g_a[n], g_b[n]) for n in g_a)
    assert all(layer.self_attn.qkv_proj._pending is None for layer in model.model.layers)


def test_save_pretrained_and_generate(tmp_path):
    ref, model = prepared("llama_bias")
    convert_model(model, fuse_qkv=True)
    model.save_pretrained(tmp_path / "converted")
    loaded = type(ref).from_pretrained(tmp_path / "converted", dtype=torch.float64)
    for (n, a), (m, b) in zip(sorted(ref.state_dict().items()), sorted(loaded.state_dict().items())):
        assert n == m and torch.equal(a, b), n
    ids = torch.randint(0, 97, (1, 5), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        a = ref.generate(ids, max_new_tokens=8, do_sample=False)
        b = model.generate(ids, max_new_tokens=8, do_sample=False)
    assert torch.equal(a, b), (a, b)


def test_compiled_fullgraph_computes_the_same():
    """(No graph break: tests/test_convert.py, test_compiles_fullgraph_with_no_break.)"""
    ref, model = prepared("llama_bias")
    convert_model(model, fuse_qkv=True)
    ids = torch.randint(0, 97, (2, 7), generator=torch.Generator().manual_seed(7))
    # compiled forward + backward against the unconverted model compiled (both take LlamaRMSNorm's
    # float32 step the same way; on the CPU Inductor's float64 SDPA backward fails, hence eager
    # attention)
    for m in (ref, model):
        m.config._attn_implementation = "eager"
        m.train()
    y, g = run(model, ids, torch.compile(model, fullgraph=True))
    torch._dynamo.reset()
    y_ref, g_ref = run(ref, ids, torch.compile(ref, fullgraph=True))
    assert torch.allclose(y, y_ref, rtol=1e-12, atol=1e-14), (y - y_ref).abs().max()
    for n in g_ref:
        if not n.endswith(("gate_proj.weight", "up_proj.weight")):  # FusedGatedMLP's packed weight
            assert torch.allclose(g[n], g_ref[n], rtol=1e-12, atol=1e-14), n
    assert all(layer.self_attn.qkv_proj._pending is None for layer in model.model.layers)
    torch._dynamo.reset()


def test_fp8_compiled_step_runs_fullgraph():
    """FP8 (current scaling) with the norms' hand-off and FusedQKV, compiled fullgraph: the traced
    input quantize feeds the stacked layer; the loss agrees with the eager step's (measured 2e-5
    relative: the eager norm rounds once, Hugging Face's norm under compile twice, and FP8 carries
    the difference on; the gradients differ by FP8's noise alike with q / k / v unfused) and every
    parameter gets a finite gradient."""
    torch.manual_seed(0)
    base = build("llama").to(torch.bfloat16)
    base.config._attn_implementation = "eager"
    convert_model(base, fp8=fused_dense.Float8Recipe(scaling="current", min_features=0), fuse_qkv=True)
    eager, model = base, copy.deepcopy(base)
    ids = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(3))
    losses = []
    for m, fwd in ((eager, eager), (model, torch.compile(model, fullgraph=True))):
        m.train()
        m.zero_grad(set_to_none=True)
        loss = fwd(input_ids=ids, labels=ids).loss
        loss.backward()
        losses.append(loss.detach().float())
        assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in m.parameters())
    assert abs(losses[1] - losses[0]) <= 1e-3 * losses[0], losses
    assert all(layer.self_attn.qkv_proj._pending is None for layer in model.model.layers)
    torch._dynamo.reset()


def test_meta_device_models_fuse():
    with torch.device("meta"):
        model = build("llama_bias")
    real = build("llama_bias")
    a, b = convert_model(model, fuse_qkv=True), convert_model(real, fuse_qkv=True)
    assert a.converted == b.converted
    assert all(p.device.type == "meta" for p in model.parameters())
    assert set(model.state_dict()) == set(real.state_dict())
