"""fused_dense's own CUTLASS GEMMs (csrc/core/own_dgrad_sm90.cu, own_forward_sm90.cu), run through
the existing op, functional and module tests: a fresh pytest process with
FUSED_DENSE_TUNING_CANDIDATES=own, where heuristic='auto' measures only the own GEMMs' variants
wherever they apply (data gradients with gelu_approx or no activation; forwards with gelu_approx,
a bias and the pre-activation saved; fp16 / bf16, widths multiples of 8, compute capability 9.0)
and keeps the fixed rule everywhere else. The tuner's verbose lines show which problems took them."""
import os
import re
import subprocess
import sys

import pytest
import torch

import fused_dense

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# every CUDA test that sends a gelu_approx or plain data gradient through 'auto' (op; MLP and
# module, whose fc1 data gradient is the plain one), the op test of the forward with gelu_approx, a
# bias and the pre-activation saved at 'auto' (heuristic -2), the CUDA-graph capture and replay of
# FusedMLP (its default gelu_approx, tuned before capture), and its forward + backward on two
# streams at once
SELECTION = ["tests/test_ops.py", "tests/test_functional.py", "tests/test_modules.py", "tests/test_concurrency.py",
             "-k", "(act_linear_dgrad and (gelu_approx or none)) or (test_cuda_linear_act and gelu_approx and "
             "True-True--2]) or (mlp and gelu_approx and auto) or graph_replay or two_streams_forward_backward"]
# test_ops.CUDA_SHAPES (B, K, N) whose widths the own GEMM takes (K and N multiples of 8)
OWN_SHAPES = [(1, 64, 64), (256, 128, 128), (1000, 1024, 1024), (256, 1024, 64), (1000, 64, 1024),
              (1, 1024, 128), (17, 128, 256), (256, 136, 1024)]
TUNED = re.compile(r"fused_dense: tuned (dgrad|forward) (\w+) (\w+) B=(\d+) K=(\d+) N=(\d+): "
                   r"(own GEMM variant|fused|unfused) ")


def own_gemm_expected():
    return fused_dense.has_cuda_kernels() and torch.cuda.is_available() and fused_dense.has_own_gemm() \
        and torch.cuda.get_device_capability() == (9, 0)


@pytest.mark.cuda
def test_own_dgrad_through_the_suite():
    if not own_gemm_expected():
        pytest.skip("needs a build with the own GEMM (fused_dense.has_own_gemm()) and a compute capability 9.0 GPU")
    env = dict(os.environ, FUSED_DENSE_TUNING_CANDIDATES="own", FUSED_DENSE_TUNING_VERBOSE="1",
               FUSED_DENSE_TUNING="1")
    env.pop("FUSED_DENSE_TUNING_CACHE", None)  # measure afresh, never reuse another run's choices
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", "-m", "cuda",
                           *SELECTION], cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    tail = (proc.stdout[-3000:] + proc.stderr[-3000:])
    assert proc.returncode == 0, f"the suite with the own GEMM pinned failed:\n{tail}"
    assert re.search(r"\d+ passed", proc.stdout) and "failed" not in proc.stdout.splitlines()[-1], tail
    tuned = [m.groups() for m in TUNED.finditer(proc.stdout + proc.stderr)]
    # with only own candidates allowed, nothing else can be chosen by measurement
    others = [t for t in tuned if t[6] != "own GEMM variant"]
    assert not others, f"tuned to something other than the own GEMM: {others[:5]}"
    took_own = {(t[0], t[1], t[2], int(t[3]), int(t[4]), int(t[5])) for t in tuned}
    for dtype in ("bfloat16", "float16"):
        for shape in OWN_SHAPES:
            for act in ("gelu_approx", "none"):
                assert ("dgrad", dtype, act, *shape) in took_own, \
                    f"dgrad {dtype} {act} B, K, N = {shape} did not run the own GEMM"
            assert ("forward", dtype, "gelu_approx", *shape) in took_own, \
                f"forward {dtype} gelu_approx B, K, N = {shape} did not run the own GEMM"
    # widths it cannot take (K or N = 33) never reach it
    misfits = [t for t in tuned if int(t[4]) % 8 or int(t[5]) % 8]
    assert not misfits, f"the own GEMM took widths it must refuse: {misfits[:5]}"


@pytest.mark.cuda
def test_tuning_candidates_typo_is_a_clear_error():
    """A misspelt FUSED_DENSE_TUNING_CANDIDATES fails the first tuned call with a message naming the
    variable and its allowed words, instead of silently measuring nothing."""
    if not (fused_dense.has_cuda_kernels() and torch.cuda.is_available()):
        pytest.skip("needs the CUDA kernels and a GPU")
    script = ("import torch, fused_dense\n"
              "from fused_dense import ops\n"
              "w = torch.randn(64, 128, device='cuda', dtype=torch.bfloat16)\n"
              "g = torch.randn(32, 64, device='cuda', dtype=torch.bfloat16)\n"
              "pre = torch.randn(32, 128, device='cuda', dtype=torch.bfloat16)\n"
              "ops.act_linear_dgrad(w, g, pre, 'gelu_approx', True, 'auto')\n"
              "torch.cuda.synchronize()\n")
    env = dict(os.environ, FUSED_DENSE_TUNING_CANDIDATES="own,fusd", FUSED_DENSE_TUNING="1")
    env.pop("FUSED_DENSE_TUNING_CACHE", None)
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode != 0, "a misspelt FUSED_DENSE_TUNING_CANDIDATES was accepted"
    assert "FUSED_DENSE_TUNING_CANDIDATES must be a comma-separated list of fused, unfused and own, got 'own,fusd'" \
        in proc.stderr, proc.stderr[-2000:]
