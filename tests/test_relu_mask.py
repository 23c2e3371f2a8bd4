"""The ReLU bit-mask linear_act saves and act_linear_dgrad reads (layout: docs/contract.md): bit j % 8
of byte j // 8 of row i is set exactly when pre_act[i, j] >= 0, exact zeros included; padding bits past
N are written as zero and ignored when read. The CUDA mask (cuBLASLt's RELU_AUX where it takes the
width, the elementwise fallback elsewhere) equals the CPU mask byte for byte on inputs whose GEMM is exact.
"""
import math

import pytest
import torch

from op_checks import (ACT_CODE, CPU_DTYPES, CUDA_HEURISTICS, HALF_DTYPES, OPS, check_dgrad, pack_bits, randn,
                       random_shapes, ref_pre, run_heuristic, unpack_bits)
from conftest import assert_close_rel, poison_cuda_cache


@pytest.mark.parametrize("dtype", CPU_DTYPES, ids=str)
def test_cpu_relu_mask_layout(dtype):
    """Bit j % 8 of byte j // 8 of row i == (pre[i, j] >= 0), padding bits zero, decoded by hand."""
    for B, K, N in [(3, 5, 1), (4, 9, 7), (2, 16, 8), (5, 11, 9), (3, 20, 17), (2, 8, 130), *random_shapes(3, 70)]:
        x = randn(B, K, dtype=dtype)
        w = randn(N, K, dtype=dtype, scale=1.0 / math.sqrt(K))
        b = randn(N, dtype=dtype)
        out, mask = OPS.linear_act(x, w, b, ACT_CODE["relu"], True, -1)
        pre, = OPS.linear_act(x, w, b, ACT_CODE["none"], False, -1)
        assert mask.shape == (B, (N + 7) // 8) and mask.dtype == torch.uint8
        mask_l, pos_l = mask.tolist(), (pre >= 0).tolist()
        for i in range(B):
            for j in range((N + 7) // 8 * 8):
                bit = (mask_l[i][j // 8] >> (j % 8)) & 1
                want = int(pos_l[i][j]) if j < N else 0
                assert bit == want, f"B={B} N={N} {dtype}: row {i} bit {j} is {bit}, expected {want}"
        # ...and the saved mask is what the ReLU output implies.
        assert torch.equal(unpack_bits(mask)[:, :N], pre >= 0)
        assert torch.equal(out, torch.relu(pre))


def test_cpu_relu_mask_exact_inputs():
    """On inputs whose GEMM is exact (small integers), the mask equals pack(pre64 >= 0) byte for
    byte, exact zeros included (their bit is set)."""
    for dtype in CPU_DTYPES:
        for B, K, N in [(6, 17, 9), (16, 64, 128), (3, 33, 136)]:
            x = torch.randint(-1, 2, (B, K)).to(dtype)
            w = torch.randint(-1, 2, (N, K)).to(dtype)
            out, mask = OPS.linear_act(x, w, None, ACT_CODE["relu"], True, -1)
            pre64 = ref_pre(x, w, None)
            assert (pre64 == 0).any()
            assert torch.equal(mask, pack_bits(pre64 >= 0)), f"{dtype} {(B, K, N)}"
            assert torch.equal(out.double(), torch.relu(pre64))


def test_cpu_relu_dgrad_ignores_padding_bits():
    """A mask whose padding bits are all set gives the same data gradient as one with them clear."""
    for shape in [(4, 13, 7), (3, 1, 5), (9, 30, 17)]:
        check_dgrad("cpu", torch.float32, "relu", True, -1, shape, set_padding=True)


@pytest.mark.cuda
@pytest.mark.parametrize("heuristic", CUDA_HEURISTICS)
@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=str)
def test_cuda_relu_mask_bit_exact_vs_cpu(dtype, heuristic):
    """The CUDA ReLU bit-mask (cuBLASLt's for N % 128 == 0, the elementwise fallback otherwise)
    equals the CPU one byte for byte.

    Random normal inputs would make this flaky: the CUDA and CPU GEMMs accumulate in different
    orders, so an element whose pre-activation is within rounding error of 0 may legitimately get
    different signs. Here every product and partial sum is exact in the fp32 accumulator: x and w
    are +-1, except w[:, 0] = +-0.5, and the bias is an integer in [-2, 2], so every pre-activation
    is a half-integer, never 0 and of exact sign on both devices. The mask therefore has exactly
    one right answer, and the two must agree bit for bit (padding included).
    """
    for B, K, N in [(17, 64, 128), (256, 1024, 1024), (1000, 136, 256), (33, 128, 136), (5, 33, 64), (8, 64, 33),
                    (1, 8, 7)]:
        for has_bias in (False, True):
            sign = lambda *s: torch.randint(0, 2, s).float() * 2 - 1  # noqa: E731
            x = sign(B, K).to(dtype)
            w = sign(N, K)
            w[:, 0] *= 0.5
            w = w.to(dtype)
            b = torch.randint(-2, 3, (N,)).to(dtype) if has_bias else None
            out_cpu, mask_cpu = OPS.linear_act(x, w, b, ACT_CODE["relu"], True, -1)
            assert torch.equal(mask_cpu, pack_bits(ref_pre(x, w, b) >= 0))
            xc, wc, bc = x.cuda(), w.cuda(), None if b is None else b.cuda()
            poison_cuda_cache()
            res = run_heuristic(lambda: OPS.linear_act(xc, wc, bc, ACT_CODE["relu"], True, heuristic), heuristic)
            if res is None:
                continue
            out, mask = res
            ctx = f"B={B} K={K} N={N} {dtype} bias={has_bias} h={heuristic}"
            assert torch.equal(mask.cpu(), mask_cpu), \
                f"{ctx}: {int((unpack_bits(mask) != unpack_bits(mask_cpu)).sum())} bits differ from the CPU mask"
            assert_close_rel(out, out_cpu.double(), dtype, f"{ctx} out")


@pytest.mark.cuda
@pytest.mark.parametrize("heuristic", [-2, -1, 0, 1])
@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=str)
def test_cuda_relu_mask_exact_zero(dtype, heuristic):
    """pre == 0 exactly sets its bit on CUDA (cuBLASLt's RELU_AUX and the fallback kernel) as on
    CPU. x, w in {-1, 0, 1} without bias: every pre-activation is an exact small integer, many 0."""
    for B, K, N in [(64, 64, 128), (64, 64, 136), (17, 32, 1024), (5, 16, 33)]:
        x = torch.randint(-1, 2, (B, K)).to(dtype)
        w = torch.randint(-1, 2, (N, K)).to(dtype)
        pre64 = ref_pre(x, w, None)
        assert (pre64 == 0).any()
        _, mask_cpu = OPS.linear_act(x, w, None, ACT_CODE["relu"], True, -1)
        assert torch.equal(mask_cpu, pack_bits(pre64 >= 0))
        poison_cuda_cache()
        res = run_heuristic(lambda: OPS.linear_act(x.cuda(), w.cuda(), None, ACT_CODE["relu"], True, heuristic),
                            heuristic)
        if res is None:
            continue
        bits, bits_cpu = unpack_bits(res[1]), unpack_bits(mask_cpu)
        zero_wrong = int(((bits != bits_cpu)[:, :N] & (pre64 == 0).cpu()).sum())
        assert torch.equal(res[1].cpu(), mask_cpu), \
            f"B={B} K={K} N={N} {dtype} h={heuristic}: {int((bits != bits_cpu).sum())} bits differ from the CPU mask " \
            f"({zero_wrong} of them at pre == 0)"


@pytest.mark.cuda
@pytest.mark.parametrize("heuristic", [-2, -1, 0, 1])
@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=str)
def test_cuda_relu_dgrad_ignores_padding_bits(dtype, heuristic):
    for s in [(17, 33, 64), (256, 1000, 128), (3, 7, 128)]:
        check_dgrad("cuda", dtype, "relu", True, heuristic, s, poison=True, set_padding=True)
