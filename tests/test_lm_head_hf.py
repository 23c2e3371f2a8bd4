"""use_fused_linear_cross_entropy on Hugging Face causal LMs (CPU, tiny random-init models): in
training with labels the loss and every parameter gradient are those of the model as transformers
builds it, without logits; everything else (eval, no labels, generate, save / load) is unchanged,
bit for bit. convert_model(linear_cross_entropy=True) applies it and reports it.

Tolerances. transformers' ForCausalLMLoss upcasts the logits with ``.float()``, so the unconverted
model's loss and the gradient of its logits are float32 results in both float32 and float64 (in
float64 the logits are rounded to float32 first). Against it the fused loss is held to float32's
rounding: a sum over N rows of log-sum-exps over V logits carries at most about
(log2 V + log2 N) roundings of eps = 2^-24 each, taken 8 times over for the logits' own rounding
and the different order of the sums (``_f32_tol``). The gradients are held to 4 times that: the
float32 gradient of the logits carries as many roundings as the loss, and each of the two GEMMs
it feeds (the hidden states' gradient over V, the weight's over N) at most as many again, before
the decoder's backward, the same on both sides, carries them to the other parameters. In float64
the fused loss, a float64 value there (transformers' is float32), and the gradients are also
compared with an all-float64 reference (the logits in float64 and F.cross_entropy in float64),
within 1e-12.
"""
import copy
import functools
import inspect
import math

import pytest
import torch
import torch.nn.functional as F

from conftest import rel_err

transformers = pytest.importorskip("transformers")

from fused_dense import Float8Recipe, convert_model, use_fused_linear_cross_entropy  # noqa: E402
from fused_dense.causal_lm import SUPPORTED_FAMILIES, causal_lm_family  # noqa: E402

VOCAB, HIDDEN, BATCH, SEQ = 128, 64, 2, 12
COMMON = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)


def _config(family, **kw):
    args = dict(COMMON, **kw)
    if family == "llama":
        return transformers.LlamaConfig(**args)
    if family == "mistral":
        return transformers.MistralConfig(sliding_window=None, **args)
    if family == "qwen2":
        return transformers.Qwen2Config(**args)
    if family == "gemma":
        return transformers.GemmaConfig(head_dim=16, hidden_activation="gelu_pytorch_tanh", **args)
    if family == "gemma2":
        args.setdefault("final_logit_softcapping", 30.0)
        return transformers.Gemma2Config(head_dim=16, hidden_activation="gelu_pytorch_tanh", **args)
    if family == "gemma3":
        args.setdefault("final_logit_softcapping", 30.0)
        return transformers.Gemma3TextConfig(head_dim=16, hidden_activation="gelu_pytorch_tanh", **args)
    if family == "qwen3":
        return transformers.Qwen3Config(head_dim=16, **args)
    if family == "phi3":
        return transformers.Phi3Config(pad_token_id=0, bos_token_id=0, eos_token_id=0, **args)
    if family == "gpt2":
        return transformers.GPT2Config(vocab_size=VOCAB, n_embd=HIDDEN, n_layer=2, n_head=4, n_positions=64,
                                       resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
                                       eos_token_id=0, **kw)
    raise AssertionError(family)


MODEL_CLASSES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "gemma": "GemmaForCausalLM", "gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM",
                 "qwen3": "Qwen3ForCausalLM", "phi3": "Phi3ForCausalLM", "gpt2": "GPT2LMHeadModel"}
FAMILIES = list(MODEL_CLASSES)


def build(family, dtype=torch.float32, seed=0, **kw):
    """(the model as transformers builds it, a copy with the fused loss), train mode."""
    torch.manual_seed(seed)
    model = getattr(transformers, MODEL_CLASSES[family])(_config(family, attn_implementation="eager", **kw))
    model = model.to(dtype).train()
    fused = copy.deepcopy(model)
    use_fused_linear_cross_entropy(fused)
    return model, fused


def batch(seed=1):
    """input ids and labels, with -100 at some positions (and a whole row's tail)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    labels = ids.clone()
    labels[0, 3] = labels[1, 0] = labels[1, 7] = -100
    labels[1, -3:] = -100
    return ids, labels


def step(model, ids, labels, **kw):
    """(output, {name: grad}) of one forward with labels and backward of its loss."""
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=labels, **kw)
    out.loss.backward()
    return out, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _f32_tol(rows, vocab):
    return 8 * (math.log2(vocab) + math.log2(rows)) * 2.0 ** -24


def assert_matches_hf(model, fused, ids, labels, same_parameters=True, **kw):
    """The fused model's loss and gradients against the unconverted model's, at float32's rounding
    (with same_parameters=False, the gradients of the parameters both have)."""
    ref, ref_grads = step(model, ids, labels, **kw)
    out, grads = step(fused, ids, labels, **kw)
    tol = _f32_tol(ids.numel(), VOCAB)
    assert type(out) is type(ref) and out.logits is None
    float64 = next(fused.parameters()).dtype == torch.float64
    assert ref.loss.dtype == torch.float32 and out.loss.dtype == (torch.float64 if float64 else torch.float32)
    assert rel_err(out.loss, ref.loss) <= tol, (float(out.loss), float(ref.loss), tol)
    if same_parameters:
        assert sorted(grads) == sorted(ref_grads)
    else:
        ref_grads = {n: g for n, g in ref_grads.items() if n in grads}
        assert "lm_head.weight" in ref_grads
    for name, g in ref_grads.items():
        err = rel_err(grads[name], g, floor=1e-30)
        assert err <= 4 * tol, f"{name}: gradient relative error {err:.2e} > {4 * tol:.1e}"
    return out, grads


def float64_reference(model, ids, labels):
    """(loss, {name: grad}): the model's logits in float64 (its forward applies Gemma's softcap)
    and Hugging Face's causal-LM loss on them, without the float32 upcast."""
    model.zero_grad(set_to_none=True)
    logits = model(input_ids=ids).logits
    target = F.pad(labels, (0, 1), value=-100)[..., 1:].reshape(-1)
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target, ignore_index=-100)
    loss.backward()
    return loss, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("family", FAMILIES)
def test_training_loss_and_gradients_match(family, dtype):
    model, fused = build(family, dtype)
    ids, labels = batch()
    out, grads = assert_matches_hf(model, fused, ids, labels)
    if dtype == torch.float64:
        ref_loss, ref_grads = float64_reference(model, ids, labels)
        assert rel_err(out.loss, ref_loss) <= 1e-12
        for name, g in ref_grads.items():
            assert rel_err(grads[name], g, floor=1e-300) <= 1e-12, name


@pytest.mark.parametrize("family", FAMILIES)
def test_eval_no_labels_and_generate_unchanged(family):
    model, fused = build(family)
    ids, labels = batch()
    # what generate and the Trainer read off the forward (the accepted names, **kwargs) is the class's
    assert inspect.signature(fused.forward) == inspect.signature(model.forward)
    # training without labels, and eval with and without labels: the class's forward, bit for bit
    for mode in ("train", "eval"):
        model.train(mode == "train"), fused.train(mode == "train")
        for kw in ({}, {"labels": labels}) if mode == "eval" else ({},):
            with torch.no_grad():
                a, b = model(input_ids=ids, **kw), fused(input_ids=ids, **kw)
            assert torch.equal(a.logits, b.logits), (mode, kw)
            assert (a.loss is None and b.loss is None) or torch.equal(a.loss, b.loss)
    model.eval(), fused.eval()
    gen = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert torch.equal(model.generate(ids[:, :5], **gen), fused.generate(ids[:, :5], **gen))


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_num_items_in_batch_and_shift_labels(family):
    model, fused = build(family)
    ids, labels = batch()
    counted = int((labels[..., 1:] != -100).sum())
    for n in (torch.tensor(counted + 5), 3 * counted):  # gradient accumulation's divisor: tensor or int
        out, _ = assert_matches_hf(model, fused, ids, labels, num_items_in_batch=n)
        mean_loss = fused(input_ids=ids, labels=labels).loss
        assert torch.allclose(out.loss * float(n), mean_loss * counted, rtol=1e-5)
    # labels shifted by the caller: used as they are
    shift = torch.roll(labels, 2, dims=-1)
    out, _ = assert_matches_hf(model, fused, ids, labels, shift_labels=shift)
    plain = fused(input_ids=ids, labels=labels).loss
    assert not torch.allclose(out.loss, plain)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_padding_mask_and_positional_input_ids(family):
    # row 1's last 3 positions (right padding, labels -100) and position 5 masked out, which changes
    # the later positions' hidden states; input_ids passed by position
    model, fused = build(family, torch.float64)
    ids, labels = batch()
    mask = torch.ones_like(ids)
    mask[1, -3:] = mask[1, 5] = 0
    ref, ref_grads = step(model, ids, labels, attention_mask=mask)
    model.zero_grad(set_to_none=True), fused.zero_grad(set_to_none=True)
    out = fused(ids, attention_mask=mask, labels=labels)
    out.loss.backward()
    assert out.logits is None
    assert rel_err(out.loss, ref.loss) <= _f32_tol(ids.numel(), VOCAB)
    assert rel_err(out.loss, fused(ids, labels=labels).loss) > 1e-4
    for name, p in fused.named_parameters():
        assert rel_err(p.grad, ref_grads[name], floor=1e-30) <= 4 * _f32_tol(ids.numel(), VOCAB), name


def test_gemma2_softcap():
    # a cap of 0.5 changes every logit of this model; the loss without it is far off
    model, fused = build("gemma2", torch.float64, final_logit_softcapping=0.5)
    ids, labels = batch()
    out, grads = assert_matches_hf(model, fused, ids, labels)
    ref_loss, ref_grads = float64_reference(model, ids, labels)
    assert rel_err(out.loss, ref_loss) <= 1e-12
    for name, g in ref_grads.items():
        assert rel_err(grads[name], g, floor=1e-300) <= 1e-12, name
    uncapped, _ = build("gemma2", torch.float64, final_logit_softcapping=None)
    assert rel_err(uncapped(input_ids=ids, labels=labels).loss, out.loss) > 1e-3


@pytest.mark.parametrize("family", ["llama", "gemma", "gpt2"])
def test_tied_embeddings(family):
    kw = {} if family == "gpt2" else {"tie_word_embeddings": True}
    model, fused = build(family, torch.float64, **kw)
    assert fused.lm_head.weight is fused.get_input_embeddings().weight
    ids, labels = batch()
    _, grads = assert_matches_hf(model, fused, ids, labels)
    shared = [n for n, p in fused.named_parameters() if p is fused.lm_head.weight]
    assert len(shared) == 1 and grads[shared[0]].abs().sum() > 0


@pytest.mark.parametrize("frozen", ["lm_head", "all_but_lm_head"])
def test_frozen_parameters(frozen):
    # fine-tuning with a frozen head (adapters), or a probe that trains the head alone
    model, fused = build("llama", torch.float64)
    for m in (model, fused):
        for name, p in m.named_parameters():
            p.requires_grad_((name == "lm_head.weight") != (frozen == "lm_head"))
    ids, labels = batch()
    _, grads = assert_matches_hf(model, fused, ids, labels)
    assert ("lm_head.weight" in grads) == (frozen != "lm_head") and grads


def test_chunk_size():
    # 24 rows in chunks of 5: four full chunks and a partial one
    model, fused = build("llama", torch.float64)
    assert "LlamaForCausalLM" in use_fused_linear_cross_entropy(fused, chunk_size=5)
    ids, labels = batch()
    assert_matches_hf(model, fused, ids, labels)


def test_fp8_head():
    # fp8=True: the loss is linear_cross_entropy(fp8=True) of the decoder's last hidden state, bit
    # for bit, with the head's weight gradient; called again with fp8=False the model is back to
    # the bf16 / fp32 head (tests/test_lm_head_fp8.py holds the FP8 head to its reference)
    from fused_dense import linear_cross_entropy

    model, fused = build("llama")
    assert "in FP8" in use_fused_linear_cross_entropy(fused, fp8=True)
    ids, labels = batch()
    out, grads = step(fused, ids, labels)
    hidden = fused.model(input_ids=ids).last_hidden_state.detach()
    w = fused.lm_head.weight.detach().clone().requires_grad_()
    target = F.pad(labels, (0, 1), value=-100)[..., 1:].reshape(-1)
    want = linear_cross_entropy(hidden.reshape(-1, HIDDEN), w, target, fp8=True)
    want.backward()
    assert torch.equal(out.loss, want) and torch.equal(grads["lm_head.weight"], w.grad)
    assert rel_err(out.loss, step(model, ids, labels)[0].loss) > 1e-4  # the FP8 head is taken
    assert "in FP8" not in use_fused_linear_cross_entropy(fused, fp8=False)
    assert_matches_hf(model, fused, ids, labels)
    with pytest.raises(TypeError, match="fp8 must be True or False"):
        use_fused_linear_cross_entropy(fused, fp8=None)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_gradient_checkpointing(family):
    model, fused = build(family)
    for m in (model, fused):  # transformers 5.24 renames gradient_checkpointing_enable
        (getattr(m, "activation_checkpointing_enable", None) or m.gradient_checkpointing_enable)()
        m.train()
    assert fused.model.gradient_checkpointing if family == "llama" else fused.transformer.gradient_checkpointing
    ids, labels = batch()
    assert_matches_hf(model, fused, ids, labels)


def test_autocast_bf16():
    # float32 weights under CPU autocast, as mixed-precision training runs: the unconverted model
    # rounds its logits to bf16 before the float32 loss, the fused one does not (bf16's tolerance)
    model, fused = build("llama")
    ids, labels = batch()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref, ref_grads = step(model, ids, labels)
        out, grads = step(fused, ids, labels)
    assert out.logits is None and out.loss.dtype == torch.float32
    assert rel_err(out.loss, ref.loss) <= 1e-2
    for name, g in ref_grads.items():
        assert grads[name].dtype == torch.float32 and rel_err(grads[name], g, floor=1e-30) <= 3e-2, name


def test_return_dict_false_and_outputs_carried():
    model, fused = build("llama")
    ids, labels = batch()
    ref = model(input_ids=ids, labels=labels, output_hidden_states=True, use_cache=True)
    out = fused(input_ids=ids, labels=labels, output_hidden_states=True, use_cache=True)
    assert out.logits is None and len(out.hidden_states) == len(ref.hidden_states)
    for a, b in zip(out.hidden_states, ref.hidden_states):
        assert torch.equal(a, b)
    # the cache's field: past_key_values up to transformers 5.17 at least, cache in later releases
    name = next((f for f in ("cache", "past_key_values") if hasattr(ref, f)), None)
    assert name is not None, f"no cache field in {type(ref).__name__}"
    cache, ref_cache = getattr(out, name), getattr(ref, name)
    assert ref_cache is not None and type(cache) is type(ref_cache) and cache.get_seq_length() == SEQ
    tup = fused(input_ids=ids, labels=labels, return_dict=False)
    assert isinstance(tup, tuple) and torch.equal(tup[0], out.loss)


def test_deepcopy_and_save_pretrained(tmp_path):
    model, fused = build("qwen2")
    ids, labels = batch()
    twin = copy.deepcopy(fused)
    assert twin.forward.__self__ is twin
    assert twin(input_ids=ids, labels=labels).logits is None
    fused.save_pretrained(tmp_path / "fused")
    model.save_pretrained(tmp_path / "plain")
    sd_f, sd_p = fused.state_dict(), model.state_dict()
    assert sorted(sd_f) == sorted(sd_p) and all(torch.equal(sd_f[k], sd_p[k]) for k in sd_p)
    loaded = {k: transformers.Qwen2ForCausalLM.from_pretrained(tmp_path / k, attn_implementation="eager").eval()
              for k in ("fused", "plain")}
    with torch.no_grad():
        assert torch.equal(loaded["fused"](input_ids=ids).logits, loaded["plain"](input_ids=ids).logits)
    loaded = loaded["fused"]
    # the patch is per instance: the class and the loaded model are untouched
    assert "forward" not in vars(loaded) and "forward" not in vars(model)
    del fused.forward
    fused.train()
    assert fused(input_ids=ids, labels=labels).logits is not None


def test_refused_models():
    cohere = transformers.CohereForCausalLM(transformers.CohereConfig(**COMMON))
    with pytest.raises(ValueError, match=r"CohereForCausalLM is not a supported causal LM.*LlamaForCausalLM"):
        use_fused_linear_cross_entropy(cohere)
    assert "forward" not in vars(cohere)
    granite = transformers.GraniteForCausalLM(transformers.GraniteConfig(**COMMON))
    assert causal_lm_family(granite)[0] is None

    class Custom(transformers.LlamaForCausalLM):
        def forward(self, *args, **kwargs):
            return super().forward(*args, **kwargs)

    custom = Custom(_config("llama"))
    with pytest.raises(ValueError, match="Custom overrides the forward of LlamaForCausalLM"):
        use_fused_linear_cross_entropy(custom)
    hooked, _ = build("llama")
    hooked.forward = functools.partial(type(hooked).forward, hooked)
    with pytest.raises(ValueError, match="forward is already replaced on the instance"):
        use_fused_linear_cross_entropy(hooked)
    llama, _ = build("llama")
    llama.loss_function = lambda *a, **k: 0
    with pytest.raises(ValueError, match="loss_function"):
        use_fused_linear_cross_entropy(llama)
    # a loss_function set after the patch: the class's forward computes it, with the logits
    _, fused = build("llama")
    fused.loss_function = lambda logits, labels, vocab_size, **kw: logits.float().mean()
    ids, labels = batch()
    out = fused(input_ids=ids, labels=labels)
    assert out.logits is not None and torch.equal(out.loss, out.logits.float().mean())
    with pytest.raises(ValueError, match="chunk_size must be a positive int"):
        use_fused_linear_cross_entropy(build("llama")[0], chunk_size=0)
    assert set(MODEL_CLASSES.values()) <= set(SUPPORTED_FAMILIES)


def test_convert_model_reports_it():
    model, _ = build("llama", torch.float64)
    fused = copy.deepcopy(model)
    rep = convert_model(fused, linear_cross_entropy=True)
    assert ("lm_head", "lm_head + loss", "fused linear cross-entropy (training)") in rep.converted
    assert any(now.startswith("FusedGatedMLP") for _, _, now in rep.converted)
    ids, labels = batch()
    assert_matches_hf(model, fused, ids, labels, same_parameters=False)
    # a model that is no supported causal LM: left alone with the reason, the rest converted
    cohere = transformers.CohereForCausalLM(transformers.CohereConfig(**COMMON))
    rep = convert_model(cohere, linear_cross_entropy=True)
    left = [r for r in rep.left if r[0] == "lm_head" and r[1] == "lm_head + loss"]
    assert rep.converted and len(left) == 1 and "CohereForCausalLM is not a supported causal LM" in left[0][2]
    # an LM head converted to FP8 on the way: the loss stays the model's, and the report says why
    fp8_model, _ = build("llama")
    rep = convert_model(fp8_model, fp8=Float8Recipe(min_features=0), lm_head=True, linear_cross_entropy=True)
    assert ("lm_head", "lm_head + loss", "its lm_head runs in FP8, which the fused loss does not") in rep.left
    assert "forward" not in vars(fp8_model)
    # nothing else to convert and no causal LM: the usual error
    with pytest.raises(ValueError, match="found nothing to convert"):
        convert_model(torch.nn.Sequential(torch.nn.ReLU()), linear_cross_entropy=True)


def _cuda_step(model, ids, labels):
    """(loss, {name: grad}, peak bytes of the step over what was allocated before it)."""
    model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    loss = model(input_ids=ids, labels=labels).loss
    loss.backward()
    torch.cuda.synchronize()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads, torch.cuda.max_memory_allocated() - before


@pytest.mark.cuda
@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_cuda_bf16_matches_without_the_logits_memory(family):
    vocab, tokens = 32000, 1024
    model, fused = build(family, torch.bfloat16, vocab_size=vocab, hidden_size=256, intermediate_size=512,
                         num_hidden_layers=1)
    model.cuda(), fused.cuda()
    ids = torch.randint(0, vocab, (2, tokens // 2), device="cuda")
    labels = ids.clone()
    labels[:, :7] = -100
    ref_loss, ref_grads, ref_peak = _cuda_step(model, ids, labels)
    loss, grads, peak = _cuda_step(fused, ids, labels)
    # bf16: the unconverted model rounds its logits to bf16 before the float32 loss, the fused one not
    assert rel_err(loss, ref_loss) <= 1e-2
    for name, g in ref_grads.items():
        assert rel_err(grads[name], g, floor=1e-30) <= 3e-2, name
    # Hugging Face's step holds the float32 logits (and more); the fused one a chunk of them at a time
    assert peak <= ref_peak - tokens * vocab * 4, (peak, ref_peak)
