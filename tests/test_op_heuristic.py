"""The `heuristic` argument of the ops: -2 'auto', -1 the unfused path, an index >= 0 into the list of
algorithms cuBLASLt offers for the problem (docs/contract.md). On CUDA an index past that list is a
ValueError naming the valid range, and the last index in that range works; on CPU, where there is no
list, any index >= 0 is accepted.
"""
import math
import re

import pytest
import torch

from op_checks import ACT_CODE, HALF_DTYPES, OPS, pack_bits, randn, ref_act, ref_dgrad, ref_pre
from conftest import assert_close_rel


def test_cpu_heuristic_not_validated_against_cublaslt():
    """On CPU there is no cuBLASLt list: any index >= 0 is accepted (documented behaviour)."""
    x, w = randn(3, 4, dtype=torch.float32), randn(5, 4, dtype=torch.float32)
    out, = OPS.linear_act(x, w, None, 0, False, 10_000)
    assert_close_rel(out, ref_pre(x, w, None), torch.float32)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=str)
def test_cuda_heuristic_out_of_range(dtype):
    """A huge index is always the clear ValueError; the last index the message offers works."""
    B, K, N = 64, 128, 256
    x = randn(B, K, dtype=dtype, device="cuda")
    w = randn(N, K, dtype=dtype, device="cuda", scale=1 / math.sqrt(K))
    b = randn(N, dtype=dtype, device="cuda")
    wd = randn(N, K, dtype=dtype, device="cuda", scale=1 / math.sqrt(N))
    dout = randn(B, N, dtype=dtype, device="cuda")
    pre = randn(B, K, dtype=dtype, device="cuda")
    mask = pack_bits(pre >= 0).cuda()
    calls = {}
    for act, save in [("none", False), ("gelu_approx", False), ("gelu_approx", True), ("relu", False),
                      ("relu", True), ("sqrelu", True)]:
        calls[f"linear_act {act} save={save}"] = (
            lambda h, act=act, save=save: OPS.linear_act(x, w, b, ACT_CODE[act], save, h),
            lambda res, act=act: assert_close_rel(res[0], ref_act(ref_pre(x, w, b), act), dtype))
    for act, saved in [("none", None), ("gelu_approx", pre), ("relu", mask), ("sqrelu", pre)]:
        calls[f"act_linear_dgrad {act}"] = (
            lambda h, act=act, saved=saved: OPS.act_linear_dgrad(wd, dout, saved, ACT_CODE[act], True, h),
            lambda res, act=act, saved=saved: assert_close_rel(res[0], ref_dgrad(wd, dout, pre, act, saved)[0], dtype))
    calls["linear_act_forward"] = (lambda h: OPS.linear_act_forward(x, w, b, True, True, h),
                                   lambda res: assert_close_rel(res[1], ref_pre(x, w, b), dtype))
    calls["bias_act_linear_dgrad_bgrad"] = (
        lambda h: OPS.bias_act_linear_dgrad_bgrad(wd, dout, mask, False, h),
        lambda res: assert_close_rel(res[0], ref_dgrad(wd, dout, pre, "relu", mask)[0], dtype))
    for name, (call, check) in calls.items():
        with pytest.raises(ValueError) as info:
            call(10_000)
        msg = str(info.value)
        assert "heuristic" in msg and "out of range" in msg and "10000" in msg, f"{name}: {msg}"
        last = re.search(r"in \[0, (\d+)\]", msg)
        assert last, f"{name}: message does not give the valid range: {msg}"
        check(call(int(last.group(1))))
