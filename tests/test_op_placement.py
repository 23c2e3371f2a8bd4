"""Where the operands live on CUDA: each op runs on its tensors' device whatever the current device,
on the current stream (not the default one), and gives the same results on contiguous inputs at a
storage offset that breaks 16-byte alignment (the vectorized kernels and cuBLASLt's alignment-dependent
algorithms must fall back). References in tests/op_checks.py; tolerances docs/contract.md.
"""
import math

import pytest
import torch

from op_checks import ACT_CODE, ACTS, HALF_DTYPES, OPS, check_relu_mask, pack_bits, randn, ref_act, ref_dgrad, \
    ref_pre
from conftest import assert_close_rel, poison_cuda_cache


@pytest.mark.cuda
def test_cuda_runs_on_tensor_device_whatever_current_device():
    n = torch.cuda.device_count()
    for dev in range(n):
        for current in range(n):
            with torch.cuda.device(current):
                d = f"cuda:{dev}"
                x = randn(17, 136, dtype=torch.float16, device=d)
                w = randn(128, 136, dtype=torch.float16, device=d, scale=0.1)
                b = randn(128, dtype=torch.float16, device=d)
                out, mask = OPS.linear_act(x, w, b, ACT_CODE["relu"], True, 0)
                assert out.device == x.device and mask.device == x.device
                assert_close_rel(out, ref_act(ref_pre(x, w, b), "relu"), torch.float16)
                w2 = randn(128, 128, dtype=torch.float16, device=d, scale=0.1)  # weight of a next layer
                d_in, d_b = OPS.act_linear_dgrad(w2, out, mask, ACT_CODE["relu"], True, 0)
                assert d_in.device == x.device and d_b.device == x.device
                assert_close_rel(d_in, ref_dgrad(w2, out, None, "relu", mask)[0], torch.float16)
                d_w, d_b = OPS.linear_bias_wgrad(x, out, True)
                assert d_w.device == x.device and d_b.device == x.device
                assert_close_rel(d_w, out.double().t() @ x.double(), torch.float16)
                assert OPS.act_forward(x, 1).device == x.device
                assert torch.cuda.current_device() == current


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=str)
def test_cuda_non_default_stream(dtype):
    """The ops run on the current stream. On a side stream s: sleep, then write the inputs, then
    call the op. An op that ran on any other stream would read the inputs before s wrote them
    (they start as NaN) and return garbage; on s it sees the final inputs."""
    B, K, N = 256, 1024, 1024
    src_x = randn(B, K, dtype=dtype, device="cuda")
    src_w = randn(N, K, dtype=dtype, device="cuda", scale=1 / math.sqrt(K))
    src_b = randn(N, dtype=dtype, device="cuda")
    src_do = randn(B, N, dtype=dtype, device="cuda")
    x, w, b, dout = (torch.full_like(t, float("nan")) for t in (src_x, src_w, src_b, src_do))
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    results = {}
    for h in (-2, -1, 0):
        for act in ["gelu_approx", "relu", "sqrelu", "none"]:
            save = act != "none"
            with torch.cuda.stream(s):
                for t in (x, w, b, dout):
                    t.fill_(float("nan"))
                poison_cuda_cache()
                torch.cuda._sleep(20_000_000)
                x.copy_(src_x), w.copy_(src_w), b.copy_(src_b), dout.copy_(src_do)
                fwd = OPS.linear_act(x, w, b, ACT_CODE[act], save, h)
                dg = OPS.act_linear_dgrad(w.t().contiguous(), dout, fwd[1] if save else None, ACT_CODE[act], True, h)
                wg = OPS.linear_bias_wgrad(x, dout, True)
                af = OPS.act_forward(x, ACT_CODE[act])
            results[(h, act)] = (fwd, dg, wg, af)
    s.synchronize()
    torch.cuda.synchronize()
    pre64 = ref_pre(src_x, src_w, src_b)
    for (h, act), (fwd, dg, wg, af) in results.items():
        ctx = f"stream h={h} {act}"
        assert_close_rel(fwd[0], ref_act(pre64, act), dtype, f"{ctx} out")
        if act == "relu":
            check_relu_mask(fwd[1], fwd[0], pre64, ctx)
        elif act != "none":
            assert_close_rel(fwd[1], pre64, dtype, f"{ctx} pre_act")
        saved = fwd[1] if len(fwd) == 2 else None
        d_ref, db_ref = ref_dgrad(src_w.t().contiguous(), src_do, saved, act, saved)
        assert_close_rel(dg[0], d_ref, dtype, f"{ctx} d_input")
        assert_close_rel(dg[1], db_ref, dtype, f"{ctx} d_bias")
        assert_close_rel(wg[0], src_do.double().t() @ src_x.double(), dtype, f"{ctx} d_weight")
        assert_close_rel(wg[1], src_do.double().sum(0), dtype, f"{ctx} wgrad d_bias")
        assert_close_rel(af, ref_act(src_x.double(), act), dtype, f"{ctx} act_forward")


@pytest.mark.cuda
@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=str)
def test_cuda_misaligned_inputs(dtype, act):
    """Inputs at an odd storage offset (contiguous, but not 16-byte aligned) are still right."""
    def shifted(*shape, scale=1.0):
        flat = randn(1 + math.prod(shape), dtype=dtype, device="cuda", scale=scale)
        return flat[1:].view(shape)

    for B, K, N in [(17, 136, 128), (64, 128, 1024), (5, 33, 64)]:
        x, w, b = shifted(B, K), shifted(N, K, scale=1 / math.sqrt(K)), shifted(N)
        for h in (-2, -1, 0):
            save = act != "none"
            poison_cuda_cache()
            res = OPS.linear_act(x, w, b, ACT_CODE[act], save, h)
            pre64 = ref_pre(x, w, b)
            ctx = f"misaligned B={B} K={K} N={N} {dtype} {act} h={h}"
            assert_close_rel(res[0], ref_act(pre64, act), dtype, f"{ctx} out")
            wd, dout = shifted(N, K, scale=1 / math.sqrt(N)), shifted(B, N)
            if act in ("gelu_approx", "sqrelu"):
                pre = shifted(B, K)
                saved = pre
            elif act == "relu":
                pre = randn(B, K, dtype=dtype, device="cuda")
                m = pack_bits(pre >= 0).cuda()
                saved = torch.empty(1 + m.numel(), dtype=torch.uint8, device="cuda")[1:].view(m.shape)
                saved.copy_(m)
            else:
                pre, saved = None, None
            poison_cuda_cache()
            d_in, d_b = OPS.act_linear_dgrad(wd, dout, saved, ACT_CODE[act], True, h)
            d_ref, db_ref = ref_dgrad(wd, dout, pre, act, saved)
            assert_close_rel(d_in, d_ref, dtype, f"{ctx} d_input")
            assert_close_rel(d_b, db_ref, dtype, f"{ctx} d_bias")
            poison_cuda_cache()
            d_w, d_bw = OPS.linear_bias_wgrad(x, dout, True)
            assert_close_rel(d_w, dout.double().t() @ x.double(), dtype, f"{ctx} d_weight")
            assert_close_rel(d_bw, dout.double().sum(0), dtype, f"{ctx} wgrad d_bias")
