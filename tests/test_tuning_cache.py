"""heuristic='auto' persisted across processes (FUSED_DENSE_TUNING_CACHE, csrc/core/tuning/tuner.cpp):
the first process measures and appends one line per problem; a second process reads the lines
back and measures nothing; a line of another format (or numbering of the cutlass_sm90 kernels'
variants) is ignored (re-measured), a choice the build does not have (a cutlass_sm90 variant out of
range) falls back to the plain GEMM with correct results, and an unwritable path only costs
re-measuring.

Each process checks its results against a float64 reference built from plain PyTorch on fresh
random data, and saves them, so the test can also compare the two processes bit for bit."""
import os
import re
import subprocess
import sys

import pytest
import torch

import fused_dense
from conftest import TOL

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TUNED = re.compile(r"fused_dense: tuned (dgrad|forward) ")

# A GELU data gradient with its bias gradient and a GELU forward saving the pre-activation, both at
# 'auto', on 16-byte aligned bf16 operands (the cutlass_sm90 variants are candidates on the H200).
# argv: output file, random seed, tolerance (conftest.TOL[torch.bfloat16], docs/contract.md).
SCRIPT = r"""
import sys, torch, torch.nn.functional as F
from fused_dense import ops
torch.manual_seed(int(sys.argv[2]))
B, K, N = 512, 384, 256
dt = torch.bfloat16
w = torch.randn(N, K, device='cuda', dtype=dt) / K ** 0.5
g = torch.randn(B, N, device='cuda', dtype=dt)
pre = torch.randn(B, K, device='cuda', dtype=dt)
x = torch.randn(B, K, device='cuda', dtype=dt)
w1 = torch.randn(N, K, device='cuda', dtype=dt) / K ** 0.5
b1 = torch.randn(N, device='cuda', dtype=dt)
d_in, d_b = ops.act_linear_dgrad(w, g, pre, 'gelu_approx', True, 'auto')
out, pre_out = ops.linear_act(x, w1, b1, 'gelu_approx', True, 'auto')
torch.cuda.synchronize()

def rel(a, b):
    return ((a.double().cpu() - b).norm() / b.norm()).item()

p64 = pre.double().cpu().requires_grad_()
F.gelu(p64, approximate='tanh').backward(g.double().cpu() @ w.double().cpu())
pre_ref = x.double().cpu() @ w1.double().cpu().T + b1.double().cpu()
errs = [rel(d_in, p64.grad), rel(d_b, p64.grad.sum(0)), rel(pre_out, pre_ref),
        rel(out, F.gelu(pre_ref, approximate='tanh'))]
print('errors', errs)
assert max(errs) <= float(sys.argv[3]), errs
torch.save([t.cpu() for t in (d_in, d_b, out, pre_out)], sys.argv[1])
"""


def run(tmp_path, name, cache, seed=1):
    # unpaced, without the shipped table: every problem is measured where nothing is cached
    env = dict(os.environ, FUSED_DENSE_TUNING_VERBOSE="1", FUSED_DENSE_TUNING="1", FUSED_DENSE_TUNING_CACHE=str(cache),
               FUSED_DENSE_TUNING_PACE="1", FUSED_DENSE_TUNING_TABLE="0")
    env.pop("FUSED_DENSE_TUNING_CANDIDATES", None)
    out = tmp_path / f"{name}.pt"
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(out), str(seed), str(TOL[torch.bfloat16])], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{name}: {proc.stdout[-2000:]}{proc.stderr[-3000:]}"
    return len(TUNED.findall(proc.stderr)), torch.load(out)


def cuda_or_skip():
    if not (fused_dense.has_cuda_kernels() and torch.cuda.is_available()):
        pytest.skip("needs the CUDA kernels and a GPU")


def cache_lines(cache):
    return [line for line in cache.read_text().splitlines() if line.strip()]


@pytest.mark.cuda
def test_second_process_reads_the_choices_back(tmp_path):
    cuda_or_skip()
    cache = tmp_path / "tuning.txt"
    tuned, first = run(tmp_path, "first", cache)
    assert tuned == 2, f"expected the dgrad and the forward measured once each, got {tuned} lines"
    lines = cache_lines(cache)
    assert len(lines) == 2, lines
    # tag: compute capability / cuBLASLt major.minor / line format (csrc/core/tuning/tuner.cpp)
    assert all(re.match(r"sm\d+/cublasLt\d+\.\d+/choices\d+ ", line) for line in lines), lines
    tuned, second = run(tmp_path, "second", cache)
    assert tuned == 0, "the second process measured again instead of reading the cache"
    assert len(cache_lines(cache)) == 2, "the second process appended lines"
    for a, b in zip(first, second):  # same choices, same inputs: the same bits
        assert torch.equal(a, b)


@pytest.mark.cuda
def test_line_of_another_format_is_ignored(tmp_path):
    cuda_or_skip()
    cache = tmp_path / "tuning.txt"
    run(tmp_path, "first", cache)
    # the same problems as a build with another line format or variant numbering writes them
    stale = [re.sub(r"/choices\d+ ", "/choices0 ", line, count=1) for line in cache_lines(cache)]
    assert all("/choices0 " in line for line in stale), stale
    cache.write_text("\n".join(stale) + "\n")
    tuned, _ = run(tmp_path, "second", cache)
    assert tuned == 2, "a line written for another line format was used"


@pytest.mark.cuda
def test_choice_the_build_lacks_falls_back_correctly(tmp_path):
    cuda_or_skip()
    cache = tmp_path / "tuning.txt"
    run(tmp_path, "first", cache)
    # each line ends "<fused> <algorithm> <cutlass_sm90 variant> <has_algo> <8 words>": a variant no
    # build has
    lacking = [line.rsplit(" ", 12)[0] + " 0 0 999 0" + " 0000000000000000" * 8 for line in cache_lines(cache)]
    cache.write_text("\n".join(lacking) + "\n")
    tuned, _ = run(tmp_path, "second", cache, seed=2)  # the script checks against float64 itself
    assert tuned == 0, "the lines were not read"


@pytest.mark.cuda
def test_unwritable_cache_path_only_costs_measuring(tmp_path):
    cuda_or_skip()
    tuned, _ = run(tmp_path, "first", tmp_path)  # a directory: cannot be opened as a file
    assert tuned == 2
