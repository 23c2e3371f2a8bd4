"""fused_dense's own CUTLASS GEMMs (csrc/core/own_dgrad_sm90.cu, own_forward_sm90.cu), run through
the existing op, functional and module tests: a fresh pytest process per tile configuration c with
FUSED_DENSE_TUNING_CANDIDATES=own:<c>, where heuristic='auto' measures only that configuration's variants
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
                   r"(own GEMM variant|fused|unfused) (\d+)(?: \(tile configuration (\d+), order (\d+)\))?")
# tile configurations (epilogue sub-tiles) of the GELU kernels, own_gemm_sm90_common.cuh's
# kNumEpilogueTiles, counted per kernel so that a kernel with fewer (the forward has the first
# ones, if ever) is tested as such; the plain data gradient has one. (Session 12 timed two more
# data-gradient configurations, 64 x 32 with 6 and 8 sub-tiles of pre_act loaded ahead, and
# dropped them: docs/gpu_runs/s12r1_aux_prefetch_configs_tuning.log.)
DGRAD_GELU_CONFIGS = 2
FORWARD_CONFIGS = 2
ORDERS = 3


def own_gemm_expected():
    return fused_dense.has_cuda_kernels() and torch.cuda.is_available() and fused_dense.has_own_gemm() \
        and torch.cuda.get_device_capability() == (9, 0)


def run_pinned(candidates, args, timeout=1800):
    env = dict(os.environ, FUSED_DENSE_TUNING_CANDIDATES=candidates, FUSED_DENSE_TUNING_VERBOSE="1",
               FUSED_DENSE_TUNING="1")
    env.pop("FUSED_DENSE_TUNING_CACHE", None)  # measure afresh, never reuse another run's choices
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.cuda
@pytest.mark.parametrize("config", range(DGRAD_GELU_CONFIGS))
def test_own_gemm_through_the_suite(config):
    """Each tile configuration of the own GEMMs, pinned, through the op, functional and module
    tests; every aligned problem it applies to must have run it."""
    if not own_gemm_expected():
        pytest.skip("needs a build with the own GEMM (fused_dense.has_own_gemm()) and a compute capability 9.0 GPU")
    proc = run_pinned(f"own:{config}", ["-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", "-m", "cuda",
                                        *SELECTION])
    tail = (proc.stdout[-3000:] + proc.stderr[-3000:])
    assert proc.returncode == 0, f"the suite with the own GEMM's configuration {config} pinned failed:\n{tail}"
    assert re.search(r"\d+ passed", proc.stdout) and "failed" not in proc.stdout.splitlines()[-1], tail
    tuned = [m.groups() for m in TUNED.finditer(proc.stdout + proc.stderr)]
    # with only own candidates allowed, nothing else can be chosen by measurement
    others = [t for t in tuned if t[6] != "own GEMM variant"]
    assert not others, f"tuned to something other than the own GEMM: {others[:5]}"
    # and only variants of the pinned configuration, numbered configuration * ORDERS + order
    wrong = [t for t in tuned if t[8] is None or int(t[8]) != config or int(t[7]) != config * ORDERS + int(t[9])]
    assert not wrong, f"tuned to another configuration than {config}: {wrong[:5]}"
    took_own = {(t[0], t[1], t[2], int(t[3]), int(t[4]), int(t[5])) for t in tuned}
    # the plain data gradient has configuration 0 only
    acts = ("gelu_approx", "none") if config == 0 else ("gelu_approx",)
    for dtype in ("bfloat16", "float16"):
        for shape in OWN_SHAPES:
            for act in acts:
                assert ("dgrad", dtype, act, *shape) in took_own, \
                    f"dgrad {dtype} {act} B, K, N = {shape} did not run the own GEMM's configuration {config}"
            if config < FORWARD_CONFIGS:
                assert ("forward", dtype, "gelu_approx", *shape) in took_own, \
                    f"forward {dtype} gelu_approx B, K, N = {shape} did not run the own GEMM's configuration {config}"
    if config > 0:
        plain = [t for t in tuned if t[2] == "none"]
        assert not plain, f"the plain data gradient has one configuration, yet tuned to {plain[:5]}"
    if config >= FORWARD_CONFIGS:
        forwards = [t for t in tuned if t[0] == "forward"]
        assert not forwards, f"the forward has {FORWARD_CONFIGS} configurations, yet tuned to {forwards[:5]}"
    # widths it cannot take (K or N = 33) never reach it
    misfits = [t for t in tuned if int(t[4]) % 8 or int(t[5]) % 8]
    assert not misfits, f"the own GEMM took widths it must refuse: {misfits[:5]}"


@pytest.mark.cuda
@pytest.mark.parametrize("kind,configs", [("dgrad", DGRAD_GELU_CONFIGS), ("forward", FORWARD_CONFIGS)])
def test_own_gemm_configuration_count(kind, configs):
    """Each GELU kernel has exactly its count of tile configurations: own:<last> tunes its problem
    to it, own:<one past> finds no candidate and measures nothing, on the first call or later."""
    if not own_gemm_expected():
        pytest.skip("needs a build with the own GEMM (fused_dense.has_own_gemm()) and a compute capability 9.0 GPU")
    call = ("ops.act_linear_dgrad(w, g, pre, 'gelu_approx', True, 'auto')\n" if kind == "dgrad" else
            "ops.linear_act(g, wt, b, 'gelu_approx', True, 'auto')\n")
    # the call, then the same call again under the profiler: its kernel count shows whether the
    # second call measured or warmed anything up again (the tuner's warm-up alone is dozens)
    script = ("import torch, fused_dense\n"
              "from fused_dense import ops\n"
              "from torch.profiler import profile, ProfilerActivity\n"
              "w = torch.randn(256, 512, device='cuda', dtype=torch.bfloat16)\n"
              "g = torch.randn(384, 256, device='cuda', dtype=torch.bfloat16)\n"
              "pre = torch.randn(384, 512, device='cuda', dtype=torch.bfloat16)\n"
              "wt = w.t().contiguous()\n"
              "b = torch.randn(512, device='cuda', dtype=torch.bfloat16)\n"
              + call +
              "torch.cuda.synchronize()\n"
              "with profile(activities=[ProfilerActivity.CUDA]) as prof:\n"
              "    " + call +
              "    torch.cuda.synchronize()\n"
              "kernels = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]\n"
              "print('SECOND CALL KERNELS', len(kernels), kernels)\n")
    second_call = re.compile(r"SECOND CALL KERNELS (\d+)")
    last = run_pinned(f"own:{configs - 1}", ["-c", script], timeout=300)
    assert last.returncode == 0, last.stderr[-2000:]
    tuned = [m.groups() for m in TUNED.finditer(last.stderr)]
    assert len(tuned) == 1 and tuned[0][0] == kind and tuned[0][8] == str(configs - 1), last.stderr[-2000:]
    n = second_call.search(last.stdout)
    assert n and 1 <= int(n.group(1)) <= 4, f"the tuned second call ran other kernels than its own: {last.stdout[-2000:]}"
    past = run_pinned(f"own:{configs}", ["-c", script], timeout=300)
    assert past.returncode == 0, past.stderr[-2000:]
    assert not TUNED.search(past.stderr), f"own:{configs} measured something:\n{past.stderr[-2000:]}"
    # nothing to measure: the rule's choice is remembered, not warmed up again on every call
    n = second_call.search(past.stdout)
    assert n and 1 <= int(n.group(1)) <= 4, \
        f"with no candidate, the second call ran more than the op's own kernels: {past.stdout[-2000:]}"


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
    proc = run_pinned("own,fusd", ["-c", script], timeout=300)
    assert proc.returncode != 0, "a misspelt FUSED_DENSE_TUNING_CANDIDATES was accepted"
    assert "FUSED_DENSE_TUNING_CANDIDATES must be a comma-separated list of fused, unfused and own (or " \
        "own:<tile configuration>, a number), got 'own,fusd'" in proc.stderr, proc.stderr[-2000:]
