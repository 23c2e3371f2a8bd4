"""fused_dense.convert_model on real transformers models (random init, small configs, CPU, float64):
what it converts and leaves for each family it names, outputs and gradients equal to the
unconverted model's (the CPU kernels are the float64 reference, so the two agree to float64
rounding), state-dict names unchanged and checkpoints loading both ways, a tied LM head kept tied,
and its errors. transformers is in the `test` extra, so CI runs these."""
import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

from fused_dense import ConversionReport, FusedDense, FusedGatedMLP, convert_model  # noqa: E402
from fused_dense.convert import ConvertedConv1D, ConvertedMLP, ConvertedStackedGatedMLP  # noqa: E402

SMALL = dict(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64)


def llama_family(kind):
    if kind == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMALL))
    if kind == "mistral":
        return transformers.MistralForCausalLM(transformers.MistralConfig(**SMALL))
    if kind == "qwen2":
        return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**SMALL))
    if kind == "gemma":
        return transformers.GemmaForCausalLM(transformers.GemmaConfig(**SMALL, head_dim=16,
                                                                      hidden_activation="gelu_pytorch_tanh"))
    raise AssertionError(kind)


def stacked_gate_up(kind):
    """A model whose gated MLP stacks gate and up in one linear layer, gate_up_proj = [gate; up]."""
    if kind == "phi3":
        return transformers.Phi3ForCausalLM(transformers.Phi3Config(**SMALL, pad_token_id=0))
    if kind == "glm4":
        return transformers.Glm4ForCausalLM(transformers.Glm4Config(**SMALL, head_dim=16, pad_token_id=0))
    raise AssertionError(kind)


def stacked_from_packed(packed):
    """[gate; up] from the packed gate / up weight, written from the layout docs/contract.md states
    (blocks of 8 units: the 8 gate rows, then the 8 up rows), not with the library's helpers."""
    h = packed.shape[0] // 2
    blocks = packed.reshape(h // 8, 2, 8, *packed.shape[1:])
    return torch.cat([blocks[:, 0].reshape(h, *packed.shape[1:]), blocks[:, 1].reshape(h, *packed.shape[1:])])


def gpt_neox():
    return transformers.GPTNeoXForCausalLM(transformers.GPTNeoXConfig(
        vocab_size=97, hidden_size=64, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=64))


def bert():
    return transformers.BertModel(transformers.BertConfig(
        vocab_size=97, hidden_size=64, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=64), add_pooling_layer=False)


def gpt2():
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=97, n_embd=64, n_layer=2, n_head=4,
                                                                n_positions=64, bos_token_id=0, eos_token_id=0))


def prepared(model):
    torch.manual_seed(0)
    model = model.to(torch.float64).eval()
    return model, copy.deepcopy(model)


def first(out):
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


def assert_same_computation(ref, conv):
    """Forward and backward of both models on the same tokens: outputs and every parameter's
    gradient (by the model's own names) agree to float64 rounding."""
    ids = torch.randint(0, 97, (2, 11), generator=torch.Generator().manual_seed(5))
    outs = []
    for m in (ref, conv):
        m.zero_grad(set_to_none=True)
        y = first(m(input_ids=ids))
        y.backward(torch.ones_like(y) / y.numel() ** 0.5)
        outs.append(y.detach())
    assert torch.allclose(outs[0], outs[1], rtol=1e-10, atol=1e-12), (outs[0] - outs[1]).abs().max()
    ref_grads = {n: p.grad for n, p in ref.named_parameters()}
    conv_grads = {}
    for module_name, module in conv.named_modules():
        for n, p in module.named_parameters(recurse=False):
            conv_grads[f"{module_name}.{n}" if module_name else n] = p.grad
        if isinstance(module, ConvertedConv1D):  # its weight in Conv1D's [in, out] layout
            conv_grads[f"{module_name}.weight"] = module.weight.grad.t()
        if isinstance(module, ConvertedMLP):  # its fc1 / fc2 under the MLP's names and layout
            for ours, theirs, transposed in zip(("fc1", "fc2"), module.state_names, module.transposed):
                layer = getattr(module, ours)
                conv_grads[f"{module_name}.{theirs}.weight"] = layer.weight.grad.t() if transposed else layer.weight.grad
                if layer.bias is not None:
                    conv_grads[f"{module_name}.{theirs}.bias"] = layer.bias.grad
    # a stacked MLP's packed gate / up gradient in the stacked [gate; up] layout (after the loop,
    # which names the packed one under the same key)
    for module_name, module in conv.named_modules():
        if isinstance(module, ConvertedStackedGatedMLP):
            conv_grads[f"{module_name}.gate_up_proj.weight"] = stacked_from_packed(module.gate_up_proj.weight.grad)
    # a FusedGatedMLP's packed gate / up gradient as Llama's two
    for module_name, module in conv.named_modules():
        if isinstance(module, FusedGatedMLP) and not isinstance(module, ConvertedStackedGatedMLP):
            h = module.hidden_features
            stacked = stacked_from_packed(module.gate_up_proj.weight.grad)
            conv_grads[f"{module_name}.gate_proj.weight"] = stacked[:h]
            conv_grads[f"{module_name}.up_proj.weight"] = stacked[h:]
    assert set(conv_grads) >= set(ref_grads), sorted(set(ref_grads) - set(conv_grads))
    for name, g in ref_grads.items():
        assert torch.allclose(conv_grads[name], g, rtol=1e-10, atol=1e-12), name


@pytest.mark.parametrize("kind", ["llama", "mistral", "qwen2", "gemma"])
def test_llama_family(kind):
    ref, model = prepared(llama_family(kind))
    keys = set(model.state_dict())
    report = convert_model(model)
    assert isinstance(report, ConversionReport)
    mlps = [n for n, was, now in report.converted if now.startswith("FusedGatedMLP")]
    assert mlps == [f"model.layers.{i}.mlp" for i in range(2)], report
    act = "geglu" if kind == "gemma" else "swiglu"
    assert all(now == f"FusedGatedMLP({act})" for _, _, now in report.converted if now.startswith("FusedGated"))
    assert all(isinstance(model.get_submodule(n), FusedGatedMLP) for n in mlps)
    dense = [n for n, _, now in report.converted if now == "FusedDense"]
    if kind == "qwen2":  # q / k / v carry biases
        assert sorted(dense) == sorted(f"model.layers.{i}.self_attn.{p}_proj" for i in range(2) for p in "qkv")
    else:
        assert dense == []
    left = {n: why for n, _, why in report.left}
    assert "LM head" in left["lm_head"] and "no bias" in left["model.layers.0.self_attn.o_proj"]
    assert set(model.state_dict()) == keys
    assert_same_computation(ref, model)
    # checkpoints load both ways under the model's own names
    fresh = copy.deepcopy(ref)
    fresh.load_state_dict(model.state_dict())
    model.load_state_dict(ref.state_dict())
    assert_same_computation(fresh, model)


@pytest.mark.parametrize("kind", ["phi3", "glm4"])
def test_stacked_gate_up_family(kind):
    """Phi-3's and GLM-4's MLPs (gate_up_proj = [gate; up], down_proj, SiLU) become
    ConvertedStackedGatedMLPs: the same outputs and gradients (the gate / up gradient compared in
    the stacked layout), the stacked gate_up_proj.weight saved byte for byte as the model had it,
    checkpoints loading both ways."""
    ref, model = prepared(stacked_gate_up(kind))
    state = model.state_dict()
    report = convert_model(model)
    mlps = [(n, now) for n, _, now in report.converted if n.endswith(".mlp")]
    assert mlps == [(f"model.layers.{i}.mlp", "ConvertedStackedGatedMLP(swiglu)") for i in range(2)], report
    mlp = model.model.layers[0].mlp
    assert isinstance(mlp, ConvertedStackedGatedMLP)
    assert not torch.equal(mlp.gate_up_proj.weight, ref.model.layers[0].mlp.gate_up_proj.weight)  # packed
    converted_state = model.state_dict()
    assert list(converted_state) == list(state)
    for k, v in state.items():
        assert torch.equal(converted_state[k], v), k
    assert_same_computation(ref, model)
    fresh = copy.deepcopy(ref)
    fresh.load_state_dict(model.state_dict())
    model.load_state_dict(ref.state_dict())
    assert_same_computation(fresh, model)
    with pytest.raises(RuntimeError, match="must be the stacked"):
        model.model.layers[0].mlp.load_state_dict({"gate_up_proj.weight": torch.zeros(3, 64, dtype=torch.float64),
                                                   "down_proj.weight": state["model.layers.0.mlp.down_proj.weight"]})


class UpFirstMLP(torch.nn.Module):
    """The stacked MLP's parts with up first: down(act(gate) * up) for [up; gate] = gate_up_proj(x)."""

    def __init__(self, d, h, bias=False):
        super().__init__()
        self.gate_up_proj = torch.nn.Linear(d, 2 * h, bias=bias)
        self.down_proj = torch.nn.Linear(h, d, bias=False)
        self.activation_fn = torch.nn.SiLU()

    def forward(self, x):
        up, gate = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(self.activation_fn(gate) * up)


class StackedMLP(UpFirstMLP):
    def forward(self, x):
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(self.activation_fn(gate) * up)


def test_stacked_gate_up_left_with_the_reason():
    """A stacked MLP that computes something else (up first), carries a bias or another activation
    is left with the reason, its linear layers still candidates; the one that matches converts."""
    torch.manual_seed(0)
    relu = StackedMLP(16, 16)
    relu.activation_fn = torch.nn.ReLU()
    model = torch.nn.ModuleDict({"ok": StackedMLP(16, 16), "swapped": UpFirstMLP(16, 16),
                                 "bias": StackedMLP(16, 16, bias=True), "relu": relu}).double()
    ref = copy.deepcopy(model)
    report = convert_model(model)
    converted = {n: now for n, _, now in report.converted}
    left = {n: why for n, _, why in report.left}
    assert converted["ok"] == "ConvertedStackedGatedMLP(swiglu)"
    assert "its forward is not down_proj(act(gate) * up)" in left["swapped"]
    assert "has biases" in left["bias"] and converted["bias.gate_up_proj"] == "FusedDense"
    assert "neither SiLU nor GELU" in left["relu"]
    assert "no bias" in left["swapped.gate_up_proj"]
    x = torch.randn(3, 16, dtype=torch.float64)
    for name in model:
        assert torch.allclose(ref[name](x), model[name](x), rtol=1e-10, atol=1e-12), name


def test_stacked_gate_up_in_fp8():
    """In FP8 (the CPU reference kernels) the stacked MLP is a ConvertedStackedGatedMLP with the
    recipe and a training step runs; the MLP's output and gradients are a FusedGatedMLP's in FP8
    with the same gate and up weights (Llama's names), bit for bit, and the model's logits stay
    within FP8's error of the bf16 model's (measured 0.040-0.044 relative over seeds)."""
    import fused_dense
    torch.manual_seed(0)
    ref = stacked_gate_up("phi3").to(torch.bfloat16)
    model = copy.deepcopy(ref)
    recipe = fused_dense.Float8Recipe(min_features=0)
    report = convert_model(model, fp8=recipe)
    assert ("model.layers.0.mlp", "Phi3MLP", "ConvertedStackedGatedMLP(swiglu)") in report.converted
    assert model.model.layers[0].mlp.fp8 is recipe
    ids = torch.randint(0, 97, (2, 11), generator=torch.Generator().manual_seed(5))
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    mlp = model.model.layers[0].mlp
    assert mlp.gate_up_proj.weight.grad is not None
    stacked = ref.model.layers[0].mlp.gate_up_proj.weight
    plain = FusedGatedMLP(64, 128, dtype=torch.bfloat16, fp8=recipe)
    plain.load_state_dict({"gate_proj.weight": stacked[:128], "up_proj.weight": stacked[128:],
                           "down_proj.weight": ref.model.layers[0].mlp.down_proj.weight})
    x = torch.randn(22, 64, dtype=torch.bfloat16)
    got, want = [(m(x), torch.autograd.grad(m(x).sum(), m.parameters())) for m in (mlp, plain)]
    assert torch.equal(got[0], want[0]) and all(torch.equal(a, b) for a, b in zip(got[1], want[1]))
    logits = ref(input_ids=ids).logits.double()
    err = float((out.logits.detach().double() - logits).norm() / logits.norm())
    assert err < 0.06, err


def test_gpt2_mlps_and_the_tied_head():
    """GPT-2's MLPs (Conv1D c_fc / c_proj, tanh GELU, dropout) become ConvertedMLPs and the
    attention's Conv1D layers ConvertedConv1Ds, saving GPT-2's names and [in, out] layout (the same
    values, byte for byte); the tied LM head is converted on request and stays tied."""
    ref, model = prepared(gpt2())
    state = model.state_dict()
    report = convert_model(model)
    assert [(n, now) for n, _, now in report.converted] == [
        (f"transformer.h.{i}.{part}", now) for i in range(2)
        for part, now in (("attn.c_attn", "ConvertedConv1D"), ("attn.c_proj", "ConvertedConv1D"),
                          ("mlp", "ConvertedMLP(gelu_approx)"))]
    left = dict((n, why) for n, _, why in report.left)
    assert "LM head" in left["lm_head"] and not any("Conv1D" in what for _, what, _ in report.left)
    assert isinstance(model.transformer.h[0].attn.c_attn, ConvertedConv1D)
    assert model.transformer.h[0].attn.c_attn.weight.shape == (3 * 64, 64)  # [out, in], as the GEMM reads it
    converted_state = model.state_dict()
    assert list(converted_state) == list(state)
    for k, v in state.items():
        assert converted_state[k].shape == v.shape and torch.equal(converted_state[k], v), k
    assert_same_computation(ref, model)
    fresh = copy.deepcopy(ref)
    fresh.load_state_dict(model.state_dict())
    model.load_state_dict(ref.state_dict())
    assert_same_computation(fresh, model)
    head = convert_model(model, lm_head=True, bias_free_linears=True)
    assert head.converted == [("lm_head", "Linear", "FusedDense")]
    assert isinstance(model.lm_head, FusedDense)
    assert model.lm_head.weight is model.transformer.wte.weight
    assert_same_computation(ref, model)


class NanoGPTMLP(torch.nn.Module):
    """nanoGPT's MLP, written out (its model.py): c_fc, GELU, c_proj, dropout."""

    def __init__(self, d, approximate):
        super().__init__()
        self.c_fc = torch.nn.Linear(d, 4 * d)
        self.gelu = torch.nn.GELU(approximate=approximate)
        self.c_proj = torch.nn.Linear(4 * d, d)
        self.dropout = torch.nn.Dropout(0.0)

    def forward(self, x):
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class ResidualMLP(NanoGPTMLP):
    """The same parts, but a forward that is not second(act(first(x)))."""

    def forward(self, x):
        return x + super().forward(x)


def test_nanogpt_style_mlps():
    torch.manual_seed(0)
    model = torch.nn.ModuleDict({"tanh": NanoGPTMLP(16, "tanh"), "erf": NanoGPTMLP(16, "none"),
                                 "residual": ResidualMLP(16, "tanh")}).double()
    ref = copy.deepcopy(model)
    keys = set(model.state_dict())
    report = convert_model(model)
    converted = {n: now for n, _, now in report.converted}
    left = dict((n, why) for n, _, why in report.left)
    assert converted["tanh"] == "ConvertedMLP(gelu_approx)"
    assert "exact (erf) GELU" in left["erf"] and converted["erf.c_fc"] == "FusedDense"
    assert "its forward is not c_proj(act(c_fc(x)))" in left["residual"]
    assert set(model.state_dict()) == keys
    x = torch.randn(3, 5, 16, dtype=torch.float64, requires_grad=True)
    for name in ("tanh", "erf", "residual"):
        a, b = ref[name](x), model[name](x)
        assert torch.allclose(a, b, rtol=1e-10, atol=1e-12), name
        ga = torch.autograd.grad(a.sum(), [x, *ref[name].parameters()])
        gb = torch.autograd.grad(b.sum(), [x, *model[name].parameters()])
        assert all(torch.allclose(p, q, rtol=1e-10, atol=1e-12) for p, q in zip(ga, gb)), name


def test_module_filter_and_errors():
    ref, model = prepared(llama_family("qwen2"))
    report = convert_model(model, module_filter=lambda name, m: name.endswith(".mlp"))
    assert [n for n, _, _ in report.converted] == ["model.layers.0.mlp", "model.layers.1.mlp"]
    assert ("model.layers.0.self_attn.q_proj", "Linear", "refused by module_filter") in report.left
    assert_same_computation(ref, model)
    _, other = prepared(llama_family("qwen2"))
    with pytest.raises(ValueError, match="module_filter refused all"):
        convert_model(other, module_filter=lambda name, m: False)
    with pytest.raises(TypeError, match="module_filter must be callable"):
        convert_model(other, module_filter="mlp")
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        convert_model("model")
    with pytest.raises(TypeError, match="fp8 must be"):
        convert_model(other, fp8="e4m3")
    # converting again takes what the filter left; then nothing is left to convert
    again = convert_model(model)
    assert sorted(n for n, _, _ in again.converted) == sorted(
        f"model.layers.{i}.self_attn.{p}_proj" for i in range(2) for p in "qkv")
    assert_same_computation(ref, model)
    with pytest.raises(ValueError, match="found nothing to convert"):
        convert_model(model)


def test_gated_mlp_with_biases_is_left_with_the_reason():
    cfg = transformers.LlamaConfig(**SMALL, mlp_bias=True)
    ref, model = prepared(transformers.LlamaForCausalLM(cfg))
    report = convert_model(model)
    left = dict((n, w) for n, _, w in report.left)
    assert "biases" in left["model.layers.0.mlp"]
    # its linears carry biases, so they become FusedDense one by one
    assert ("model.layers.0.mlp.gate_proj", "Linear", "FusedDense") in report.converted
    assert_same_computation(ref, model)


def test_fp8_recipe_reaches_the_new_layers():
    import fused_dense
    _, model = prepared(llama_family("llama"))
    recipe = fused_dense.Float8Recipe(scaling="current")
    report = convert_model(model, fp8=recipe, fuse_qkv=False)
    assert model.model.layers[0].mlp.fp8 is recipe
    # in FP8 bias-free linears are converted by default (the LM head still left)
    assert ("model.layers.0.self_attn.q_proj", "Linear", "FusedDense") in report.converted
    assert model.model.layers[0].self_attn.q_proj.fp8 is recipe
    assert "lm_head" in {n for n, _, _ in report.left}


def test_fuse_qkv_default_is_on_with_fp8_only():
    """fuse_qkv=None (the default): each self_attn's q / k / v become one FusedQKV with fp8, stay
    apart in bf16; only fuse_qkv=True reports a model without such an attention; anything but
    None / True / False is a TypeError."""
    import fused_dense
    recipe = fused_dense.Float8Recipe(scaling="current")
    _, model = prepared(llama_family("llama"))
    report = convert_model(model, fp8=recipe)
    attn = model.model.layers[0].self_attn
    assert isinstance(attn.qkv_proj, fused_dense.FusedQKV) and attn.qkv_proj.fp8 is recipe
    assert all(isinstance(getattr(attn, n), fused_dense.QKVPart) for n in ("q_proj", "k_proj", "v_proj"))
    assert ("model.layers.1.self_attn", "LlamaAttention q_proj, k_proj, v_proj",
            "FusedQKV qkv_proj (one GEMM; q_proj, k_proj, v_proj its parts)") in report.converted
    _, plain = prepared(llama_family("llama"))
    convert_model(plain)
    assert not hasattr(plain.model.layers[0].self_attn, "qkv_proj")
    assert type(plain.model.layers[0].self_attn.q_proj) is torch.nn.Linear  # bias-free: left in bf16
    for fuse in (None, False):
        report = convert_model(gpt2(), fp8=recipe, fuse_qkv=fuse)
        assert not any(n == "fuse_qkv" for n, _, _ in report.left)
    report = convert_model(gpt2(), fp8=recipe, fuse_qkv=True)
    assert any(n == "fuse_qkv" for n, _, _ in report.left)
    with pytest.raises(TypeError, match=r"fuse_qkv must be None, True or False, got 'yes'"):
        convert_model(llama_family("llama"), fuse_qkv="yes")


def llama_with_biases():
    """A Llama whose attention has biases, so that both FusedDense and FusedGatedMLP are in it."""
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMALL, attention_bias=True))


def train_step(model, ids):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    return out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("reentrant", [False, True])
def test_gradient_checkpointing(reentrant):
    """Hugging Face's gradient_checkpointing_enable on a converted model: the recomputation
    records its own graph (non-reentrant checkpointing counts the tensors each pass saves) and the
    gradients are those of the run without checkpointing, bit for bit."""
    ref, model = prepared(llama_with_biases())
    convert_model(model)
    plain = copy.deepcopy(model)
    ids = torch.randint(0, 97, (2, 11), generator=torch.Generator().manual_seed(3))
    model.train(), plain.train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    loss_ckpt, grads_ckpt = train_step(model, ids)
    loss_plain, grads_plain = train_step(plain, ids)
    assert torch.equal(loss_ckpt, loss_plain)
    assert grads_ckpt.keys() == grads_plain.keys()
    for name in grads_plain:
        assert torch.equal(grads_ckpt[name], grads_plain[name]), name


def test_gradient_checkpointing_advances_delayed_scaling_once():
    """FP8 with delayed scaling under gradient checkpointing: the recomputed forward takes the
    scales of the forward it recomputes and the amax history moves once a step, so the run's
    gradients and history equal the run without checkpointing."""
    import fused_dense
    torch.manual_seed(0)
    base = llama_with_biases().float()
    recipe = fused_dense.Float8Recipe(scaling="delayed", min_features=0)
    ids = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(4))
    runs = []
    for ckpt in (False, True):
        model = copy.deepcopy(base)
        convert_model(model, fp8=recipe)
        model.train()
        if ckpt:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        steps = [train_step(model, ids) for _ in range(3)]
        mlp = model.model.layers[0].mlp
        runs.append((steps, mlp.fp8_amax_history.clone(), mlp.fp8_scales.clone()))
    (steps_a, hist_a, scales_a), (steps_b, hist_b, scales_b) = runs
    # three steps push three amax rows; the first (before any amax was recorded) is zeros
    assert (hist_a != 0).any(1).tolist()[:4] == [True, True, False, False], hist_a
    assert torch.equal(hist_a, hist_b) and torch.equal(scales_a, scales_b)
    for (loss_a, g_a), (loss_b, g_b) in zip(steps_a, steps_b):
        assert torch.equal(loss_a, loss_b)
        assert all(torch.equal(g_a[n], g_b[n]) for n in g_a)


@pytest.mark.parametrize("family", ["llama", "gpt2", "phi3"])
def test_save_pretrained_and_generate(tmp_path, family):
    """A converted model saves a checkpoint the unconverted class loads (and the other way), and
    greedy generation in eval mode gives the unconverted model's tokens (GPT-2: its Conv1D layers
    saved in their [in, out] layout; Phi-3: its stacked gate_up_proj)."""
    build = {"llama": llama_with_biases, "gpt2": gpt2, "phi3": lambda: stacked_gate_up("phi3")}[family]
    ref, model = prepared(build())
    cls = type(ref)
    convert_model(model)
    model.save_pretrained(tmp_path / "converted")
    loaded = cls.from_pretrained(tmp_path / "converted", dtype=torch.float64)
    for (n, a), (m, b) in zip(sorted(ref.state_dict().items()), sorted(loaded.state_dict().items())):
        assert n == m and torch.equal(a, b), n
    ref.save_pretrained(tmp_path / "plain")
    again = cls.from_pretrained(tmp_path / "plain", dtype=torch.float64)
    convert_model(again)
    assert_same_computation(ref, again)
    ids = torch.randint(0, 97, (1, 5), generator=torch.Generator().manual_seed(6))
    model.eval(), ref.eval()
    with torch.no_grad():
        a = ref.generate(ids, max_new_tokens=8, do_sample=False)
        b = model.generate(ids, max_new_tokens=8, do_sample=False)
    assert torch.equal(a, b), (a, b)


@pytest.mark.parametrize("family", ["llama", "gpt2", "llama_fuse_qkv"])
def test_compiles_fullgraph_with_no_break(family):
    """torch.compile traces a converted model without a graph break where the unconverted one has
    none (torch._dynamo.explain); with fuse_qkv the parts' shared state included."""
    ref, model = prepared(gpt2() if family == "gpt2" else llama_with_biases())
    convert_model(model, fuse_qkv=family == "llama_fuse_qkv")
    ids = torch.randint(0, 97, (2, 7), generator=torch.Generator().manual_seed(7))
    torch._dynamo.reset()
    plain = torch._dynamo.explain(ref)(input_ids=ids)
    torch._dynamo.reset()
    conv = torch._dynamo.explain(model)(input_ids=ids)
    torch._dynamo.reset()
    assert conv.graph_break_count <= plain.graph_break_count, conv.break_reasons


@pytest.mark.parametrize("family", ["llama", "gpt2", "llama_fuse_qkv"])
def test_compiled_model_traces_the_sequence_length_once(family):
    """A converted model compiled and trained at four sequence lengths compiles no more graphs than
    the unconverted one: its layers trace the token count as a symbol (tests/test_compile_dynamic.py);
    before, each length recompiled them."""
    from torch._dynamo.utils import counters
    ref, model = prepared(gpt2() if family == "gpt2" else llama_family("llama"))
    convert_model(model, fuse_qkv=family == "llama_fuse_qkv")
    gen = torch.Generator().manual_seed(7)
    batches = [torch.randint(0, 97, (2, t), generator=gen) for t in (7, 9, 12, 15)]

    def graphs(m):
        torch._dynamo.reset()
        counters.clear()
        step = torch.compile(lambda ids: m(input_ids=ids, labels=ids).loss, backend="aot_eager")
        losses = []
        for ids in batches:
            loss = step(ids)
            loss.backward()
            losses.append(loss.detach())
        return counters["stats"]["unique_graphs"], losses

    (ref_graphs, ref_losses), (conv_graphs, conv_losses) = graphs(ref), graphs(model)
    torch._dynamo.reset()
    assert conv_graphs <= ref_graphs, (conv_graphs, ref_graphs)
    for a, b in zip(ref_losses, conv_losses):
        assert torch.allclose(a, b, rtol=1e-12, atol=0), (a, b)  # float64: the same computation


@pytest.mark.parametrize("layer", ["FusedMLP", "FusedGatedMLP", "FusedDense"])
def test_layers_under_non_reentrant_checkpoint(layer):
    """torch.utils.checkpoint(use_reentrant=False) over each layer: the recomputation in backward
    saves what the forward saved (the C++ derivatives unpack their saved tensors with autograd on)
    and the gradients equal the plain run's, bit for bit."""
    import fused_dense
    torch.manual_seed(0)
    mod = getattr(fused_dense, layer)(24, 40).double()
    x = torch.randn(6, 24, dtype=torch.float64, requires_grad=True)
    grads = []
    for ckpt in (False, True):
        mod.zero_grad(set_to_none=True)
        x.grad = None
        y = torch.utils.checkpoint.checkpoint(mod, x, use_reentrant=False) if ckpt else mod(x)
        y.backward(torch.ones_like(y))
        grads.append([x.grad.clone()] + [p.grad.clone() for p in mod.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*grads))


FSDP2_STEP = r"""
import copy, sys, tempfile, torch, torch.distributed as dist, transformers
from torch.distributed.fsdp import fully_shard
from fused_dense import convert_model
dist.init_process_group("gloo", init_method="file://" + tempfile.mktemp(), rank=0, world_size=1)
cfg = transformers.LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                               attention_bias=True)
torch.manual_seed(0)
model = transformers.LlamaForCausalLM(cfg).double()
convert_model(model, fuse_qkv=sys.argv[1] == "fuse_qkv")
plain = copy.deepcopy(model)
for layer in model.model.layers:
    fully_shard(layer)
fully_shard(model)
ids = torch.randint(0, 97, (2, 11))
for m in (model, plain):
    m(input_ids=ids, labels=ids).loss.backward()
full = {n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad) for n, p in model.named_parameters()}
ref = {n: p.grad for n, p in plain.named_parameters()}
assert full.keys() == ref.keys(), sorted(set(full) ^ set(ref))
assert all(torch.equal(full[n], ref[n]) for n in ref), [n for n in ref if not torch.equal(full[n], ref[n])]
dist.destroy_process_group()
print("FSDP2 OK")
"""


@pytest.mark.parametrize("fuse_qkv", ["plain", "fuse_qkv"])
def test_fsdp2_world_1(fuse_qkv):
    """FSDP2's fully_shard (gloo, world size 1) over a converted model (q / k / v as they are, and
    as one FusedQKV whose parts reach its parameters through the attention): the gradients,
    gathered, equal the unsharded converted model's bit for bit."""
    import os
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, "-c", FSDP2_STEP, fuse_qkv], cwd=root, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0 and "FSDP2 OK" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-4000:]


def test_meta_device_models_convert():
    """A model built on the meta device (to be materialised later, as FSDP2 setups do) converts
    without touching values: the same modules become the same fused layers, still on meta."""
    for build in (llama_with_biases, gpt2, lambda: stacked_gate_up("phi3")):
        with torch.device("meta"):
            model = build()
        real = build()
        a, b = convert_model(model), convert_model(real)
        assert a.converted == b.converted and [n for n, _, _ in a.left] == [n for n, _, _ in b.left]
        assert all(p.device.type == "meta" for p in model.parameters())
        assert set(model.state_dict()) == set(real.state_dict())
