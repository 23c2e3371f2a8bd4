"""CUDA graphs, several streams and several host threads (CUDA only).

The workspace is a buffer kept per stream (one from the caching allocator while a graph is being
captured), and the plan and tuning caches are mutex-protected; these tests check the results stay
right when calls overlap, and that a step allocates no more than the unfused layers' step.
"""
import threading

import pytest
import torch
import torch.nn.functional as F

import fp64_reference_on_cpu
import fused_dense.tuning
from conftest import TOL, capture_training_step, needs_caching_allocator, rel_err
from fused_dense import FusedDense, FusedGatedMLP, FusedMLP

pytestmark = pytest.mark.cuda


def reference_mlp(m, x, params=None):
    """m's output at x in float64; `params` (fc1.weight, fc1.bias, fc2.weight, fc2.bias) in
    float64 replace m's own, and `x` is used as given when it already is float64."""
    w1, b1, w2, b2 = params if params is not None else [p.detach().double() for p in m.parameters()]
    x64 = x if x.dtype == torch.float64 else x.detach().double()
    return F.linear(F.gelu(F.linear(x64, w1, b1), approximate="tanh"), w2, b2)


# Without the caching allocator the capture's cudaMalloc is illegal and breaks the process's RNG
# state for every later test.
@needs_caching_allocator
def test_fused_mlp_cuda_graph_replay():
    m = FusedMLP(512, 2048, device="cuda", dtype=torch.bfloat16)
    static_x = torch.randn(256, 512, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    static_g = torch.randn(256, 512, device="cuda", dtype=torch.bfloat16)
    graph, static_out, static_grads = capture_training_step(m, static_x, static_g)
    for _ in range(3):  # replay on fresh data, compare with eager
        x = torch.randn_like(static_x)
        g = torch.randn_like(static_g)
        with torch.no_grad():
            static_x.copy_(x)
            static_g.copy_(g)
        graph.replay()
        torch.cuda.synchronize()
        grads_graph = [gr.clone() for gr in static_grads]
        x_eager = x.clone().requires_grad_()
        for p in m.parameters():
            p.grad = None
        out_eager = m(x_eager)
        out_eager.backward(g)
        assert torch.equal(static_out, out_eager), "graph replay output differs from eager"
        for p, gg in zip(m.parameters(), grads_graph):
            assert rel_err(gg, p.grad) <= TOL[torch.bfloat16], "graph replay gradient differs from eager"
        assert rel_err(static_out, reference_mlp(m, x)) <= TOL[torch.bfloat16]


def _allocations_a_step(module, x, dy):
    def step():
        x.grad = None
        for p in module.parameters():
            p.grad = None
        module(x).backward(dy)
    for _ in range(3):  # plans, tuning and the stream's workspace happen here
        step()
    torch.cuda.synchronize()
    before = torch.cuda.memory_stats()["allocation.all.allocated"]
    step()
    torch.cuda.synchronize()
    return torch.cuda.memory_stats()["allocation.all.allocated"] - before


class _UnfusedMLP(torch.nn.Module):
    def __init__(self, d, h, gated, **kw):
        super().__init__()
        self.gated = gated
        self.fc1 = torch.nn.Linear(d, h, bias=not gated, **kw)  # the gated MLP: Llama's, no biases
        self.up = torch.nn.Linear(d, h, bias=False, **kw) if gated else None
        self.fc2 = torch.nn.Linear(h, d, bias=not gated, **kw)

    def forward(self, x):
        if self.gated:
            return self.fc2(F.silu(self.fc1(x)) * self.up(x))
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


@needs_caching_allocator
def test_layer_steps_allocate_no_more_than_unfused():
    """A forward + backward step of each fused layer makes no more allocations than the modules it
    replaces (outputs, saved tensors, gradients): the core's workspace is the stream's kept buffer,
    not an allocation per call. FusedDense's step is exactly nn.Linear's four: y, dx, dW, db."""
    kw = dict(device="cuda", dtype=torch.bfloat16)
    d, h, rows = 768, 3072, 256
    x = torch.randn(rows, d, **kw, requires_grad=True)
    dy = torch.randn(rows, d, **kw)
    dy_h = torch.randn(rows, h, **kw)
    assert _allocations_a_step(torch.nn.Linear(d, h, **kw), x, dy_h) == 4
    assert _allocations_a_step(FusedDense(d, h, **kw), x, dy_h) == 4
    pairs = [(FusedMLP(d, h, **kw), _UnfusedMLP(d, h, False, **kw)),
             (FusedGatedMLP(d, h, **kw), _UnfusedMLP(d, h, True, **kw))]
    for fused, unfused in pairs:
        n_fused, n_unfused = _allocations_a_step(fused, x, dy), _allocations_a_step(unfused, x, dy)
        assert n_fused <= n_unfused, f"{type(fused).__name__}: {n_fused} allocations a step, unfused {n_unfused}"


def test_two_streams_at_once():
    m = FusedMLP(1024, 4096, device="cuda", dtype=torch.float16)
    xs = [torch.randn(2048, 1024, device="cuda", dtype=torch.float16) for _ in range(2)]
    m(xs[0])  # tune once
    torch.cuda.synchronize()
    streams = [torch.cuda.Stream() for _ in xs]
    outs = [None, None]
    for _ in range(5):
        for i, (s, x) in enumerate(zip(streams, xs)):
            with torch.cuda.stream(s):
                outs[i] = m(x)
        torch.cuda.synchronize()
        for x, out in zip(xs, outs):
            assert rel_err(out, reference_mlp(m, x)) <= TOL[torch.float16]


def reference_mlp_grads(m, x, g):
    """float64 output and gradients (x, fc1.weight, fc1.bias, fc2.weight, fc2.bias) of m at x for the
    upstream gradient g."""
    params = [p.detach().double().requires_grad_() for p in m.parameters()]
    x64 = x.detach().double().requires_grad_()
    out = reference_mlp(m, x64, params)
    return out, torch.autograd.grad(out, [x64, *params], g.double())


def test_two_streams_forward_backward_at_once():
    """One FusedMLP's forward and backward on two streams at once, so the data-gradient (a
    cutlass_sm90 kernel where 'auto' picked it), weight-gradient and elementwise kernels of the two
    run side by side with their own workspaces: every output and gradient matches its float64
    reference."""
    m = FusedMLP(1024, 4096, device="cuda", dtype=torch.bfloat16)
    params = list(m.parameters())
    names = ["x", "fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]
    xs = [torch.randn(rows, 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True) for rows in (2048, 1536)]
    gs = [torch.randn(x.shape, device="cuda", dtype=torch.bfloat16) for x in xs]
    refs = [reference_mlp_grads(m, x, g) for x, g in zip(xs, gs)]
    for x, g in zip(xs, gs):  # tune each shape once, one at a time
        torch.autograd.grad(m(x), [x, *params], g)
    torch.cuda.synchronize()
    streams = [torch.cuda.Stream() for _ in xs]
    for _ in range(3):
        results = []
        for s, x, g in zip(streams, xs, gs):
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):  # backward runs on the stream its forward ran on
                out = m(x)
                results.append((out, torch.autograd.grad(out, [x, *params], g)))
        torch.cuda.synchronize()
        for rows, (out, grads), (ref_out, ref_grads) in zip((2048, 1536), results, refs):
            assert rel_err(out, ref_out) <= TOL[torch.bfloat16], f"rows {rows}: output"
            for name, got, want in zip(names, grads, ref_grads):
                assert rel_err(got, want) <= TOL[torch.bfloat16], f"rows {rows}: gradient of {name}"


@pytest.fixture
def tuning_on():
    """Measuring on, unbudgeted and unpaced, exact-M keys, no cache file and no shipped table, for
    one test: every new problem is measured. The previous settings come back afterwards."""
    previous = fused_dense.tuning.configure(enabled=True, budget_s=1e6, pace=1.0, buckets=0, cache="", table="")
    yield
    fused_dense.tuning.configure(**previous)


# fc1 [768 -> 2880] and fc2 [2880 -> 768]: widths the shipped table (fused_dense/tuning_tables/) holds
# no choice for, so 'auto' measures them
THREAD_WIDTHS = (768, 2880)


def test_two_host_threads(tuning_on):
    """Two host threads plan and tune the same new problems at once (three token counts each, the
    same in both threads) and every output matches its reference; the tuner measured them."""
    d, hidden = THREAD_WIDTHS
    m = FusedMLP(d, hidden, device="cuda", dtype=torch.bfloat16)
    errors = []
    measured = fused_dense.tuning.stats()["problems_measured"]

    def work(seed):
        gen = torch.Generator(device="cuda").manual_seed(seed)
        s = torch.cuda.Stream()
        with torch.cuda.stream(s):
            for rows in (128, 1000, 4096):  # new problems: the threads plan and tune them concurrently
                x = torch.randn(rows, d, device="cuda", dtype=torch.bfloat16, generator=gen)
                out = m(x)
                s.synchronize()
                err = rel_err(out, reference_mlp(m, x))
                if err > TOL[torch.bfloat16]:
                    errors.append(f"thread {seed} rows {rows}: {err:.3e}")

    def worker(seed):
        try:
            with fp64_reference_on_cpu.from_env():  # the fixture's mode does not reach this thread
                work(seed)
        except Exception as e:  # noqa: BLE001 - reported to the main thread
            errors.append(f"thread {seed}: {e!r}")

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    # at least fc1's GELU forward at each of the three token counts was measured (fc2's plain GEMM
    # may add three more)
    measured = fused_dense.tuning.stats()["problems_measured"] - measured
    assert measured >= 3, f"the threads measured {measured} new problems, expected at least 3"
