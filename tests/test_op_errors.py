"""Bad inputs to the raw ops, their Python wrappers and fused_dense_lib: each raises the documented
error class (ValueError for every argument mistake, a tensor's rank, shape, layout, dtype or device
as well as a code or an option; docs/contract.md, "Errors") with a message naming the argument,
what was expected and what was given. A shape mistake raises the same type on the bf16 and the
FP8 ops.
The Meta kernels reject the same inputs with the same message, and on CUDA an operand on another
device is refused. The refusal of inputs that require grad is in test_op_registration.py.
"""
import pytest
import torch

import fused_dense_lib
from fused_dense import ops

from op_checks import OPS, noncontig, random_mask, randn, tensor

X, W, BIAS = (3, 5), (7, 5), (7,)  # linear_act: input [B=3, K=5], weight [N=7, K=5]
DW, DO = (7, 5), (3, 7)            # dgrad: weight [N=7, K=5], d_output [B=3, N=7], pre_act [3, 5]
LA, AD, WG, AF = OPS.linear_act, OPS.act_linear_dgrad, OPS.linear_bias_wgrad, OPS.act_forward

# (id, callable, exception class, fragments the message must contain)
ERROR_CASES = [
    # --- linear_act
    ("la-input-1d", lambda: LA(tensor(5), tensor(*W), None, 1, False, -1), ValueError, ["input", "2-D", "1-D", "[5]"]),
    ("la-input-3d", lambda: LA(tensor(2, 3, 5), tensor(*W), None, 1, False, -1), ValueError, ["input", "2-D", "3-D"]),
    ("la-weight-1d", lambda: LA(tensor(*X), tensor(5), None, 1, False, -1), ValueError, ["weight", "2-D", "1-D"]),
    ("la-dtype-mismatch", lambda: LA(tensor(*X), tensor(*W, dtype=torch.float64), None, 1, False, -1), ValueError,
     ["weight", "dtype", "input", "Float", "Double"]),
    ("la-half-vs-bf16", lambda: LA(tensor(*X, dtype=torch.half), tensor(*W, dtype=torch.bfloat16), None, 1, False, -1),
     ValueError, ["weight", "Half", "BFloat16"]),
    ("la-int-dtype", lambda: LA(tensor(*X, dtype=torch.int32), tensor(*W, dtype=torch.int32), None, 1, False, -1),
     ValueError, ["input", "float16, bfloat16, float32 or float64", "Int"]),
    ("la-long-dtype", lambda: LA(tensor(*X, dtype=torch.int64), tensor(*W, dtype=torch.int64), None, 0, False, -1),
     ValueError, ["input", "Long"]),
    ("la-float8-dtype", lambda: LA(tensor(*X).to(torch.float8_e4m3fn), tensor(*W).to(torch.float8_e4m3fn), None, 1, False, -1),
     ValueError, ["input", "Float8_e4m3fn"]),
    ("la-input-noncontig", lambda: LA(noncontig(*X), tensor(*W), None, 1, False, -1), ValueError,
     ["input", "contiguous", "strides", "[1, 3]"]),
    ("la-input-expanded", lambda: LA(torch.randn(1, 5).expand(3, 5), tensor(*W), None, 1, False, -1), ValueError,
     ["input", "contiguous", "[0, 1]"]),
    ("la-weight-noncontig", lambda: LA(tensor(*X), noncontig(*W), None, 1, False, -1), ValueError,
     ["weight", "contiguous", "[1, 7]"]),
    ("la-in-features", lambda: LA(tensor(*X), tensor(7, 6), None, 1, False, -1), ValueError,
     ["in_features", "weight.size(1) = 6", "[3, 5]", "[7, 6]"]),
    ("la-bias-shape", lambda: LA(tensor(*X), tensor(*W), tensor(6), 1, False, -1), ValueError, ["bias", "[7]", "[6]"]),
    ("la-bias-2d", lambda: LA(tensor(*X), tensor(*W), tensor(1, 7), 1, False, -1), ValueError, ["bias", "[7]", "[1, 7]"]),
    ("la-bias-dtype", lambda: LA(tensor(*X), tensor(*W), tensor(7, dtype=torch.float64), 1, False, -1), ValueError,
     ["bias", "dtype", "Float", "Double"]),
    ("la-bias-noncontig", lambda: LA(tensor(*X), tensor(*W), torch.randn(14)[::2], 1, False, -1), ValueError,
     ["bias", "contiguous", "[2]"]),
    ("la-activation-6", lambda: LA(tensor(*X), tensor(*W), None, 6, False, -1), ValueError, ["activation", "got 6"]),
    ("la-activation-gated", lambda: LA(tensor(*X), tensor(*W), None, 4, False, -1), ValueError,
     ["activation 4 (swiglu) is gated", "gated_linear"]),
    ("la-activation-neg", lambda: LA(tensor(*X), tensor(*W), None, -1, False, -1), ValueError, ["activation", "got -1"]),
    ("la-save-none", lambda: LA(tensor(*X), tensor(*W), None, 0, True, -1), ValueError, ["save_pre_act", "none"]),
    ("la-heuristic-3", lambda: LA(tensor(*X), tensor(*W), None, 1, False, -3), ValueError, ["heuristic", "-2", "got -3"]),
    ("la-heuristic-int32", lambda: LA(tensor(*X), tensor(*W), None, 1, False, 2**31), ValueError,
     ["heuristic", "int32", str(2**31)]),
    ("la-weight-device", lambda: LA(tensor(*X), tensor(*W, device="meta"), None, 1, False, -1), ValueError,
     ["weight", "device", "cpu", "meta"]),
    ("la-bias-device", lambda: LA(tensor(*X), tensor(*W), tensor(7, device="meta"), 1, False, -1), ValueError,
     ["bias", "device", "cpu", "meta"]),
    # --- act_linear_dgrad
    ("ad-weight-1d", lambda: AD(tensor(5), tensor(*DO), tensor(3, 5), 1, True, -1), ValueError, ["weight", "2-D", "1-D"]),
    ("ad-dout-3d", lambda: AD(tensor(*DW), tensor(1, 3, 7), tensor(3, 5), 1, True, -1), ValueError, ["d_output", "2-D", "3-D"]),
    ("ad-dout-dtype", lambda: AD(tensor(*DW), tensor(*DO, dtype=torch.float64), tensor(3, 5), 1, True, -1), ValueError,
     ["d_output", "dtype", "Float", "Double"]),
    ("ad-int-dtype", lambda: AD(tensor(*DW, dtype=torch.int32), tensor(*DO, dtype=torch.int32), None, 0, True, -1),
     ValueError, ["weight", "float16, bfloat16, float32 or float64", "Int"]),
    ("ad-float8-dtype", lambda: AD(tensor(*DW).to(torch.float8_e5m2), tensor(*DO).to(torch.float8_e5m2), None, 0, True, -1),
     ValueError, ["weight", "Float8_e5m2"]),
    ("ad-out-features", lambda: AD(tensor(*DW), tensor(3, 6), tensor(3, 5), 1, True, -1), ValueError,
     ["d_output.size(1)", "weight.size(0) = 7", "[3, 6]"]),
    ("ad-dout-noncontig", lambda: AD(tensor(*DW), noncontig(*DO), tensor(3, 5), 1, True, -1), ValueError,
     ["d_output", "contiguous"]),
    ("ad-weight-expanded", lambda: AD(torch.randn(1, 5).expand(7, 5), tensor(*DO), tensor(3, 5), 1, True, -1), ValueError,
     ["weight", "contiguous", "[0, 1]"]),
    ("ad-activation", lambda: AD(tensor(*DW), tensor(*DO), tensor(3, 5), 7, True, -1), ValueError, ["activation", "got 7"]),
    ("ad-heuristic", lambda: AD(tensor(*DW), tensor(*DO), tensor(3, 5), 1, True, -5), ValueError, ["heuristic", "got -5"]),
    ("ad-pre-for-none", lambda: AD(tensor(*DW), tensor(*DO), tensor(3, 5), 0, True, -1), ValueError, ["pre_act", "None", "none"]),
    ("ad-no-pre-gelu", lambda: AD(tensor(*DW), tensor(*DO), None, 1, True, -1), ValueError,
     ["pre_act", "required", "gelu_approx"]),
    ("ad-no-pre-relu", lambda: AD(tensor(*DW), tensor(*DO), None, 2, True, -1), ValueError, ["pre_act", "required", "relu"]),
    ("ad-no-pre-sqrelu", lambda: AD(tensor(*DW), tensor(*DO), None, 3, False, -1), ValueError,
     ["pre_act", "required", "sqrelu"]),
    ("ad-relu-float-pre", lambda: AD(tensor(*DW), tensor(*DO), tensor(3, 5), 2, True, -1), ValueError,
     ["relu", "pre_act", "uint8", "bit-mask", "Float"]),
    ("ad-relu-mask-width", lambda: AD(tensor(*DW), tensor(*DO), random_mask(3, 16), 2, True, -1), ValueError,
     ["relu", "pre_act", "[3, 1]", "[3, 2]"]),
    ("ad-relu-mask-rows", lambda: AD(tensor(*DW), tensor(*DO), random_mask(4, 5), 2, True, -1), ValueError,
     ["pre_act", "[3, 1]", "[4, 1]"]),
    ("ad-relu-mask-unpacked", lambda: AD(tensor(*DW), tensor(*DO), torch.ones(3, 5, dtype=torch.uint8), 2, True, -1),
     ValueError, ["pre_act", "[3, 1]", "[3, 5]"]),
    ("ad-gelu-mask-pre", lambda: AD(tensor(*DW), tensor(*DO), random_mask(3, 5), 1, True, -1), ValueError,
     ["gelu_approx", "pre_act", "dtype", "Float", "Byte"]),
    ("ad-gelu-pre-shape", lambda: AD(tensor(*DW), tensor(*DO), tensor(3, 4), 1, True, -1), ValueError,
     ["pre_act", "[3, 5]", "[3, 4]"]),
    ("ad-gelu-pre-rows", lambda: AD(tensor(*DW), tensor(*DO), tensor(2, 5), 1, True, -1), ValueError,
     ["pre_act", "[3, 5]", "[2, 5]"]),
    ("ad-sqrelu-pre-dtype", lambda: AD(tensor(*DW), tensor(*DO), tensor(3, 5, dtype=torch.float64), 3, True, -1), ValueError,
     ["sqrelu", "pre_act", "Float", "Double"]),
    ("ad-pre-noncontig", lambda: AD(tensor(*DW), tensor(*DO), noncontig(3, 5), 1, True, -1), ValueError,
     ["pre_act", "contiguous"]),
    ("ad-pre-1d", lambda: AD(tensor(*DW), tensor(*DO), tensor(15), 1, True, -1), ValueError, ["pre_act", "2-D", "1-D"]),
    ("ad-pre-device", lambda: AD(tensor(*DW), tensor(*DO), tensor(3, 5, device="meta"), 1, True, -1), ValueError,
     ["pre_act", "device", "cpu", "meta"]),
    ("ad-dout-device", lambda: AD(tensor(*DW), tensor(*DO, device="meta"), tensor(3, 5), 1, True, -1), ValueError,
     ["d_output", "device", "cpu", "meta"]),
    ("ad-act-out-relu", lambda: AD(tensor(*DW), tensor(*DO), random_mask(3, 5), 2, True, -1, True), ValueError,
     ["return_act_out", "got activation 2", "relu"]),
    ("ad-act-out-none", lambda: AD(tensor(*DW), tensor(*DO), None, 0, False, -1, True), ValueError,
     ["return_act_out", "got activation 0", "none"]),
    # --- linear_bias_wgrad
    ("wg-input-1d", lambda: WG(tensor(5), tensor(*DO), True), ValueError, ["input", "2-D", "1-D"]),
    ("wg-dout-1d", lambda: WG(tensor(*X), tensor(7), True), ValueError, ["d_output", "2-D", "1-D"]),
    ("wg-batch", lambda: WG(tensor(*X), tensor(4, 7), True), ValueError, ["d_output.size(0)", "input.size(0) = 3", "[4, 7]"]),
    ("wg-dtype", lambda: WG(tensor(*X, dtype=torch.half), tensor(*DO), True), ValueError, ["d_output", "Half", "Float"]),
    ("wg-int-dtype", lambda: WG(tensor(*X, dtype=torch.int16), tensor(*DO, dtype=torch.int16), False), ValueError,
     ["input", "Short"]),
    ("wg-noncontig", lambda: WG(noncontig(*X), tensor(*DO), True), ValueError, ["input", "contiguous"]),
    ("wg-expanded", lambda: WG(tensor(*X), torch.randn(1, 7).expand(3, 7), True), ValueError,
     ["d_output", "contiguous", "[0, 1]"]),
    ("wg-device", lambda: WG(tensor(*X), tensor(*DO, device="meta"), True), ValueError, ["d_output", "device", "meta"]),
    # --- act_forward
    ("af-int", lambda: AF(tensor(3, 4, dtype=torch.int32), 1), ValueError, ["pre_act", "Int"]),
    ("af-bool", lambda: AF(torch.ones(3, dtype=torch.bool), 2), ValueError, ["pre_act", "Bool"]),
    ("af-noncontig", lambda: AF(noncontig(3, 4), 1), ValueError, ["pre_act", "contiguous"]),
    ("af-activation", lambda: AF(tensor(3, 4), 9), ValueError, ["activation", "got 9"]),
    # --- the flash-attn compatible entry points report through the general ops
    ("flash-attn-fwd-shape", lambda: OPS.linear_act_forward(tensor(*X), tensor(7, 4), None, True, True, 0), ValueError,
     ["in_features", "[7, 4]"]),
    ("flash-attn-fwd-heuristic", lambda: OPS.linear_act_forward(tensor(*X), tensor(*W), None, False, True, -9), ValueError,
     ["heuristic", "got -9"]),
    ("flash-attn-dgrad-relu-float", lambda: OPS.bias_act_linear_dgrad_bgrad(tensor(*DW), tensor(*DO), tensor(3, 5), False, 0),
     ValueError, ["relu", "pre_act", "uint8"]),
    ("flash-attn-dgrad-gelu-shape", lambda: OPS.bias_act_linear_dgrad_bgrad(tensor(*DW), tensor(*DO), tensor(3, 7), True, 0),
     ValueError, ["pre_act", "[3, 5]", "[3, 7]"]),
    ("lib-fwd-dtype", lambda: fused_dense_lib.linear_act_forward(tensor(*X), tensor(*W, dtype=torch.half), None, True, False, 0),
     ValueError, ["weight", "Half"]),
    ("lib-wgrad-batch", lambda: fused_dense_lib.linear_bias_wgrad(tensor(*X), tensor(2, 7), True), ValueError,
     ["d_output.size(0)", "[2, 7]"]),
    ("lib-dgrad-mask", lambda: fused_dense_lib.bias_act_linear_dgrad_bgrad(tensor(*DW), tensor(*DO), random_mask(3, 9), False, 0),
     ValueError, ["pre_act", "[3, 1]", "[3, 2]"]),
    # --- Python wrappers (fused_dense.ops)
    ("py-activation-name", lambda: ops.linear_act(tensor(*X), tensor(*W), None, "gelu"), ValueError, ["activation", "'gelu'"]),
    ("py-heuristic-str", lambda: ops.linear_act(tensor(*X), tensor(*W), None, "relu", heuristic="fast"), ValueError,
     ["heuristic", "'fast'"]),
    ("py-heuristic-minus3", lambda: ops.act_linear_dgrad(tensor(*DW), tensor(*DO), None, "none", heuristic=-3), ValueError,
     ["heuristic", "-3"]),
    ("py-heuristic-bool", lambda: ops.linear_act(tensor(*X), tensor(*W), None, "relu", heuristic=True), ValueError,
     ["heuristic", "True"]),
    ("py-act-forward-name", lambda: ops.act_forward(tensor(3), "swish"), ValueError, ["activation", "'swish'"]),
]


@pytest.mark.parametrize("fn,exc,fragments", [c[1:] for c in ERROR_CASES], ids=[c[0] for c in ERROR_CASES])
def test_cpu_bad_input_error(fn, exc, fragments):
    with pytest.raises(Exception) as info:
        fn()
    assert info.type is exc, f"expected {exc.__name__}, got {info.type.__name__}: {info.value}"
    msg = str(info.value)
    missing = [f for f in fragments if f not in msg]
    assert not missing, f"message lacks {missing}: {msg}"


def test_cpu_error_checks_match_on_meta():
    """The Meta kernels reject what the real kernels reject, with the same message."""
    for fn_cpu, fn_meta in [
        (lambda: LA(tensor(*X), tensor(7, 6), None, 1, False, -1),
         lambda: LA(tensor(*X, device="meta"), tensor(7, 6, device="meta"), None, 1, False, -1)),
        (lambda: AD(tensor(*DW), tensor(*DO), random_mask(3, 16), 2, True, -1),
         lambda: AD(tensor(*DW, device="meta"), tensor(*DO, device="meta"), random_mask(3, 16).to("meta"), 2, True, -1)),
        (lambda: WG(tensor(*X), tensor(4, 7), True),
         lambda: WG(tensor(*X, device="meta"), tensor(4, 7, device="meta"), True)),
    ]:
        with pytest.raises(ValueError) as a:
            fn_cpu()
        with pytest.raises(ValueError) as b:
            fn_meta()
        strip = lambda s: str(s).split("\n")[0].replace("meta", "cpu")  # noqa: E731
        assert strip(a.value) == strip(b.value)


@pytest.mark.cuda
def test_cuda_mixed_devices_rejected():
    x, w = randn(4, 8, dtype=torch.float16, device="cuda"), randn(6, 8, dtype=torch.float16, device="cuda")
    cases = [
        (lambda: LA(x, w.cpu(), None, 1, False, -1), ["weight", "device", "cuda:0", "cpu"]),
        (lambda: LA(x, w, torch.zeros(6, dtype=torch.float16), 1, False, -1), ["bias", "device", "cpu"]),
        (lambda: AD(w, x.new_zeros(3, 6), torch.zeros(3, 8, dtype=torch.float16), 1, True, -1),
         ["pre_act", "device", "cpu"]),
        (lambda: WG(x, torch.zeros(4, 6, dtype=torch.float16), True), ["d_output", "device", "cpu"]),
    ]
    for fn, fragments in cases:
        with pytest.raises(ValueError) as info:
            fn()
        assert info.type is ValueError
        msg = str(info.value)
        assert all(f in msg for f in fragments), f"{fragments}: {msg}"


def _fp8_copies(*weights):
    """weights_fp8 for the FP8 ops: [data, data_t, scale_inv, scale] of each weight, by fp8_quantize."""
    out = []
    for w in weights:
        data, data_t, scale, scale_inv, _, _ = torch.ops.fused_dense.fp8_quantize(w, None, 0, False, 0, None, True,
                                                                                  True, False)
        out += [data, data_t, scale_inv, scale]
    return out


def _mlp_pair(x, w1, w2, activation=1):
    """The same arguments to the bf16 / fp16 MLP and to the FP8 MLP."""
    return [lambda: OPS.fused_mlp(x, w1, None, w2, None, activation, 0, -2),
            lambda: torch.ops.fused_dense.fused_mlp_fp8(x, w1, None, w2, None, activation, 0, _fp8_copies(w1, w2), 1,
                                                        None, None, [])]


# The same mistake given to a bf16 / fp16 op and to its FP8 counterpart: (id, calls, fragment of each message)
SAME_MISTAKE_CASES = [
    ("mlp-hidden-mismatch", _mlp_pair(tensor(4, 32), tensor(64, 32), tensor(32, 48)), "weight2.size(1) must equal"),
    ("mlp-in-features", _mlp_pair(tensor(4, 48), tensor(64, 32), tensor(32, 64)), "weight1.size(1) must equal x.size(1)"),
    ("mlp-x-3d", _mlp_pair(tensor(2, 4, 32), tensor(64, 32), tensor(32, 64)), "x must be 2-D"),
    ("mlp-gated-weight1", _mlp_pair(tensor(4, 32), tensor(48, 32), tensor(32, 32), activation=4), "weight1"),
    ("mlp-activation", _mlp_pair(tensor(4, 32), tensor(64, 32), tensor(32, 64), activation=7), "activation must be"),
    ("linear-in-features",
     [lambda: LA(tensor(4, 32), tensor(16, 48), None, 0, False, -2),
      lambda: torch.ops.fused_dense.fp8_linear(tensor(4, 32).to(torch.float8_e4m3fn), tensor(16, 48).to(torch.float8_e4m3fn),
                                               torch.ones(()), torch.ones(()), None, torch.float32, False, -2)],
     "must equal"),
    ("quantize-input-3d",
     [lambda: AF(tensor(2, 3, 4), 9),
      lambda: torch.ops.fused_dense.fp8_quantize(tensor(2, 3, 16), None, 0, False, 0, None, True, False, False)],
     ""),
]


@pytest.mark.parametrize("calls,fragment", [c[1:] for c in SAME_MISTAKE_CASES], ids=[c[0] for c in SAME_MISTAKE_CASES])
def test_cpu_same_mistake_same_type_on_bf16_and_fp8_ops(calls, fragment):
    for fn in calls:
        with pytest.raises(Exception) as info:
            fn()
        assert info.type is ValueError, f"expected ValueError, got {info.type.__name__}: {info.value}"
        assert fragment in str(info.value)


@pytest.mark.parametrize("case", ["mlp-hidden", "mlp-in", "mlp-out", "dense-out"])
def test_cpu_fp8_width_error_names_the_users_argument(case):
    """A width the FP8 GEMMs cannot take is named as the caller gave it (in_features,
    hidden_features, out_features), with the expected and the actual value, not through the
    internal FP8 weight copies."""
    mlp = torch.ops.fused_dense.fused_mlp_fp8
    in_f, hidden, out_f = {"mlp-hidden": (32, 24, 32), "mlp-in": (40, 32, 32), "mlp-out": (32, 32, 24),
                           "dense-out": (32, 0, 24)}[case]
    x = tensor(4, in_f)
    if case == "dense-out":
        w = tensor(out_f, in_f)
        call = lambda: torch.ops.fused_dense.fp8_dense(x, w, None, _fp8_copies(w), 1, None, None, [])  # noqa: E731
        name, got = "out_features (weight.size(0))", out_f
    else:
        w1, w2 = tensor(hidden, in_f), tensor(out_f, hidden)
        call = lambda: mlp(x, w1, None, w2, None, 1, 0, _fp8_copies(w1, w2), 1, None, None, [])  # noqa: E731
        name, got = {"mlp-hidden": ("hidden_features (weight2.size(1))", hidden),
                     "mlp-in": ("in_features (x.size(1))", in_f),
                     "mlp-out": ("out_features (weight2.size(0))", out_f)}[case]
    with pytest.raises(ValueError) as info:
        call()
    msg = str(info.value)
    assert f"{name} must be a " in msg and "multiple of 16" in msg and msg.split("\n")[0].endswith(f"got {got}"), msg
    assert "weights_fp8" not in msg, msg


@pytest.mark.parametrize("op", ["dense", "mlp"])
def test_cpu_fp8_weight_copy_of_another_shape_is_named(op):
    """A weight's transposed FP8 copy (weights_fp8[4 i + 1]) must be [in, out] of that weight, or
    empty (backward quantizes the weight again); anything else names the slot, the expected and
    the actual shape."""
    x, w1, w2 = tensor(4, 32), tensor(64, 32), tensor(32, 64)
    copies = _fp8_copies(w1, w2)
    copies[1] = copies[1][:, :48].contiguous()
    if op == "dense":
        call = lambda: torch.ops.fused_dense.fp8_dense(x, w1, None, copies[:4], 1, None, None, [])  # noqa: E731
    else:
        call = lambda: torch.ops.fused_dense.fused_mlp_fp8(x, w1, None, w2, None, 1, 0, copies, 1, None, None,  # noqa: E731
                                                           [])
    with pytest.raises(ValueError) as info:
        call()
    msg = str(info.value)
    assert "weights_fp8[1] must be weight1's transposed FP8 copy [32, 64] or empty" in msg and "got [32, 48]" in msg, msg


@pytest.mark.parametrize("op", ["dense", "mlp"])
@pytest.mark.parametrize("mistake", ["count", "scale"])
def test_cpu_fp8_weight_copies_miscounted_or_scale_of_another_type_are_named(op, mistake):
    """weights_fp8 holds 4 tensors a weight (data, data_t, scale_inv, scale): a list of another
    length (here 3 a weight, without the scale) names the count expected and got; a scale that is
    not a float32 scalar names its slot."""
    x, w1, w2 = tensor(4, 32), tensor(64, 32), tensor(32, 64)
    copies = _fp8_copies(w1) if op == "dense" else _fp8_copies(w1, w2)
    if mistake == "count":
        copies = [t for i, t in enumerate(copies) if i % 4 != 3]
    else:
        copies[3] = copies[3].double()
    if op == "dense":
        call = lambda: torch.ops.fused_dense.fp8_dense(x, w1, None, copies, 1, None, None, [])  # noqa: E731
    else:
        call = lambda: torch.ops.fused_dense.fused_mlp_fp8(x, w1, None, w2, None, 1, 0, copies, 1, None, None,  # noqa: E731
                                                           [])
    with pytest.raises(ValueError) as info:
        call()
    msg = str(info.value)
    if mistake == "count":
        want = "must hold 4 tensors" if op == "dense" else "must hold 8 tensors"
        assert want in msg and f"got {len(copies)}" in msg, msg
    else:
        assert "weights_fp8[3] must be weight1's float32 scale, got Double" in msg, msg
