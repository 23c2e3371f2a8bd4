"""'auto' for the FP8 GEMM (fp8_linear; csrc/core/ops/fp8_linear.cpp, csrc/core/tuning/tuner.h):
the tuner measures cuBLASLt's FP8 algorithms as it measures the bf16 ones, every algorithm it may
pick gives the right product, a choice measured at a bucket's representative serves another count
of the bucket correctly, deterministic mode runs cuBLASLt's first algorithm and never a timed
choice, and the choices are exported with the others.

Each result is checked against a float64 product of the dequantized operands. Widths are this
file's own, so no other test's choices are met."""
import pytest
import torch

import fused_dense
from conftest import rel_err
from fused_dense import tuning

E4, E5 = torch.float8_e4m3fn, torch.float8_e5m2
# (input format, weight format, fast_accum) as the FP8 layers call them: the forward, a data or
# weight gradient (e5m2 gradient times an e4m3 operand), and the e4m3 x e5m2 pair the op allows.
PAIRS = [(E4, E4, True), (E5, E4, False), (E4, E5, False)]
# One bf16 rounding of a K-long FP8 sum: the bf16 tolerance of docs/contract.md; fp16 its own.
TOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3}


def cuda_or_skip():
    if not (fused_dense.has_cuda_kernels() and torch.cuda.is_available()):
        pytest.skip("needs the CUDA kernels and a GPU")
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("needs an FP8 GPU")


@pytest.fixture
def measuring():
    """Measuring allowed without budget or pace limits, no table or cache file, not deterministic."""
    cuda_or_skip()
    previous = tuning.configure(enabled=True, budget_s=1e6, pace=1.0, table="", cache="", deterministic=False,
                                refine=True)
    yield
    tuning.configure(**previous)


def quantized(shape, fmt):
    """A tensor quantized at its amax, as fp8_quantize does, and its scale_inv."""
    t = torch.randn(shape, device="cuda")
    amax = t.abs().max()
    return (t * (torch.finfo(fmt).max / amax)).to(fmt), (amax / torch.finfo(fmt).max).float()


def operands(B, K, N, fin, fw, bias, out_dtype):
    x, sx = quantized((B, K), fin)
    w, sw = quantized((N, K), fw)
    b = torch.randn(N, device="cuda", dtype=out_dtype) if bias else None
    ref = (x.double() * sx.double()) @ (w.double() * sw.double()).T
    if bias:
        ref = ref + b.double()
    return (x, w, sx, sw, b), ref


def lin(args, out_dtype, fast, heuristic):
    return torch.ops.fused_dense.fp8_linear(*args, out_dtype, fast, heuristic)


def every_index(args, out_dtype, fast):
    """Each index of cuBLASLt's list for the problem: {index: result}."""
    outs = {}
    for i in range(64):
        try:
            outs[i] = lin(args, out_dtype, fast, i)
        except ValueError as e:
            assert "out of range" in str(e), e
            break
    assert 0 in outs
    return outs


@pytest.mark.cuda
@pytest.mark.parametrize("pair", PAIRS, ids=["e4m3xe4m3", "e5m2xe4m3", "e4m3xe5m2"])
@pytest.mark.parametrize("bias,out_dtype", [(False, torch.bfloat16), (True, torch.bfloat16), (True, torch.float16)])
def test_auto_measures_fp8_gemms_and_every_candidate_is_right(measuring, pair, bias, out_dtype):
    fin, fw, fast = pair
    B, K, N = 1536, 528, 784  # 1536 is a representative (1.5 * 2^10)
    args, ref = operands(B, K, N, fin, fw, bias, out_dtype)
    candidates = every_index(args, out_dtype, fast)
    for i, out in candidates.items():
        assert rel_err(out, ref) <= TOL[out_dtype], f"index {i}: {rel_err(out, ref)}"
    before = tuning.stats()["problems_measured"]
    out = lin(args, out_dtype, fast, -2)
    measured = tuning.stats()["problems_measured"]
    assert measured == before + 1, "'auto' did not measure the FP8 GEMM"
    assert rel_err(out, ref) <= TOL[out_dtype]
    # the measured choice is one of the list's algorithms at this (representative) M: its bits are
    # that index's, and a second call measures nothing and gives them again
    assert any(torch.equal(out, c) for c in candidates.values()), "'auto' ran no algorithm of cuBLASLt's list"
    again = lin(args, out_dtype, fast, -2)
    assert tuning.stats()["problems_measured"] == measured
    assert torch.equal(again, out)


@pytest.mark.cuda
@pytest.mark.parametrize("pair", PAIRS, ids=["e4m3xe4m3", "e5m2xe4m3", "e4m3xe5m2"])
def test_a_bucket_choice_serves_another_count_of_the_bucket(measuring, pair):
    """With refine off, 1000 tokens take the choice measured at their representative (1024): an
    algorithm listed for another M, checked for this one, or cuBLASLt's first for this M."""
    fin, fw, fast = pair
    K, N = 544, 800
    tuning.configure(refine=False)
    rep_args, _ = operands(1024, K, N, fin, fw, False, torch.bfloat16)
    lin(rep_args, torch.bfloat16, fast, -2)
    measured = tuning.stats()["problems_measured"]
    args, ref = operands(1000, K, N, fin, fw, False, torch.bfloat16)
    out = lin(args, torch.bfloat16, fast, -2)
    assert tuning.stats()["problems_measured"] == measured, "a count of a measured bucket was measured again"
    assert rel_err(out, ref) <= TOL[torch.bfloat16]
    # with refine on, the exact count is measured and is right as well
    tuning.configure(refine=True)
    out = lin(args, torch.bfloat16, fast, -2)
    assert tuning.stats()["problems_measured"] == measured + 1
    assert rel_err(out, ref) <= TOL[torch.bfloat16]


@pytest.mark.cuda
def test_deterministic_mode_runs_the_first_algorithm_never_a_timed_one(measuring):
    """In deterministic mode 'auto' at a representative M gives index 0's bits (the rule, cuBLASLt's
    first algorithm) and measures nothing, whether or not the process measured the problem
    before."""
    fin, fw, fast = PAIRS[0]
    args, ref = operands(2048, 560, 816, fin, fw, True, torch.bfloat16)
    first = lin(args, torch.bfloat16, fast, 0)
    before = tuning.stats()["problems_measured"]
    torch.use_deterministic_algorithms(True)
    try:
        det = lin(args, torch.bfloat16, fast, -2)
        assert tuning.stats()["problems_measured"] == before
        assert torch.equal(det, first)
    finally:
        torch.use_deterministic_algorithms(False)
    timed = lin(args, torch.bfloat16, fast, -2)  # measures now
    assert tuning.stats()["problems_measured"] == before + 1
    assert rel_err(timed, ref) <= TOL[torch.bfloat16]
    tuning.configure(deterministic=True)
    det = lin(args, torch.bfloat16, fast, -2)
    assert torch.equal(det, first), "a timed FP8 choice reached deterministic mode"
    assert rel_err(det, ref) <= TOL[torch.bfloat16]


@pytest.mark.cuda
def test_fp8_choices_are_exported_by_their_op_kind(measuring):
    """export_choices holds the FP8 problems, keyed by the operand formats' op kind (5: e4m3 x
    e4m3, 6: e5m2 x e4m3, 7: e4m3 x e5m2; the key's first number), with the width K and N."""
    K, N = 576, 832
    for fin, fw, fast in PAIRS:
        args, _ = operands(1024, K, N, fin, fw, False, torch.bfloat16)
        lin(args, torch.bfloat16, fast, -2)
    keys = [line.split()[1:11] for line in tuning.export_choices()]
    kinds = {k[0] for k in keys if k[3:5] == [str(K), str(N)]}
    assert kinds == {"5", "6", "7"}, kinds
