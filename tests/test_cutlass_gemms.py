"""The library's cutlass_sm90 kernels (csrc/core/cutlass_sm90/cutlass_sm90_dgrad.cu, cutlass_sm90_forward.cu), run
through the existing op, functional and module tests: a fresh pytest process per tile configuration c
with FUSED_DENSE_TUNING_CANDIDATES=cutlass:<c>, where heuristic='auto' measures only that
configuration's variants wherever they apply (data gradients with gelu_approx or no activation;
forwards with gelu_approx, a bias and the pre-activation saved; fp16 / bf16, widths multiples of 8,
compute capability 9.0) and keeps the fixed rule everywhere else. The tuner's verbose lines show
which problems took them. Also: the deprecated spellings (fused_dense.has_own_gemm(), the candidate
kind `own`) still work and warn."""
import os
import re
import subprocess
import sys
import warnings

import pytest
import torch

import fused_dense
from op_checks import CUDA_SHAPES

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# every CUDA test that sends a gelu_approx or plain data gradient through 'auto' (op; MLP and
# module, whose fc1 data gradient is the plain one), the op test of the forward with gelu_approx, a
# bias and the pre-activation saved at 'auto' (heuristic -2), the CUDA-graph capture and replay of
# FusedMLP (its default gelu_approx, tuned before capture), and its forward + backward on two
# streams at once
SELECTION = ["tests/test_op_dgrad.py", "tests/test_op_linear_act.py", "tests/test_functional.py",
             "tests/test_modules.py", "tests/test_concurrency.py",
             "-k", "(act_linear_dgrad and (gelu_approx or none)) or (test_cuda_linear_act and gelu_approx and "
             "True-True--2]) or (mlp and gelu_approx and auto) or graph_replay or two_streams_forward_backward"]
# the op tests' CUDA shapes (B, K, N) whose widths the cutlass_sm90 kernels take (K and N multiples of 8)
CUTLASS_SHAPES = [s for s in CUDA_SHAPES if s[1] % 8 == 0 and s[2] % 8 == 0]
TUNED = re.compile(r"fused_dense: tuned (dgrad|forward) (\w+) (\w+) B=(\d+) K=(\d+) N=(\d+): "
                   r"(cutlass_sm90 variant|fused|unfused) (\d+)(?: \(tile configuration (\d+), order (\d+)\))?")
# tile configurations (epilogue sub-tiles) of the GELU kernels, cutlass_sm90_common.cuh's
# kNumEpilogueTiles, counted per kernel so that a kernel with fewer (the forward has the first
# ones, if ever) is tested as such; the plain data gradient has one.
DGRAD_GELU_CONFIGS = 2
FORWARD_CONFIGS = 2
ORDERS = 3


def cutlass_gemms_expected():
    return fused_dense.has_cuda_kernels() and torch.cuda.is_available() and fused_dense.has_cutlass_gemms() \
        and torch.cuda.get_device_capability() == (9, 0)


NEEDS_CUTLASS = "needs a build with the cutlass_sm90 kernels (fused_dense.has_cutlass_gemms()) and a compute " \
    "capability 9.0 GPU"
# Set to 1 where a build without the cutlass_sm90 kernels is intended on a compute capability 9.0 GPU
# (no CUTLASS headers, or FUSED_DENSE_CUDA_ARCHS without 9.0a: setup.py); without it such a build
# fails the tests that need them.
NO_CUTLASS_ENV = "FUSED_DENSE_TEST_NO_CUTLASS"


def require_cutlass_gemms():
    """Skips where the cutlass_sm90 kernels cannot run (no CUDA kernels, no GPU, a GPU other than
    compute capability 9.0); on a 9.0 GPU a build without them fails the test, unless
    FUSED_DENSE_TEST_NO_CUTLASS=1 says that build is intended (then it skips)."""
    if cutlass_gemms_expected():
        return
    if not (fused_dense.has_cuda_kernels() and torch.cuda.is_available()) or \
            torch.cuda.get_device_capability() != (9, 0):
        pytest.skip(NEEDS_CUTLASS)
    if os.environ.get(NO_CUTLASS_ENV) == "1":
        pytest.skip(f"{NO_CUTLASS_ENV}=1: a build without the cutlass_sm90 kernels is intended")
    pytest.fail(f"compute capability 9.0 GPU, but fused_dense.has_cutlass_gemms() is False: the build lacks the "
                f"cutlass_sm90 kernels (no CUTLASS headers, or no 9.0a in FUSED_DENSE_CUDA_ARCHS, at build time); rebuild with them, or set "
                f"{NO_CUTLASS_ENV}=1 if a build without them is intended")


def run_pinned(candidates, args, timeout=1800):
    # exact-M keys (the verbose lines then name each call's own B), unpaced and unbounded, without
    # the shipped table: every problem is measured
    env = dict(os.environ, FUSED_DENSE_TUNING_CANDIDATES=candidates, FUSED_DENSE_TUNING_VERBOSE="1",
               FUSED_DENSE_TUNING="1", FUSED_DENSE_TUNING_BUCKETS="0", FUSED_DENSE_TUNING_PACE="1",
               FUSED_DENSE_TUNING_BUDGET="1000000", FUSED_DENSE_TUNING_TABLE="0")
    env.pop("FUSED_DENSE_TUNING_CACHE", None)  # measure afresh, never reuse another run's choices
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.cuda
@pytest.mark.parametrize("config", range(DGRAD_GELU_CONFIGS))
def test_cutlass_gemms_through_the_suite(config):
    """Each tile configuration of the cutlass_sm90 kernels, pinned, through the op, functional and
    module tests; every aligned problem it applies to must have run it."""
    require_cutlass_gemms()
    proc = run_pinned(f"cutlass:{config}", ["-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", "-m", "cuda",
                                        *SELECTION])
    tail = (proc.stdout[-3000:] + proc.stderr[-3000:])
    assert proc.returncode == 0, f"the suite with the cutlass_sm90 configuration {config} pinned failed:\n{tail}"
    assert re.search(r"\d+ passed", proc.stdout) and "failed" not in proc.stdout.splitlines()[-1], tail
    tuned = [m.groups() for m in TUNED.finditer(proc.stdout + proc.stderr)]
    # with only cutlass_sm90 candidates allowed, nothing else can be chosen by measurement
    others = [t for t in tuned if t[6] != "cutlass_sm90 variant"]
    assert not others, f"tuned to something other than a cutlass_sm90 kernel: {others[:5]}"
    # and only variants of the pinned configuration, numbered configuration * ORDERS + order
    wrong = [t for t in tuned if t[8] is None or int(t[8]) != config or int(t[7]) != config * ORDERS + int(t[9])]
    assert not wrong, f"tuned to another configuration than {config}: {wrong[:5]}"
    took_cutlass = {(t[0], t[1], t[2], int(t[3]), int(t[4]), int(t[5])) for t in tuned}
    # the plain data gradient has configuration 0 only
    acts = ("gelu_approx", "none") if config == 0 else ("gelu_approx",)
    for dtype in ("bfloat16", "float16"):
        for shape in CUTLASS_SHAPES:
            for act in acts:
                assert ("dgrad", dtype, act, *shape) in took_cutlass, \
                    f"dgrad {dtype} {act} B, K, N = {shape} did not run the cutlass_sm90 configuration {config}"
            if config < FORWARD_CONFIGS:
                assert ("forward", dtype, "gelu_approx", *shape) in took_cutlass, \
                    f"forward {dtype} gelu_approx B, K, N = {shape} did not run the cutlass_sm90 configuration {config}"
    if config > 0:
        plain = [t for t in tuned if t[2] == "none"]
        assert not plain, f"the plain data gradient has one configuration, yet tuned to {plain[:5]}"
    if config >= FORWARD_CONFIGS:
        forwards = [t for t in tuned if t[0] == "forward"]
        assert not forwards, f"the forward has {FORWARD_CONFIGS} configurations, yet tuned to {forwards[:5]}"
    # widths it cannot take (K or N = 33) never reach it
    misfits = [t for t in tuned if int(t[4]) % 8 or int(t[5]) % 8]
    assert not misfits, f"a cutlass_sm90 kernel took widths it must refuse: {misfits[:5]}"


@pytest.mark.cuda
@pytest.mark.parametrize("kind,configs", [("dgrad", DGRAD_GELU_CONFIGS), ("forward", FORWARD_CONFIGS)])
def test_cutlass_configuration_count(kind, configs):
    """Each GELU kernel has exactly its count of tile configurations: cutlass:<last> tunes its
    problem to it, cutlass:<one past> finds no candidate and measures nothing, on the first call or
    later."""
    require_cutlass_gemms()
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
    last = run_pinned(f"cutlass:{configs - 1}", ["-c", script], timeout=300)
    assert last.returncode == 0, last.stderr[-2000:]
    tuned = [m.groups() for m in TUNED.finditer(last.stderr)]
    assert len(tuned) == 1 and tuned[0][0] == kind and tuned[0][8] == str(configs - 1), last.stderr[-2000:]
    n = second_call.search(last.stdout)
    assert n and 1 <= int(n.group(1)) <= 4, \
        f"the tuned second call ran more than the op's kernels: {last.stdout[-2000:]}"
    past = run_pinned(f"cutlass:{configs}", ["-c", script], timeout=300)
    assert past.returncode == 0, past.stderr[-2000:]
    assert not TUNED.search(past.stderr), f"cutlass:{configs} measured something:\n{past.stderr[-2000:]}"
    # nothing to measure: the rule's choice is remembered, not warmed up again on every call
    n = second_call.search(past.stdout)
    assert n and 1 <= int(n.group(1)) <= 4, \
        f"with no candidate, the second call ran more than the op's kernels: {past.stdout[-2000:]}"


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
    proc = run_pinned("cutlass,fusd", ["-c", script], timeout=300)
    assert proc.returncode != 0, "a misspelt FUSED_DENSE_TUNING_CANDIDATES was accepted"
    assert "FUSED_DENSE_TUNING_CANDIDATES must be a comma-separated list of fused, unfused and cutlass (or " \
        "cutlass:<tile configuration>, a number), got 'cutlass,fusd'" in proc.stderr, proc.stderr[-2000:]


def test_has_own_gemm_is_a_deprecated_alias():
    """fused_dense.has_own_gemm() answers as has_cutlass_gemms() does, and warns that it is
    deprecated (any build, no GPU needed)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        old = fused_dense.has_own_gemm()
    deprecations = [w for w in caught if issubclass(w.category, DeprecationWarning)]
    assert len(deprecations) == 1 and "has_cutlass_gemms" in str(deprecations[0].message), \
        [str(w.message) for w in caught]
    assert isinstance(old, bool) and old == fused_dense.has_cutlass_gemms()


DEPRECATED_SPELLING = "FUSED_DENSE_TUNING_CANDIDATES: 'own' is deprecated, write 'cutlass'"


@pytest.mark.cuda
@pytest.mark.parametrize("spelling,deprecated", [("own", True), ("own:0", True), ("cutlass", False),
                                                 ("cutlass:0", False)])
def test_own_candidate_spelling_is_a_deprecated_alias(spelling, deprecated):
    """The candidate kind `own` (`own:<c>`) pins what `cutlass` (`cutlass:<c>`) pins, and prints the
    deprecation warning once per process however many problems are tuned; `cutlass` prints none."""
    if not (fused_dense.has_cuda_kernels() and torch.cuda.is_available()):
        pytest.skip("needs the CUDA kernels and a GPU")
    # two GELU data gradients of different shapes: two tunings, each parsing the variable
    script = ("import torch, fused_dense\n"
              "from fused_dense import ops\n"
              "for b in (384, 512):\n"
              "    w = torch.randn(256, 512, device='cuda', dtype=torch.bfloat16)\n"
              "    g = torch.randn(b, 256, device='cuda', dtype=torch.bfloat16)\n"
              "    pre = torch.randn(b, 512, device='cuda', dtype=torch.bfloat16)\n"
              "    ops.act_linear_dgrad(w, g, pre, 'gelu_approx', True, 'auto')\n"
              "torch.cuda.synchronize()\n")
    proc = run_pinned(spelling, ["-c", script], timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stderr.count(DEPRECATED_SPELLING) == (1 if deprecated else 0), proc.stderr[-2000:]
    tuned = [m.groups() for m in TUNED.finditer(proc.stderr)]
    if cutlass_gemms_expected():
        assert len(tuned) == 2 and all(t[6] == "cutlass_sm90 variant" for t in tuned), proc.stderr[-2000:]
        if spelling.endswith(":0"):
            assert all(t[8] == "0" for t in tuned), proc.stderr[-2000:]
    else:  # no cutlass_sm90 variant applies: nothing of the pinned kind to measure
        assert not tuned, proc.stderr[-2000:]
