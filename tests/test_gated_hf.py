"""FusedGatedMLP against Hugging Face transformers' LlamaMLP (CPU): its state_dict loads from and
into a LlamaMLP, both directions, with outputs and gradients reproduced; replace_llama_mlps swaps
the MLPs of a tiny LlamaForCausalLM in place and the logits and gradients stay what they were.
transformers is in the `test` extra, so CI runs these."""
import pytest
import torch

from conftest import TOL, assert_close_rel
from fused_dense import FusedGatedMLP, replace_llama_mlps

transformers = pytest.importorskip("transformers")
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402
from transformers.models.llama.modeling_llama import LlamaMLP  # noqa: E402

HIDDEN_ACT = {"swiglu": "silu", "geglu": "gelu_pytorch_tanh"}


def llama_config(activation="swiglu", **kw):
    args = dict(hidden_size=24, intermediate_size=44, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=61, max_position_embeddings=32, hidden_act=HIDDEN_ACT[activation])
    args.update(kw)
    return LlamaConfig(**args)


def forward_backward(module, x, g):
    x = x.clone().requires_grad_()
    out = module(x)
    out.backward(g)
    return out, x.grad


def weight_grads(module):
    """The gradients in LlamaMLP's names (a FusedGatedMLP's packed gradient unpacked like its weight)."""
    if isinstance(module, FusedGatedMLP):
        from fused_dense import ops

        gate, up = ops.unpack_gate_up(module.gate_up_proj.weight.grad)
        return {"gate_proj": gate, "up_proj": up, "down_proj": module.down_proj.weight.grad}
    return {n: getattr(module, n).weight.grad for n in ("gate_proj", "up_proj", "down_proj")}


@pytest.mark.parametrize("activation", ["swiglu", "geglu"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("direction", ["llama_to_fused", "fused_to_llama"])
def test_state_dict_reproduces_llama_mlp(activation, dtype, direction):
    cfg = llama_config(activation)
    llama = LlamaMLP(cfg).to(dtype)
    fused = FusedGatedMLP(cfg.hidden_size, cfg.intermediate_size, activation=activation, dtype=dtype)
    if direction == "llama_to_fused":
        fused.load_state_dict(llama.state_dict())
    else:
        llama.load_state_dict(fused.state_dict())
    x = torch.randn(3, 7, cfg.hidden_size, dtype=dtype)
    g = torch.randn(3, 7, cfg.hidden_size, dtype=dtype)
    out_l, dx_l = forward_backward(llama, x, g)
    out_f, dx_f = forward_backward(fused, x, g)
    assert_close_rel(out_f, out_l, dtype, "output")
    assert_close_rel(dx_f, dx_l, dtype, "input gradient")
    grads_f, grads_l = weight_grads(fused), weight_grads(llama)
    for name in grads_l:
        assert_close_rel(grads_f[name], grads_l[name], dtype, f"{name} gradient")
    # and back: the state dicts hold the same tensors under the same names
    sd_l, sd_f = llama.state_dict(), fused.state_dict()
    assert sorted(sd_l) == sorted(sd_f)
    for name in sd_l:
        assert torch.equal(sd_l[name], sd_f[name]), name


@pytest.mark.parametrize("activation", ["swiglu", "geglu"])
@pytest.mark.parametrize("checkpoint_lvl", [0, 2])
def test_replace_llama_mlps_keeps_logits_and_gradients(activation, checkpoint_lvl):
    torch.manual_seed(1234)
    cfg = llama_config(activation)
    model = LlamaForCausalLM(cfg).double()
    ids = torch.randint(0, cfg.vocab_size, (2, 11))
    before = model(ids).logits
    before.sum().backward()
    grads_before = {n: p.grad.clone() for n, p in model.named_parameters() if "mlp" not in n}
    model.zero_grad()

    assert replace_llama_mlps(model, checkpoint_lvl=checkpoint_lvl) == cfg.num_hidden_layers
    mlps = [m for m in model.modules() if isinstance(m, FusedGatedMLP)]
    assert len(mlps) == cfg.num_hidden_layers and all(m.activation == activation for m in mlps)
    assert not any(isinstance(m, LlamaMLP) for m in model.modules())
    after = model(ids).logits
    after.sum().backward()
    assert_close_rel(after, before, torch.float64, "logits")
    for name, grad in grads_before.items():
        assert_close_rel(dict(model.named_parameters())[name].grad, grad, torch.float64, name)
    # the swapped model's state_dict still loads into a fresh Llama model
    fresh = LlamaForCausalLM(cfg).double()
    fresh.load_state_dict(model.state_dict())
    assert_close_rel(fresh(ids).logits, before, torch.float64, "logits after reloading")


def test_replace_llama_mlps_refuses_biases_and_other_activations():
    model = LlamaForCausalLM(llama_config(mlp_bias=True))
    with pytest.raises(ValueError, match=r"model.layers.0.mlp has biases \(mlp_bias=True\)"):
        replace_llama_mlps(model)
    assert not any(isinstance(m, FusedGatedMLP) for m in model.modules())  # nothing replaced
    model = LlamaForCausalLM(llama_config(hidden_act="relu"))
    with pytest.raises(ValueError, match="act_fn .* is neither SiLU nor GELU"):
        replace_llama_mlps(model)


def test_replaced_model_trains_in_bf16_under_autocast():
    """A replaced model's training step under CPU autocast matches the original's within bf16's
    tolerance (both cast the same weights)."""
    torch.manual_seed(4321)
    cfg = llama_config()
    model = LlamaForCausalLM(cfg)
    ids = torch.randint(0, cfg.vocab_size, (2, 9))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        before = model(ids).logits.float()
    replace_llama_mlps(model)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        after = model(ids).logits.float()
    assert_close_rel(after, before.double(), torch.bfloat16, "logits", tol=2 * TOL[torch.bfloat16])
