"""Shared pytest setup for fused_dense.

Marker `cuda`: the test needs a GPU. Such tests skip (never pass) when
torch.cuda.is_available() is False, so CPU-only CI lists them as skipped (`-ra`).
On a machine with a GPU they also fail loudly if the extension was built without its
CUDA kernels, instead of silently testing the reference.

Helpers (import with `from conftest import rel_err, TOL, ...`):
    TOL                    relative-error tolerance per dtype, the one table every test uses
                           (docs/contract.md gives the contract these numbers encode)
    rounding_tol(dtype, k, roundings) the tolerance of a result from its dtype, its reduction
                           length and the roundings it went through (the MLP, gated and fuzz tests)
    rel_err(out, ref)      ||out - ref|| / ||ref|| computed in float64
    assert_close_rel(...)  rel_err <= TOL[dtype], with a readable message; results that
                           underflow into their dtype's subnormals judged by its spacing
    subnormal_floor(...)   the ||ref|| below which that spacing, not TOL, bounds the error
    poison(t)              fill a tensor with NaN (floats) or 0xFF bytes (integers)
    poison_cuda_cache(...) fill the CUDA caching allocator's free blocks with 0xFF bytes so
                           outputs an op allocates start as NaN (float) / all-ones (uint8)
    saved_tensors(fn)      (fn(), the tensors autograd keeps for the graph fn builds)
    saved_bytes(fn)        (fn(), bytes of the tensors autograd keeps for the graph fn builds)
    capture_training_step(...) a module's forward + backward captured into a CUDA graph
Fixtures: no_tf32 (fp32 CUDA GEMMs in full fp32 for the test's duration); deterministic_tuning
('auto' without timing, for bitwise comparisons of calls); _seeded (autouse: torch
and Python's random seeded per test from FUSED_DENSE_TEST_SEED and the test's name, the seed named
in a failure's report).
The raw ops' float64 references and checkers are in tests/op_checks.py.
"""
import math
import os
import random
import zlib

import pytest
import torch

# Relative error ||out - ref|| / ||ref|| (float64 reference) allowed per result dtype: the
# tolerances of docs/contract.md ("Accuracy"). Tests that chain several roundings scale these (and say why).
TOL = {
    torch.bfloat16: 1e-2,
    torch.float16: 2e-3,
    torch.float32: 1e-4,
    torch.float64: 1e-10,
}


def rounding_tol(dtype, k, roundings=1):
    """The relative-error tolerance of a result that went through `roundings` roundings to `dtype`
    and sums of up to `k` terms accumulated in float32 (float64 for float64):
    u * sqrt(roundings) + u_acc * sqrt(k), with u and u_acc the unit roundoffs (eps / 2).

    Where it comes from: rounding a random normal tensor to bf16, fp16 or fp32 moves it by 0.425 u
    in norm (measured on 10^5 elements, the same factor for the three); independent roundings add
    in quadrature; a sum of k random-sign terms accumulated in a wider type is off by about
    u_acc * sqrt(k). The derivatives along a chain amplify some roundings, so each test states the
    `roundings` it passes from the error it measured (MLP_ROUNDINGS below).
    bf16 stays below 1e-2 up to 6 roundings (9.6e-3), so a tolerance from here sees a 1% error."""
    fi = torch.finfo(dtype)
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    return fi.eps / 2 * math.sqrt(roundings) + torch.finfo(acc).eps / 2 * math.sqrt(max(k, 1))


# rounding_tol's `roundings` for every result (output and each gradient) of the MLP and the gated MLP
# at a few hundred elements per result and more: the worst relative error measured on the CPU over
# the five activations, three checkpoint levels and all gradients (tests/test_mlp_reference.py's
# SHAPE, 3 seeds) is 1.14 u in bf16 and fp16 (sqrelu's output and weight2 gradient; gelu_approx
# 1.01 u, relu 0.74 u, the gated ones 1.05 u), against u * sqrt(3) = 1.73 u: bf16 6.8e-3, fp16
# 8.5e-4. float32 / float64 measured up to 4.6 u / 5.1 u, mostly the K term (k = 61:
# u * sqrt(61) = 7.8 u), against 9.5 u.
MLP_ROUNDINGS = 3


def subnormal_floor(dtype, numel, tol):
    """The ||ref|| under which a correctly rounded `dtype` result can miss `tol`: a result in the
    dtype's subnormal range keeps an absolute error of up to half the subnormal spacing whatever its
    size (fp16: 3.0e-8, 1.5% of a 2e-6 result). It is two spacings per element over tol, far below
    the ||ref|| of any result not made of subnormals (fp16, tol 2e-3: 6e-5 * sqrt(numel))."""
    if not (dtype.is_floating_point and tol > 0):
        return 0.0
    fi = torch.finfo(dtype)
    return 2 * fi.smallest_normal * fi.eps * math.sqrt(numel) / tol


def rel_err(out, ref, floor=0.0):
    """||out - ref|| / max(||ref||, floor) in float64. Empty tensors give 0; a zero reference and
    floor give ||out||."""
    assert out.shape == ref.shape, f"shape {tuple(out.shape)} != reference shape {tuple(ref.shape)}"
    if out.numel() == 0:
        return 0.0
    o = out.detach().to(torch.float64)
    r = ref.detach().to(device=o.device, dtype=torch.float64)
    if not torch.isfinite(o).all():
        return math.inf
    denom = max(torch.linalg.vector_norm(r).item(), float(floor))
    num = torch.linalg.vector_norm(o - r).item()
    return num if denom == 0.0 else num / denom


def assert_close_rel(out, ref, dtype=None, what="output", tol=None):
    """Asserts rel_err(out, ref) <= tol (default TOL[dtype or out.dtype]), ||ref|| taken as at least
    subnormal_floor(out.dtype, ...) so results that underflow into subnormals are judged by what
    their dtype can hold."""
    dtype = dtype if dtype is not None else out.dtype
    tol = TOL[dtype] if tol is None else tol
    err = rel_err(out, ref, subnormal_floor(out.dtype, out.numel(), tol))
    assert err <= tol, f"{what}: relative error {err:.3e} > {tol:.1e} (dtype {dtype}, shape {tuple(out.shape)})"


# Tests that need PyTorch's caching allocator: CUDA graph capture allocates from its private pool,
# and torch.cuda.memory_allocated() counts only its blocks. compute-sanitizer memcheck / initcheck
# run with it off (PYTORCH_NO_CUDA_MEMORY_CACHING=1, so every allocation has its exact size).
# They also carry the marker `caching_allocator`, so the sanitizer step can run just them in a
# process of their own with the allocator on (`-m "cuda and caching_allocator"`).
def needs_caching_allocator(test):
    skip = pytest.mark.skipif(os.environ.get("PYTORCH_NO_CUDA_MEMORY_CACHING") == "1",
                              reason="needs PyTorch's CUDA caching allocator (off: PYTORCH_NO_CUDA_MEMORY_CACHING=1)")
    return pytest.mark.caching_allocator(skip(test))


def poison(t):
    """Fills t in place with NaN (floating) or all-ones bytes (integer / bool); returns t."""
    with torch.no_grad():
        if t.is_floating_point() or t.is_complex():
            t.fill_(float("nan"))
        elif t.dtype == torch.bool:
            t.fill_(True)
        else:
            t.view(torch.uint8).fill_(0xFF)
    return t


def poison_cuda_cache(device=None, large_bytes=256 << 20, small_blocks=32):
    """Makes the next CUDA allocations on `device` (current stream) land on 0xFF-filled memory.

    The ops allocate their outputs themselves, so they cannot be poisoned directly. Instead:
    release every cached block, allocate one large block and many small-pool blocks (the caching
    allocator serves requests <= 1 MiB from 2 MiB segments), fill them with 0xFF bytes (NaN in
    fp16 / bf16 / fp32, all bits set in a uint8 mask) and free them again. Freed blocks stay in
    the cache, tied to the current stream, and the next allocations are carved out of them
    (smaller sizes soak up free fragments of partly used segments too). An
    output element the op never writes then reads back as NaN (or a set padding bit).
    Call it right before the op, on the stream the op will run on.
    """
    device = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    blocks = [torch.full((large_bytes,), 0xFF, dtype=torch.uint8, device=device)]
    for size in (1_000_000, 65_536, 4_096, 512):  # small pool: requests <= 1 MiB
        blocks += [torch.full((size,), 0xFF, dtype=torch.uint8, device=device) for _ in range(small_blocks)]
    del blocks


class OpLog(torch.utils._python_dispatch.TorchDispatchMode):
    """The fused_dense ops a region calls, by name, and their positional arguments (the C++
    autograd calls them through the dispatcher, so a dispatch mode sees each call)."""

    def __init__(self):
        super().__init__()
        self.names = []
        self.args = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "fused_dense":
            self.names.append(func.__name__.split(".")[0])
            self.args.append(args)
        return func(*args, **(kwargs or {}))


def saved_tensors(fn):
    """(fn(), the tensors autograd keeps for the graph fn builds, in the order they were saved)."""
    saved = []

    def pack(t):
        saved.append(t)
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, saved


def saved_bytes(fn):
    """(fn(), bytes of the tensors autograd keeps for the graph fn builds, distinct storages)."""
    out, saved = saved_tensors(fn)
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in saved}
    return out, sum(storages.values())


def capture_training_step(module, static_x, static_g, warmup=3):
    """(graph, static_out, static_grads): module(static_x).backward(static_g) captured into a CUDA
    graph after `warmup` eager steps on a side stream (plans and 'auto' tuning happen there, not in
    the capture). Every replay rewrites static_out and the parameters' gradients static_grads."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            module(static_x).backward(static_g)
    torch.cuda.current_stream().wait_stream(side)
    for p in [static_x, *module.parameters()]:
        p.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = module(static_x)
        static_out.backward(static_g)
    return graph, static_out, [p.grad for p in module.parameters()]


def test_seed(nodeid):
    """The seed a test starts from: FUSED_DENSE_TEST_SEED (default 0) plus the CRC-32 of its pytest
    name (nodeid), so every test has its own inputs, always the same ones, replayed or varied by
    setting the base."""
    base = os.environ.get("FUSED_DENSE_TEST_SEED", "0")
    try:
        base = int(base)
    except ValueError:
        raise pytest.UsageError(f"FUSED_DENSE_TEST_SEED must be an integer, got {base!r}") from None
    return (base + zlib.crc32(nodeid.encode())) % 2**31


@pytest.fixture(autouse=True)
def _seeded(request):
    """Seeds torch (CPU and CUDA) and Python's random from test_seed(nodeid) before each test;
    a failing test's report names the seed (pytest_runtest_makereport below)."""
    value = test_seed(request.node.nodeid)
    torch.manual_seed(value)
    random.seed(value)
    return value


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        base = os.environ.get("FUSED_DENSE_TEST_SEED", "0")
        report.sections.append(("seed", f"seed {test_seed(item.nodeid)} (FUSED_DENSE_TEST_SEED={base} "
                                        f"plus the CRC-32 of {item.nodeid!r})"))


@pytest.fixture
def deterministic_tuning():
    """heuristic='auto' in the tuner's deterministic mode for one test (a build with the tuner):
    for tests that compare calls bit for bit, between which a measured choice could otherwise
    replace a provisional one (docs/contract.md, "Where a choice comes from")."""
    import fused_dense
    if not fused_dense.has_cuda_kernels():
        yield
        return
    previous = fused_dense.tuning.configure(deterministic=True)
    yield
    fused_dense.tuning.configure(**previous)


@pytest.fixture
def no_tf32():
    """fp32 CUDA matmuls without TF32 (torch.backends.cuda.matmul.allow_tf32 = False) for one test."""
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = old


@pytest.fixture(autouse=True)
def _fp64_reference_on_cpu():
    """FUSED_DENSE_TEST_FP64_REFERENCE_ON_CPU=1 (set by the sanitize step): float64 reference
    matmuls run on the CPU (tests/fp64_reference_on_cpu.py says why)."""
    import fp64_reference_on_cpu

    with fp64_reference_on_cpu.from_env():
        yield


def pytest_configure(config):
    config.addinivalue_line("markers", "cuda: needs a CUDA GPU; skipped when torch.cuda.is_available() is False")


# The optional packages some tests compare against or convert (transformers' models, torchao,
# Liger), by the version this run imports: their APIs move between releases (transformers renamed
# an output field between 5.17 and 5.25), so a run's output says which ones it ran against: in the
# header, and at the end, which `pytest -q` (the README's command) prints as well.
_REPORTED_PACKAGES = ("torch", "transformers", "torchao", "liger_kernel", "triton")


def _installed_version(name):
    from importlib import metadata

    try:
        return metadata.version(name.replace("_", "-"))
    except metadata.PackageNotFoundError:
        return "not installed"


def _versions_line():
    return "versions: " + ", ".join(f"{name} {_installed_version(name)}" for name in _REPORTED_PACKAGES)


def pytest_report_header(config):
    return _versions_line()


def pytest_terminal_summary(terminalreporter):
    terminalreporter.write_line(_versions_line())


def _shard_spec():
    """FUSED_DENSE_TEST_SHARD="i/n" (0 <= i < n): run every n-th collected test starting at i, so n
    processes (e.g. one compute-sanitizer each) split a suite between them with no test run twice."""
    spec = os.environ.get("FUSED_DENSE_TEST_SHARD", "")
    if not spec:
        return None
    try:
        index, count = (int(v) for v in spec.split("/"))
    except ValueError:
        raise pytest.UsageError(f"FUSED_DENSE_TEST_SHARD must look like 'i/n', got {spec!r}") from None
    if not 0 <= index < count:
        raise pytest.UsageError(f"FUSED_DENSE_TEST_SHARD={spec!r}: need 0 <= i < n")
    return index, count


def _per_function(config, items):
    """FUSED_DENSE_TEST_PER_FUNCTION=N: of each test function's parametrizations only N run, spread
    evenly over its list (the first and the last among them), so every test body runs and
    dtypes / activations / paths still vary -- for runs where each test is expensive (sanitizers)."""
    spec = os.environ.get("FUSED_DENSE_TEST_PER_FUNCTION", "")
    if not spec:
        return
    try:
        per = int(spec)
    except ValueError:
        per = 0
    if per < 1:
        raise pytest.UsageError(f"FUSED_DENSE_TEST_PER_FUNCTION must be an integer >= 1, got {spec!r}")
    groups = {}
    for item in items:
        groups.setdefault((item.nodeid.split("::")[0], getattr(item, "originalname", item.name)), []).append(item)
    chosen = set()
    for group in groups.values():
        n = len(group)
        if per >= n:
            picks = range(n)
        elif per == 1:
            picks = [0]
        else:  # spacing (n - 1) / (per - 1) > 1, so the rounded indices stay distinct
            picks = [round(i * (n - 1) / (per - 1)) for i in range(per)]
        chosen.update(id(group[i]) for i in picks)
    keep = [item for item in items if id(item) in chosen]
    drop = [item for item in items if id(item) not in chosen]
    if drop:
        config.hook.pytest_deselected(items=drop)
    items[:] = keep


def _reverse_requested():
    """FUSED_DENSE_TEST_REVERSE=1: run the (sharded) selection last test first. A sanitizer run cut
    by its time limit covers a shard's head; the same shards reversed cover its tail, so two runs
    together can reach a whole shard that one cannot."""
    spec = os.environ.get("FUSED_DENSE_TEST_REVERSE", "")
    if spec not in ("", "0", "1"):
        raise pytest.UsageError(f"FUSED_DENSE_TEST_REVERSE must be 0 or 1, got {spec!r}")
    return spec == "1"


def _deselect_listed(config, items):
    """FUSED_DENSE_TEST_DESELECT_FILE=PATH: leave out the test ids listed in PATH (one per line, as
    pytest prints them; '#' starts a comment), e.g. the tests another sanitizer run of the same
    tool already passed (`tools/sanitize_summary.py --passed-lists`). Applied before sharding, so
    the shards split only what is left."""
    path = os.environ.get("FUSED_DENSE_TEST_DESELECT_FILE", "")
    if not path:
        return
    try:
        with open(path) as f:
            listed = {line.split("#", 1)[0].strip() for line in f}
    except OSError as e:
        raise pytest.UsageError(f"FUSED_DENSE_TEST_DESELECT_FILE={path!r}: cannot read it ({e})") from None
    listed.discard("")
    drop = [item for item in items if item.nodeid in listed]
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = [item for item in items if item.nodeid not in listed]


# trylast: after pytest's own -m / -k deselection, so the shards split only the tests that run
# (before it, shards could end up holding only tests `-m cuda` then dropped, and run nothing)
@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    _per_function(config, items)
    _deselect_listed(config, items)
    shard = _shard_spec()
    if shard is not None:
        index, count = shard
        keep = [item for k, item in enumerate(items) if k % count == index]
        drop = [item for k, item in enumerate(items) if k % count != index]
        if drop:
            config.hook.pytest_deselected(items=drop)
        items[:] = keep
    if _reverse_requested():
        items.reverse()


def pytest_runtest_setup(item):
    if item.get_closest_marker("cuda") is None:
        return
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (torch.cuda.is_available() is False)")
    import fused_dense

    if not fused_dense.has_cuda_kernels():
        pytest.fail("a GPU is present but fused_dense was built without CUDA kernels "
                    "(FUSED_DENSE_CPU_ONLY build, or no nvcc at build time); rebuild with "
                    "`pip install --no-build-isolation -e .`")
