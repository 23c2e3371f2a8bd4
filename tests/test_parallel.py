"""Tensor / sequence parallelism: fused_dense.distributed and fused_dense.parallel.

Every check runs in `world_size` spawned processes joined in one process group: gloo on the CPU
(CI), NCCL with one GPU per rank (marker `cuda`; skipped unless torch.cuda.device_count() >=
world_size). The processes of one (backend, world_size) are started once and kept for the whole
module (a `_Pool`); each test sends them the name of a `_w_*` function to run, and waits at
most `TASK_TIMEOUT` seconds. A rank that raises sends its traceback back; a pool that stops
answering is killed and the test fails (the next test starts a fresh pool).

References: a single-process float64 model built from nn.Linear / F.gelu with the same
initial weights; each rank compares its outputs and gradients with the slice of the reference
that it owns (rows for sequence parallelism, features for tensor parallelism), within the
tolerance of the dtype it ran in (docs/contract.md, "Accuracy"). The FP8 layers are compared with
the single-process FP8 layers on the full weights instead (the tolerances at FP8_SHARD_TOL_OUTPUT and
the two below it), and FSDP2 over FP8 layers with the same model in one process (FSDP_FP8_TOL).
"""
import os
import queue
import re
import shutil
import sys
import tempfile
import time
import traceback
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

from conftest import TOL, rel_err

WORLD_SIZES = (1, 2, 4)
TASK_TIMEOUT = 90.0       # seconds one test may take on all ranks together
START_TIMEOUT = 120.0     # seconds for a pool of processes to start and join its group
FAILURE_GRACE = 5.0       # after one rank fails, how long to wait for the others

# --------------------------------------------------------------------------------------------
# Process pools (parent side)


class _Pool:
    """`world_size` spawned processes in one process group, running `_w_*` functions on request."""

    broken = False  # set when a rank died or stopped answering: the pool is then replaced

    def __init__(self, backend, world_size):
        self.backend, self.world_size = backend, world_size
        self.tmpdir = tempfile.mkdtemp(prefix="fd_dist_")
        ctx = mp.get_context("spawn")
        self.results = ctx.Queue()
        self.tasks = [ctx.Queue() for _ in range(world_size)]
        init_file = os.path.join(self.tmpdir, "rendezvous")
        self.procs = [
            ctx.Process(target=_worker_main,
                        args=(rank, world_size, backend, init_file, self.tasks[rank], self.results),
                        daemon=True)
            for rank in range(world_size)
        ]
        for p in self.procs:
            p.start()
        errors = self._collect(START_TIMEOUT, "start")
        if errors:
            self.close()
            raise RuntimeError(f"{backend} pool of {world_size} failed to start:\n" + "\n".join(errors))

    def _collect(self, timeout, what):
        """Waits for one reply per rank; returns the list of failure messages."""
        deadline = time.monotonic() + timeout
        replies, errors = {}, []
        while len(replies) < self.world_size:
            now = time.monotonic()
            if errors:
                deadline = min(deadline, now + FAILURE_GRACE)
            if now >= deadline:
                missing = sorted(set(range(self.world_size)) - set(replies))
                errors.append(f"ranks {missing} did not answer {what!r} within {timeout:.0f}s"
                              + (" (after another rank failed)" if len(errors) else ""))
                self.broken = True
                return errors
            try:
                rank, err = self.results.get(timeout=min(1.0, max(deadline - now, 0.01)))
            except queue.Empty:
                dead = [r for r, p in enumerate(self.procs) if not p.is_alive() and r not in replies]
                if dead:
                    errors.append(f"ranks {dead} died (exit codes "
                                  f"{[self.procs[r].exitcode for r in dead]}) during {what!r}")
                    self.broken = True
                    return errors
                continue
            replies[rank] = err
            if err is not None:
                errors.append(f"--- rank {rank} ---\n{err}")
        return errors

    def run(self, fn_name, timeout=TASK_TIMEOUT, **kwargs):
        for q in self.tasks:
            q.put((fn_name, kwargs))
        return self._collect(timeout, fn_name)

    def close(self):
        for q in self.tasks:
            try:
                q.put(None)
            except Exception:
                pass
        deadline = time.monotonic() + (3.0 if not self.broken else 0.5)
        for p in self.procs:
            p.join(timeout=max(deadline - time.monotonic(), 0.0))
        for p in self.procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        shutil.rmtree(self.tmpdir, ignore_errors=True)


_POOLS = {}


@pytest.fixture(scope="module", autouse=True)
def _close_pools():
    yield
    while _POOLS:
        _, pool = _POOLS.popitem()
        pool.close()


def _skip_unless_backend(backend, world_size):
    if backend == "nccl":
        if not dist.is_nccl_available():
            pytest.skip("this torch has no NCCL")
        if torch.cuda.device_count() < world_size:
            pytest.skip(f"needs {world_size} GPUs, {torch.cuda.device_count()} present")
    elif not dist.is_gloo_available():
        pytest.skip("this torch has no gloo")


def run_distributed(backend, world_size, fn_name, timeout=TASK_TIMEOUT, **kwargs):
    """Runs `fn_name(**kwargs)` on every rank of the (backend, world_size) pool; fails the test
    with every failing rank's traceback."""
    _skip_unless_backend(backend, world_size)
    key = (backend, world_size)
    pool = _POOLS.get(key)
    if pool is None:
        pool = _POOLS[key] = _Pool(backend, world_size)
    errors = pool.run(fn_name, timeout=timeout, **kwargs)
    if pool.broken or errors:  # after a failure the ranks may disagree on what comes next
        _POOLS.pop(key, None)
        pool.close()
    if errors:
        pytest.fail(f"{fn_name}{kwargs} on {backend} x{world_size}:\n" + "\n".join(errors), pytrace=False)


BACKENDS = ["gloo", pytest.param("nccl", marks=pytest.mark.cuda)]


def _dtypes(backend):
    return [torch.float32] if backend == "gloo" else [torch.bfloat16]


# --------------------------------------------------------------------------------------------
# Worker side

_RANK = _WORLD = _DEVICE = None


def _worker_main(rank, world_size, backend, init_file, tasks, results):
    global _RANK, _WORLD, _DEVICE
    try:
        torch.set_num_threads(1)
        if backend == "gloo" and sys.platform.startswith("linux") and os.path.exists("/sys/class/net/lo"):
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        kwargs = {}
        if backend == "nccl":
            torch.cuda.set_device(rank)
            kwargs["device_id"] = torch.device("cuda", rank)
        dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank,
                                world_size=world_size, timeout=timedelta(seconds=60), **kwargs)
        _RANK, _WORLD = rank, world_size
        _DEVICE = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
        import fused_dense.parallel  # noqa: F401  (fail at start, not in the first test)
        results.put((rank, None))
    except BaseException:
        results.put((rank, traceback.format_exc()))
        return
    while True:
        task = tasks.get()
        if task is None:
            break
        name, kwargs = task
        try:
            torch.manual_seed(1234)
            globals()[name](**kwargs)
            if backend == "nccl":
                torch.cuda.synchronize()
            results.put((rank, None))
        except BaseException:
            results.put((rank, traceback.format_exc()))
    dist.destroy_process_group()


def _check(out, ref, dtype, what):
    err = rel_err(out, ref)
    tol = TOL[dtype]
    assert err <= tol, (f"rank {_RANK}/{_WORLD}: {what}: relative error {err:.3e} > {tol:.0e} "
                        f"(dtype {dtype}, shape {tuple(out.shape)})")


def _rows(n_rows):
    """This rank's dim-0 slice of `n_rows` rows under sequence parallelism."""
    n = n_rows // _WORLD
    return slice(_RANK * n, (_RANK + 1) * n)


def _act_ref(h, activation):
    if activation == "gelu_approx":
        return F.gelu(h, approximate="tanh")
    if activation == "relu":
        return F.relu(h)
    return F.relu(h).square()


def _rank_tensor(shape, rank, dtype, scale=1.0):
    """A tensor every rank can rebuild for any `rank`: deterministic in (shape, rank)."""
    g = torch.Generator().manual_seed(1000 + rank)
    return (torch.randn(shape, generator=g, dtype=torch.float64) * scale).to(dtype=dtype, device=_DEVICE)


# ---- raw collectives


def _w_raw(native, async_op, dtype):
    from fused_dense import distributed as fdist

    saved = set(fdist.LIST_COLLECTIVE_BACKENDS)
    if native:
        fdist.LIST_COLLECTIVE_BACKENDS.clear()
    try:
        group, ws, rank = dist.group.WORLD, _WORLD, _RANK

        def done(out, handle):
            if async_op:
                assert handle is not None, "async_op=True must return a handle"
                handle.wait()
            else:
                assert handle is None, "a synchronous call returns handle None"
            return out

        # all-gather: rank r contributes x_r [3, 5]; everyone gets cat(x_0..x_{ws-1}).
        x = _rank_tensor((3, 5), rank, dtype)
        out = done(*fdist.all_gather_raw(x, group, async_op=async_op))
        ref = torch.cat([_rank_tensor((3, 5), r, dtype) for r in range(ws)])
        assert out.shape == (3 * ws, 5) and out.dtype == dtype
        assert torch.equal(out, ref), "all_gather_raw result differs from the concatenation"
        # no rows
        out = done(*fdist.all_gather_raw(x[:0], group, async_op=async_op))
        assert out.shape == (0, 5)
        # non-contiguous input
        xt = _rank_tensor((5, 3), rank, dtype).t()
        out = done(*fdist.all_gather_raw(xt, group, async_op=async_op))
        assert torch.equal(out, torch.cat([_rank_tensor((5, 3), r, dtype).t() for r in range(ws)]))

        # reduce-scatter: rank r contributes y_r [2*ws, 4]; rank r gets rows 2r..2r+1 of the sum.
        y = _rank_tensor((2 * ws, 4), rank, dtype)
        y_copy = y.clone()
        out = done(*fdist.reduce_scatter_raw(y, group, async_op=async_op))
        total = sum(_rank_tensor((2 * ws, 4), r, torch.float64) for r in range(ws))
        assert out.shape == (2, 4) and out.dtype == dtype
        _check(out, total[2 * rank:2 * rank + 2], dtype, "reduce_scatter_raw")
        assert torch.equal(y, y_copy), "reduce_scatter_raw must not modify its input"

        # all-reduce: in place on a contiguous input.
        z = _rank_tensor((3, 4), rank, dtype)
        out = done(*fdist.all_reduce_raw(z, group, async_op=async_op))
        assert out.data_ptr() == z.data_ptr(), "all_reduce_raw works in place"
        _check(out, sum(_rank_tensor((3, 4), r, torch.float64) for r in range(ws)), dtype, "all_reduce_raw")

        # Several async collectives in flight at once, waited in reverse order.
        if async_op:
            pending = [fdist.all_gather_raw(x, group, async_op=True),
                       fdist.reduce_scatter_raw(y, group, async_op=True),
                       fdist.all_reduce_raw(_rank_tensor((3, 4), rank, dtype), group, async_op=True)]
            for _, h in reversed(pending):
                h.wait()
            assert torch.equal(pending[0][0], ref)
            _check(pending[1][0], total[2 * rank:2 * rank + 2], dtype, "overlapped reduce_scatter_raw")

        if ws > 1:
            try:
                fdist.reduce_scatter_raw(_rank_tensor((ws + 1, 2), rank, dtype), group)
            except ValueError:
                pass
            else:
                raise AssertionError("reduce_scatter_raw must reject a dim 0 not divisible by world size")
    finally:
        fdist.LIST_COLLECTIVE_BACKENDS.clear()
        fdist.LIST_COLLECTIVE_BACKENDS.update(saved)


@pytest.mark.parametrize("async_op", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("backend, native", [
    pytest.param("gloo", False, id="gloo-fallback"),  # what gloo gets by default
    pytest.param("gloo", True, id="gloo-native"),      # the tensor collectives, where gloo has them
    pytest.param("nccl", True, id="nccl", marks=pytest.mark.cuda),
])
def test_raw_collectives(backend, native, world_size, async_op):
    for dtype in _dtypes(backend) + ([torch.float64, torch.bfloat16, torch.float16] if backend == "gloo" else []):
        run_distributed(backend, world_size, "_w_raw", native=native, async_op=async_op, dtype=dtype)


# ---- autograd forms


def _w_autograd_forms(dtype):
    from fused_dense.distributed import all_gather, all_reduce, copy_to_group, reduce_scatter

    group, ws, rank = dist.group.WORLD, _WORLD, _RANK
    n = 3
    # all_gather: d(out)/d(x_r) collects every rank's gradient for rows of rank r.
    x = _rank_tensor((n, 4), rank, dtype).requires_grad_()
    out = all_gather(x, group)
    assert torch.equal(out.detach(), torch.cat([_rank_tensor((n, 4), r, dtype) for r in range(ws)]))
    out.backward(_rank_tensor((n * ws, 4), 100 + rank, dtype))
    ref = sum(_rank_tensor((n * ws, 4), 100 + r, torch.float64) for r in range(ws))[rank * n:(rank + 1) * n]
    _check(x.grad, ref, dtype, "all_gather backward")

    # reduce_scatter: gradient of x_r is the gather of every rank's output gradient.
    y = _rank_tensor((n * ws, 4), rank, dtype).requires_grad_()
    out = reduce_scatter(y, group)
    _check(out, sum(_rank_tensor((n * ws, 4), r, torch.float64) for r in range(ws))[rank * n:(rank + 1) * n],
           dtype, "reduce_scatter forward")
    out.backward(_rank_tensor((n, 4), 200 + rank, dtype))
    assert torch.equal(y.grad, torch.cat([_rank_tensor((n, 4), 200 + r, dtype) for r in range(ws)]))

    # all_reduce: replicated output, so the gradient passes through; the input is a leaf here
    # (never modified) and then a non-leaf (reduced in place).
    z = _rank_tensor((n, 4), rank, dtype).requires_grad_()
    out = all_reduce(z, group)
    total = sum(_rank_tensor((n, 4), r, torch.float64) for r in range(ws))
    _check(out, total, dtype, "all_reduce forward")
    assert torch.equal(z.detach(), _rank_tensor((n, 4), rank, dtype)), "all_reduce modified a leaf"
    g = _rank_tensor((n, 4), 300, dtype)
    out.backward(g)
    assert torch.equal(z.grad, g)
    z.grad = None
    out = all_reduce(z * 2, group)
    _check(out, 2 * total, dtype, "all_reduce forward (non-leaf)")
    out.backward(g)
    assert torch.equal(z.grad, 2 * g)

    # copy_to_group: the identity; the gradient is the sum of every rank's, and the gradient
    # autograd hands it (here shared with w's, through the add) is left as it was.
    v = _rank_tensor((n, 4), 0, dtype).requires_grad_()
    w = torch.zeros(n, 4, dtype=dtype, device=_DEVICE, requires_grad=True)
    out = copy_to_group(v, group) + w
    assert torch.equal(out.detach(), v.detach())
    out.backward(_rank_tensor((n, 4), 400 + rank, dtype))
    _check(v.grad, sum(_rank_tensor((n, 4), 400 + r, torch.float64) for r in range(ws)), dtype,
           "copy_to_group backward")
    assert torch.equal(w.grad, _rank_tensor((n, 4), 400 + rank, dtype))


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_autograd_forms(backend, world_size):
    run_distributed(backend, world_size, "_w_autograd_forms", dtype=torch.float64 if backend == "gloo" else torch.float32)


# ---- helpers


def test_get_dim_for_local_rank():
    from fused_dense.distributed import get_dim_for_local_rank
    from fused_dense.parallel import shard_range

    assert [get_dim_for_local_rank(10, 4, r) for r in range(4)] == [3, 3, 2, 2]
    assert [get_dim_for_local_rank(12, 4, r) for r in range(4)] == [3, 3, 3, 3]
    assert [get_dim_for_local_rank(48, 3, r, multiple_of=8) for r in range(3)] == [16, 16, 16]
    assert [get_dim_for_local_rank(40, 3, r, multiple_of=8) for r in range(3)] == [16, 16, 8]
    assert [get_dim_for_local_rank(8, 4, r, multiple_of=4) for r in range(4)] == [4, 4, 0, 0]
    assert get_dim_for_local_rank(7, 1, 0) == 7
    for dim in range(0, 40):
        for ws in (1, 2, 3, 4, 8):
            for mult in (1, 2, 4):
                if dim % mult:
                    continue
                sizes = [get_dim_for_local_rank(dim, ws, r, mult) for r in range(ws)]
                assert sum(sizes) == dim and all(s % mult == 0 for s in sizes)
                assert max(sizes) - min(sizes) <= mult and sizes == sorted(sizes, reverse=True)
                slices = [shard_range(dim, ws, r, mult) for r in range(ws)]
                assert [s.start for s in slices] == [sum(sizes[:r]) for r in range(ws)]
    with pytest.raises(ValueError, match="multiple"):
        get_dim_for_local_rank(10, 2, 0, multiple_of=4)
    with pytest.raises(ValueError):
        get_dim_for_local_rank(10, 2, 2)
    with pytest.raises(ValueError):
        get_dim_for_local_rank(10, 2, 0, multiple_of=0)


def _w_model_helpers():
    from fused_dense.distributed import allreduce_sequence_parallel_grad, sync_shared_params

    # Groups of 2 consecutive ranks when possible, so that "rank 0 of the group" is not always
    # global rank 0.
    ws, rank = _WORLD, _RANK
    tp = 2 if ws % 2 == 0 else 1
    groups = [dist.new_group(list(range(s, s + tp))) for s in range(0, ws, tp)]
    group = groups[rank // tp]
    leader = (rank // tp) * tp

    model = nn.Sequential(nn.Linear(4, 3), nn.LayerNorm(3), nn.Linear(3, 2)).to(_DEVICE)
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            p.copy_(_rank_tensor(p.shape, 10 * rank + i, p.dtype))
    for p in model[1].parameters():
        p._shared_params = True
        p._sequence_parallel = True
    model[0].bias._shared_params = True
    # A non-contiguous shared parameter.
    model[2].weight = nn.Parameter(_rank_tensor((3, 2), 10 * rank + 7, torch.float32).t())
    model[2].weight._shared_params = True
    sync_shared_params(model, group)
    for i, p in enumerate(model.parameters()):
        mine = _rank_tensor(p.shape, 10 * rank + i, p.dtype)
        theirs = _rank_tensor(p.shape, 10 * leader + i, p.dtype)
        if getattr(p, "_shared_params", False):
            if i == 4:
                theirs = _rank_tensor((3, 2), 10 * leader + 7, torch.float32).t()
            assert torch.equal(p.detach(), theirs), f"param {i} not synced from group rank 0"
        else:
            assert torch.equal(p.detach(), mine), f"param {i} is not marked but changed"

    for i, p in enumerate(model.parameters()):
        p.grad = _rank_tensor(p.shape, 50 + 10 * rank + i, p.dtype)
    model[0].weight.grad = None  # marked but without a gradient (on every rank): skipped
    model[0].weight._sequence_parallel = True
    allreduce_sequence_parallel_grad(model, group)
    for i, p in enumerate(model.parameters()):
        if i == 0:
            assert p.grad is None
            continue
        if getattr(p, "_sequence_parallel", False):
            ref = sum(_rank_tensor(p.shape, 50 + 10 * r + i, torch.float64) for r in range(leader, leader + tp))
            _check(p.grad, ref, p.dtype, f"sequence-parallel grad {i}")
        else:
            assert torch.equal(p.grad, _rank_tensor(p.shape, 50 + 10 * rank + i, p.dtype))


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_model_helpers(backend, world_size):
    run_distributed(backend, world_size, "_w_model_helpers")


# ---- layers against the single-process reference


def _inputs(rows, features, sequence_parallel, dtype, seed=0, shape3d=False):
    """(full reference input fp64 with grad, this rank's input in `dtype` with grad)."""
    g = torch.Generator().manual_seed(seed)
    x_full = torch.randn(rows, features, generator=g, dtype=torch.float64).to(dtype).to(torch.float64)
    if shape3d:  # [rows/2, 2, features]: leading dims are flattened by the layers
        x_full = x_full.view(rows // 2, 2, features)
        local = x_full[_rows(rows // 2)] if sequence_parallel else x_full
    else:
        local = x_full[_rows(rows)] if sequence_parallel else x_full
    x = local.to(device=_DEVICE, dtype=dtype).requires_grad_()
    # The reference sees exactly the values the rank sees (rounded to `dtype`).
    return x_full.to(dtype).to(torch.float64).requires_grad_(), x


def _ref_linear(in_f, out_f, bias, dtype, seed):
    """A float64 nn.Linear whose values are representable in `dtype`."""
    torch.manual_seed(seed)
    ref = nn.Linear(in_f, out_f, bias=bias, dtype=torch.float64)
    with torch.no_grad():
        for p in ref.parameters():
            p.copy_(p.to(dtype).to(torch.float64))
    return ref


def _w_column(in_f, out_f, multiple_of, bias, sequence_parallel, dtype, shape3d, overlap_chunks=1, rows=8):
    from fused_dense.parallel import ColumnParallelLinear

    ref = _ref_linear(in_f, out_f, bias, dtype, seed=1)
    x_full, x = _inputs(rows, in_f, sequence_parallel, dtype, shape3d=shape3d)
    y_ref = ref(x_full)
    g_full = torch.randn(y_ref.shape, dtype=torch.float64).to(dtype).to(torch.float64)
    y_ref.backward(g_full)

    layer = ColumnParallelLinear(in_f, out_f, dist.group.WORLD, bias=bias, sequence_parallel=sequence_parallel,
                                 multiple_of=multiple_of, device=_DEVICE, dtype=dtype, overlap_chunks=overlap_chunks)
    sl = layer.shard
    assert layer.weight.shape == (sl.stop - sl.start, in_f) and (layer.bias is not None) == bias
    with torch.no_grad():
        layer.weight.copy_(ref.weight[sl])
        if bias:
            layer.bias.copy_(ref.bias[sl])
    y = layer(x)
    _check(y, y_ref[..., sl], dtype, "column output")
    y.backward(g_full[..., sl].to(device=_DEVICE, dtype=dtype))
    rows_sl = _rows(x_full.shape[0]) if sequence_parallel else slice(None)
    _check(x.grad, x_full.grad[rows_sl], dtype, "column grad_input")
    _check(layer.weight.grad, ref.weight.grad[sl], dtype, "column grad_weight")
    if bias:
        _check(layer.bias.grad, ref.bias.grad[sl], dtype, "column grad_bias")


def _w_row(in_f, out_f, multiple_of, bias, sequence_parallel, dtype, shape3d, overlap_chunks=1, rows=8):
    from fused_dense.parallel import RowParallelLinear

    ref = _ref_linear(in_f, out_f, bias, dtype, seed=2)
    x_full, _ = _inputs(rows, in_f, False, dtype, shape3d=shape3d)
    y_ref = ref(x_full)
    g_full = torch.randn(y_ref.shape, dtype=torch.float64).to(dtype).to(torch.float64)
    y_ref.backward(g_full)

    layer = RowParallelLinear(in_f, out_f, dist.group.WORLD, bias=bias, sequence_parallel=sequence_parallel,
                              multiple_of=multiple_of, device=_DEVICE, dtype=dtype, overlap_chunks=overlap_chunks)
    sl = layer.shard
    assert layer.weight.shape == (out_f, sl.stop - sl.start)
    assert (layer.bias is not None) == (bias and _RANK == 0), "the bias lives on rank 0 only"
    with torch.no_grad():
        layer.weight.copy_(ref.weight[:, sl])
        if layer.bias is not None:
            layer.bias.copy_(ref.bias)
    x = x_full.detach()[..., sl].to(device=_DEVICE, dtype=dtype).requires_grad_()
    y = layer(x)
    rows_sl = _rows(x_full.shape[0]) if sequence_parallel else slice(None)
    _check(y, y_ref[rows_sl], dtype, "row output")
    y.backward(g_full[rows_sl].to(device=_DEVICE, dtype=dtype))
    _check(x.grad, x_full.grad[..., sl], dtype, "row grad_input")
    _check(layer.weight.grad, ref.weight.grad[:, sl], dtype, "row grad_weight")
    if layer.bias is not None:
        _check(layer.bias.grad, ref.bias.grad, dtype, "row grad_bias")


LAYER_CASES = [
    # (in_features, out_features, multiple_of): even, uneven by 1s, uneven in units of 4
    pytest.param((16, 32, 1), id="even"),
    pytest.param((16, 30, 1), id="uneven"),
    pytest.param((24, 36, 4), id="uneven_x4"),
]


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("sequence_parallel", [True, False], ids=["sp", "tp"])
@pytest.mark.parametrize("dims", LAYER_CASES)
@pytest.mark.parametrize("kind", ["column", "row"])
@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_parallel_linear(backend, world_size, kind, dims, sequence_parallel, bias):
    in_f, out_f, multiple_of = dims
    if kind == "row":  # split the input features instead
        in_f, out_f = out_f, in_f
    for dtype in _dtypes(backend):
        run_distributed(backend, world_size, f"_w_{kind}", in_f=in_f, out_f=out_f, multiple_of=multiple_of,
                        bias=bias, sequence_parallel=sequence_parallel, dtype=dtype, shape3d=False)


@pytest.mark.parametrize("overlap_chunks,rows", [(2, 8), (3, 24), (16, 8)])
@pytest.mark.parametrize("shape3d", [False, True], ids=["2d", "3d"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("sequence_parallel", [True, False], ids=["sp", "tp"])
@pytest.mark.parametrize("kind", ["column", "row"])
@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("backend", BACKENDS)
def test_parallel_linear_overlap_chunks(backend, world_size, kind, sequence_parallel, bias, shape3d, overlap_chunks,
                                        rows):
    """The pipelined linear layers (blocks of each rank's rows taken out of / put into the
    rank-major rows), uneven and capped block counts, against the single-process reference."""
    in_f, out_f = (16, 30) if kind == "column" else (30, 16)
    for dtype in _dtypes(backend):
        run_distributed(backend, world_size, f"_w_{kind}", in_f=in_f, out_f=out_f, multiple_of=1, bias=bias,
                        sequence_parallel=sequence_parallel, dtype=dtype, shape3d=shape3d,
                        overlap_chunks=overlap_chunks, rows=rows)


@pytest.mark.parametrize("kind", ["column", "row"])
@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_parallel_linear_3d_input(backend, world_size, kind):
    """[rows, 2, features] inputs: sequence parallelism splits dim 0, the layers flatten the rest."""
    for dtype in _dtypes(backend):
        run_distributed(backend, world_size, f"_w_{kind}", in_f=16, out_f=30, multiple_of=1, bias=True,
                        sequence_parallel=True, dtype=dtype, shape3d=True)


@pytest.mark.parametrize("kind", ["column", "row"])
@pytest.mark.parametrize("world_size", [2])
def test_parallel_linear_float64(world_size, kind):
    run_distributed("gloo", world_size, f"_w_{kind}", in_f=16, out_f=30, multiple_of=1, bias=True,
                    sequence_parallel=True, dtype=torch.float64, shape3d=False)


def _w_mlp(in_f, hidden, out_f, activation, bias1, bias2, sequence_parallel, checkpoint_lvl, heuristic,
           dtype, train, overlap_chunks=4, rows=8):
    from fused_dense.parallel import ParallelFusedMLP

    fc1 = _ref_linear(in_f, hidden, bias1, dtype, seed=3)
    fc2 = _ref_linear(hidden, out_f, bias2, dtype, seed=4)
    x_full, x = _inputs(rows, in_f, sequence_parallel, dtype)
    y_ref = fc2(_act_ref(fc1(x_full), activation))
    g_full = torch.randn(y_ref.shape, dtype=torch.float64).to(dtype).to(torch.float64)
    y_ref.backward(g_full)

    mlp = ParallelFusedMLP(in_f, hidden, out_f, activation=activation, process_group=dist.group.WORLD,
                           bias1=bias1, bias2=bias2, sequence_parallel=sequence_parallel,
                           checkpoint_lvl=checkpoint_lvl, heuristic=heuristic, device=_DEVICE, dtype=dtype,
                           overlap_chunks=overlap_chunks)
    mlp.train(train)
    sl = mlp.fc1.shard
    assert mlp.fc2.shard == sl
    with torch.no_grad():
        mlp.fc1.weight.copy_(fc1.weight[sl])
        mlp.fc2.weight.copy_(fc2.weight[:, sl])
        if bias1:
            mlp.fc1.bias.copy_(fc1.bias[sl])
        if mlp.fc2.bias is not None:
            mlp.fc2.bias.copy_(fc2.bias)
    assert (mlp.fc2.bias is not None) == (bias2 and _RANK == 0)
    y = mlp(x)
    rows_sl = _rows(rows) if sequence_parallel else slice(None)
    _check(y, y_ref[rows_sl], dtype, "mlp output")
    if not train:
        return
    y.backward(g_full[rows_sl].to(device=_DEVICE, dtype=dtype))
    _check(x.grad, x_full.grad[rows_sl], dtype, "mlp grad_input")
    _check(mlp.fc1.weight.grad, fc1.weight.grad[sl], dtype, "mlp fc1 grad_weight")
    _check(mlp.fc2.weight.grad, fc2.weight.grad[:, sl], dtype, "mlp fc2 grad_weight")
    if bias1:
        _check(mlp.fc1.bias.grad, fc1.bias.grad[sl], dtype, "mlp fc1 grad_bias")
    if mlp.fc2.bias is not None:
        _check(mlp.fc2.bias.grad, fc2.bias.grad, dtype, "mlp fc2 grad_bias")


@pytest.mark.parametrize("activation", ["gelu_approx", "relu", "sqrelu"])
@pytest.mark.parametrize("checkpoint_lvl", [0, 1, 2])
@pytest.mark.parametrize("sequence_parallel", [True, False], ids=["sp", "tp"])
@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_parallel_mlp(backend, world_size, sequence_parallel, checkpoint_lvl, activation):
    # hidden 38 splits unevenly: 19 + 19 on 2 ranks, 10 + 10 + 9 + 9 on 4.
    for dtype in _dtypes(backend):
        run_distributed(backend, world_size, "_w_mlp", in_f=16, hidden=38, out_f=16, activation=activation,
                        bias1=True, bias2=True, sequence_parallel=sequence_parallel,
                        checkpoint_lvl=checkpoint_lvl, heuristic="auto", dtype=dtype, train=True)


@pytest.mark.parametrize("heuristic", ["auto", -1, 0])
@pytest.mark.parametrize("biases", [(False, True), (True, False), (False, False)], ids=["b2", "b1", "nobias"])
@pytest.mark.parametrize("sequence_parallel", [True, False], ids=["sp", "tp"])
@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("backend", BACKENDS)
def test_parallel_mlp_bias_heuristic(backend, world_size, sequence_parallel, biases, heuristic):
    for dtype in _dtypes(backend):
        run_distributed(backend, world_size, "_w_mlp", in_f=24, hidden=64, out_f=20, activation="gelu_approx",
                        bias1=biases[0], bias2=biases[1], sequence_parallel=sequence_parallel,
                        checkpoint_lvl=1, heuristic=heuristic, dtype=dtype, train=True)


@pytest.mark.parametrize("overlap_chunks,rows", [(1, 8), (2, 8), (3, 8), (4, 24), (16, 8)])
@pytest.mark.parametrize("checkpoint_lvl", [0, 2])
@pytest.mark.parametrize("sequence_parallel", [True, False], ids=["sp", "tp"])
@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("backend", BACKENDS)
def test_parallel_mlp_overlap_chunks(backend, world_size, sequence_parallel, checkpoint_lvl, overlap_chunks, rows):
    """The pipelined layer with 1 block (no overlap), uneven blocks (3 of 4 or 2 local rows),
    more blocks than local rows (capped at one per row), against the single-process reference."""
    for dtype in _dtypes(backend):
        run_distributed(backend, world_size, "_w_mlp", in_f=16, hidden=40, out_f=12, activation="gelu_approx",
                        bias1=True, bias2=True, sequence_parallel=sequence_parallel,
                        checkpoint_lvl=checkpoint_lvl, heuristic="auto", dtype=dtype, train=True,
                        overlap_chunks=overlap_chunks, rows=rows)


@pytest.mark.parametrize("activation", ["gelu_approx", "relu"])
@pytest.mark.parametrize("world_size", [2])
@pytest.mark.parametrize("backend", BACKENDS)
def test_parallel_mlp_eval(backend, world_size, activation):
    """eval(): save_pre_act=False; the output is unchanged."""
    for dtype in _dtypes(backend):
        run_distributed(backend, world_size, "_w_mlp", in_f=16, hidden=32, out_f=16, activation=activation,
                        bias1=True, bias2=True, sequence_parallel=True, checkpoint_lvl=0, heuristic="auto",
                        dtype=dtype, train=False)


def _w_gated_mlp(in_f, hidden, out_f, activation, sequence_parallel, checkpoint_lvl, dtype, train=True,
                 overlap_chunks=1, rows=8):
    """ParallelFusedGatedMLP against the single-process FusedGatedMLP (float64, same weights), its
    shards loaded from the whole module's state_dict (LlamaMLP's names)."""
    from fused_dense import FusedGatedMLP, ops
    from fused_dense.parallel import ParallelFusedGatedMLP

    torch.manual_seed(5)
    single = FusedGatedMLP(in_f, hidden, out_f, activation=activation, dtype=torch.float64)
    with torch.no_grad():
        for p in single.parameters():
            p.copy_(p.to(dtype).to(torch.float64))
    x_full, x = _inputs(rows, in_f, sequence_parallel, dtype)
    y_ref = single(x_full)
    g_full = torch.randn(y_ref.shape, dtype=torch.float64).to(dtype).to(torch.float64)
    y_ref.backward(g_full)

    mlp = ParallelFusedGatedMLP(in_f, hidden, out_f, activation=activation, process_group=dist.group.WORLD,
                                sequence_parallel=sequence_parallel, checkpoint_lvl=checkpoint_lvl, device=_DEVICE,
                                dtype=dtype, overlap_chunks=overlap_chunks)
    mlp.train(train)
    full = single.state_dict()
    mlp.load_full_state_dict(full)
    sl = mlp.shard
    local = mlp.state_dict()  # this rank's shards, in LlamaMLP's names
    for name, part in (("gate_proj.weight", full["gate_proj.weight"][sl]), ("up_proj.weight", full["up_proj.weight"][sl]),
                       ("down_proj.weight", full["down_proj.weight"][:, sl])):
        assert torch.equal(local[name].cpu().double(), part.to(dtype).double()), name
    y = mlp(x)
    rows_sl = _rows(rows) if sequence_parallel else slice(None)
    _check(y, y_ref[rows_sl], dtype, "gated mlp output")
    if not train:
        return
    y.backward(g_full[rows_sl].to(device=_DEVICE, dtype=dtype))
    _check(x.grad, x_full.grad[rows_sl], dtype, "gated mlp grad_input")
    gate_g, up_g = ops.unpack_gate_up(mlp.gate_up_proj.weight.grad)
    ref_gate_g, ref_up_g = ops.unpack_gate_up(single.gate_up_proj.weight.grad)
    _check(gate_g, ref_gate_g[sl], dtype, "gated mlp gate grad_weight")
    _check(up_g, ref_up_g[sl], dtype, "gated mlp up grad_weight")
    _check(mlp.down_proj.weight.grad, single.down_proj.weight.grad[:, sl], dtype, "gated mlp down grad_weight")


@pytest.mark.parametrize("activation", ["swiglu", "geglu"])
@pytest.mark.parametrize("checkpoint_lvl", [0, 1, 2])
@pytest.mark.parametrize("sequence_parallel", [True, False], ids=["sp", "tp"])
@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_parallel_gated_mlp(backend, world_size, sequence_parallel, checkpoint_lvl, activation):
    # hidden 38 splits unevenly (19 + 19, 10 + 10 + 9 + 9): shards with short interleave blocks
    for dtype in _dtypes(backend):
        run_distributed(backend, world_size, "_w_gated_mlp", in_f=16, hidden=38, out_f=12, activation=activation,
                        sequence_parallel=sequence_parallel, checkpoint_lvl=checkpoint_lvl, dtype=dtype)


@pytest.mark.parametrize("overlap_chunks,train", [(1, False), (3, True)])
@pytest.mark.parametrize("world_size", [2])
@pytest.mark.parametrize("backend", BACKENDS)
def test_parallel_gated_mlp_eval_and_overlap_chunks(backend, world_size, overlap_chunks, train):
    for dtype in _dtypes(backend):
        run_distributed(backend, world_size, "_w_gated_mlp", in_f=16, hidden=40, out_f=16, activation="swiglu",
                        sequence_parallel=True, checkpoint_lvl=0, dtype=dtype, train=train,
                        overlap_chunks=overlap_chunks)


def _w_modules_process_group(dtype):
    """FusedDense / FusedMLP.forward(x, process_group) as in flash-attn: the caller holds the
    shards; x is this rank's rows; FusedDense returns its output-feature shard for all rows,
    FusedMLP this rank's rows of the summed output."""
    from fused_dense import FusedDense, FusedMLP
    from fused_dense.parallel import shard_range

    rows, in_f, hidden, out_f = 8, 16, 40, 12
    group = dist.group.WORLD
    ref = _ref_linear(in_f, out_f, True, dtype, seed=5)
    x_full, x = _inputs(rows, in_f, True, dtype)
    y_ref = ref(x_full)
    g_full = torch.randn(y_ref.shape, dtype=torch.float64).to(dtype).to(torch.float64)
    y_ref.backward(g_full)
    sl = shard_range(out_f, _WORLD, _RANK)
    dense = FusedDense(in_f, sl.stop - sl.start, device=_DEVICE, dtype=dtype)
    with torch.no_grad():
        dense.weight.copy_(ref.weight[sl])
        dense.bias.copy_(ref.bias[sl])
    y = dense(x, process_group=group)
    _check(y, y_ref[:, sl], dtype, "FusedDense(process_group) output")
    y.backward(g_full[:, sl].to(device=_DEVICE, dtype=dtype))
    _check(x.grad, x_full.grad[_rows(rows)], dtype, "FusedDense(process_group) grad_input")
    _check(dense.weight.grad, ref.weight.grad[sl], dtype, "FusedDense(process_group) grad_weight")

    fc1 = _ref_linear(in_f, hidden, True, dtype, seed=6)
    fc2 = _ref_linear(hidden, out_f, True, dtype, seed=7)
    x_full, x = _inputs(rows, in_f, True, dtype, seed=1)
    y_ref = fc2(F.gelu(fc1(x_full), approximate="tanh"))
    g_full = torch.randn(y_ref.shape, dtype=torch.float64).to(dtype).to(torch.float64)
    y_ref.backward(g_full)
    hs = shard_range(hidden, _WORLD, _RANK)
    mlp = FusedMLP(in_f, hs.stop - hs.start, out_f, bias2=_RANK == 0, device=_DEVICE, dtype=dtype)
    with torch.no_grad():
        mlp.fc1.weight.copy_(fc1.weight[hs])
        mlp.fc1.bias.copy_(fc1.bias[hs])
        mlp.fc2.weight.copy_(fc2.weight[:, hs])
        if _RANK == 0:
            mlp.fc2.bias.copy_(fc2.bias)
    y = mlp(x, process_group=group)
    _check(y, y_ref[_rows(rows)], dtype, "FusedMLP(process_group) output")
    y.backward(g_full[_rows(rows)].to(device=_DEVICE, dtype=dtype))
    _check(x.grad, x_full.grad[_rows(rows)], dtype, "FusedMLP(process_group) grad_input")
    _check(mlp.fc1.weight.grad, fc1.weight.grad[hs], dtype, "FusedMLP(process_group) fc1 grad_weight")
    _check(mlp.fc2.weight.grad, fc2.weight.grad[:, hs], dtype, "FusedMLP(process_group) fc2 grad_weight")
    if _RANK == 0:
        _check(mlp.fc2.bias.grad, fc2.bias.grad, dtype, "FusedMLP(process_group) fc2 grad_bias")


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_modules_with_process_group(backend, world_size):
    for dtype in _dtypes(backend):
        run_distributed(backend, world_size, "_w_modules_process_group", dtype=dtype)


# ---- FP8: the parallel layers (and FusedDense / FusedMLP with a process group) against the
# single-process FP8 layer holding the full weights

# kind: (in_features, out_features) of the full layer (the MLP's hidden width is 64)
_FP8_KINDS = {"column": (32, 64), "dense_pg": (32, 64), "row": (64, 32), "mlp": (32, 32), "mlp_pg": (32, 32),
              "gated": (32, 32)}


def _skip_unless_fp8(backend):
    if backend == "nccl" and torch.cuda.is_available() and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 needs a GPU of compute capability 8.9+")


def _fp8_pair(kind, recipe, sequence_parallel, dtype, aligned=False):
    """(single-process FP8 layer, this rank's layer holding its shards of the same weights, cut:
    {parameter name: index of this rank's shard in the full parameter}, (index of this rank's
    input in the full input, of its output in the full output), forward's keyword arguments).
    Kinds: the parallel layers ('column', 'row', 'mlp') and FusedDense / FusedMLP given a process
    group ('dense_pg', 'mlp_pg': this rank's shards, x its rows, as flash-attn's callers hold).
    ``aligned``: every weight shard holds its whole weight's amax (_align_amax)."""
    from fused_dense import FusedDense, FusedGatedMLP, FusedMLP
    from fused_dense.parallel import (ColumnParallelLinear, ParallelFusedGatedMLP, ParallelFusedMLP,
                                      RowParallelLinear, shard_range)

    group, f = dist.group.WORLD, dict(device=_DEVICE, dtype=dtype)
    rows, every = _rows(32) if sequence_parallel else slice(None), slice(None)
    in_f, out_f = _FP8_KINDS[kind]
    if kind in ("column", "dense_pg"):
        single = FusedDense(in_f, out_f, fp8=recipe, **f)
        sl = shard_range(out_f, _WORLD, _RANK)
        layer = (ColumnParallelLinear(in_f, out_f, group, sequence_parallel=sequence_parallel, fp8=recipe, **f)
                 if kind == "column" else FusedDense(in_f, sl.stop - sl.start, fp8=recipe, **f))
        cut, at = {"weight": sl, "bias": sl}, (rows, (every, sl))
    elif kind == "row":
        single = FusedDense(in_f, out_f, fp8=recipe, **f)
        layer = RowParallelLinear(in_f, out_f, group, sequence_parallel=sequence_parallel, fp8=recipe, **f)
        sl = layer.shard
        cut, at = {"weight": (every, sl), "bias": every}, ((every, sl), rows)
    elif kind == "gated":
        single = FusedGatedMLP(in_f, 64, out_f, fp8=recipe, **f)
        layer = ParallelFusedGatedMLP(in_f, 64, out_f, process_group=group, sequence_parallel=sequence_parallel,
                                      fp8=recipe, **f)
        sl = layer.shard
        # shards of whole interleave blocks: this rank's packed gate / up rows are one slice
        cut = {"gate_up_proj.weight": slice(2 * sl.start, 2 * sl.stop), "down_proj.weight": (every, sl)}
        at = (rows, rows)
    else:
        single = FusedMLP(in_f, 64, out_f, fp8=recipe, **f)
        sl = shard_range(64, _WORLD, _RANK)
        layer = (ParallelFusedMLP(in_f, 64, out_f, process_group=group, sequence_parallel=sequence_parallel,
                                  fp8=recipe, **f) if kind == "mlp"
                 else FusedMLP(in_f, sl.stop - sl.start, out_f, bias2=_RANK == 0, fp8=recipe, **f))
        cut = {"fc1.weight": sl, "fc1.bias": sl, "fc2.weight": (every, sl), "fc2.bias": every}
        at = (rows, rows)
    with torch.no_grad():
        full = dict(single.named_parameters())
        for name, p in full.items():
            if aligned and name.endswith("weight"):
                p.copy_(_align_amax(p, 0 if cut[name] is sl or name == "gate_up_proj.weight" else 1))
        for name, p in layer.named_parameters():
            p.copy_(full[name][cut[name]])
    return single, layer, cut, at, ({"process_group": group} if kind.endswith("_pg") else {})


def _align_amax(t, dim):
    """t with the first element of each rank's shard along `dim` set to amax(t): every shard's
    amax is then the whole tensor's, so the shard is quantized with the whole tensor's scale, to
    the same FP8 values."""
    from fused_dense.parallel import shard_range

    t = t.clone()
    for r in range(_WORLD):
        index = [0] * t.dim()
        index[dim] = shard_range(t.shape[dim], _WORLD, r).start
        t[tuple(index)] = t.abs().max()
    return t


def _fp8_step(layer, x, g, **kwargs):
    """One forward and backward: (output, x's gradient, {parameter name: gradient})."""
    x = x.detach().requires_grad_()
    layer.zero_grad(set_to_none=True)
    out = layer(x, **kwargs)
    out.backward(g)
    return out, x.grad, {n: p.grad for n, p in layer.named_parameters()}


# The slots of the tensors every rank quantizes whole (x gathered or replicated, the output
# gradient gathered or replicated): their amaxes are the single-process layer's, bit for bit.
_FP8_WHOLE_SLOTS = {"column": [0], "dense_pg": [0], "row": [1], "mlp": [0, 2], "mlp_pg": [0, 2], "gated": [0, 2]}


# What FP8 on shards must match, and how closely. The whole tensors (x gathered or replicated,
# the gathered or replicated output gradient) are quantized as by the single-process layer. A
# shard (of a weight, of the row layer's x, of the column layer's output gradient, and in the MLP
# always the hidden activation and its gradient) is scaled from its own amax:
# * aligned (every weight shard and sharded input holds its whole tensor's amax, _align_amax):
#   the same scale, so the same FP8 values, and a dense layer's results differ from the single
#   process only by the split of the reduced sums: TOL[dtype] (measured on gloo / float32: 6e-8;
#   tighter than test_fp8.py's FP8_TOL, the bound against a reference of the same quantization,
#   since here both sides run the same kernels). The MLP's hidden tensors stay per rank.
# * otherwise the scales differ by a ratio that is no power of two, which puts the shard's
#   elements on an offset FP8 grid: each side's value is within half a spacing of the exact one,
#   and their difference has an RMS of about 2^-m / sqrt(6 E[mantissa^2]) of the element (m
#   mantissa bits, E[mantissa^2] = 7/3 over [1, 2)): 3.3% for e4m3, 6.7% for e5m2; a result's
#   relative error (norm over norm) is of that size. The outputs see only e4m3 values (x, the
#   weights, the hidden activation); the gradients also the e5m2 output gradient and gradient at
#   the activation. With delayed scaling the MLPs' hidden shards take their scales from their own
#   amax history, the single process from the whole tensor's: where a step's values exceed the
#   history's max, each side saturates other elements.
#   Measured here (gloo, float32, 3 steps of both recipes, 7 sets of weights and data (a seed
#   offset added to the generator's and the weights'), FD_FP8_ERRORS=1 prints them): outputs up
#   to 4.0e-2 and gradients up to 9.4e-2, except the MLPs' delayed scaling: 1.05e-1 and 1.2e-1
#   (the gated MLP, on the step after the history was made). So FP8_SHARD_TOL_OUTPUT = 0.08 (a
#   factor 2), FP8_SHARD_TOL_GRAD = 0.15 (1.6 on the largest, 2.2 on the e5m2 RMS: the RMS of a
#   32-token sum fluctuates by tens of percent, so it cannot come closer), and for the MLPs'
#   delayed scaling FP8_SHARD_TOL_DELAYED_MLP = 0.25 (a factor 2.1). All fail a wrong shard, a
#   missing reduction, or fc2's bias added on every rank (36% on the MLP output here).
FP8_SHARD_TOL_OUTPUT = 0.08
FP8_SHARD_TOL_GRAD = 0.15
FP8_SHARD_TOL_DELAYED_MLP = 0.25
_FP8_MLP_KINDS = ("mlp", "mlp_pg", "gated")


def _fp8_tolerance(kind, aligned, dtype, scaling, what):
    """The tolerance of result `what` ('output' or 'grad ...') of an FP8 layer on shards."""
    if aligned and kind not in _FP8_MLP_KINDS:
        return TOL[dtype]
    if scaling == "delayed" and kind in _FP8_MLP_KINDS:
        return FP8_SHARD_TOL_DELAYED_MLP
    return FP8_SHARD_TOL_OUTPUT if what == "output" else FP8_SHARD_TOL_GRAD


def _w_fp8_layer(kind, sequence_parallel, scaling, dtype, aligned, save_weight=True):
    """Three FP8 steps (is_first_microbatch None, True, then False on the same weights) of the
    layer on this rank's shards against the single-process FP8 layer on the full weights; with
    delayed scaling also the amaxes of the whole tensors and the scaling state's round trip
    through state_dict. ``aligned``: the weight shards and the sharded inputs of the dense
    layers (the row layer's x, the column layer's output gradient) hold their whole tensor's
    amax (_align_amax). ``save_weight``: Float8Recipe.save_weight_fp8 of both layers."""
    from fused_dense import Float8Recipe

    recipe = Float8Recipe(scaling=scaling, min_features=0, save_weight_fp8=save_weight)
    single, layer, cut, (x_at, out_at), kwargs = _fp8_pair(kind, recipe, sequence_parallel, dtype, aligned)
    in_f, out_f = _FP8_KINDS[kind]
    for step, first in enumerate((None, True, False)):
        gen = torch.Generator().manual_seed(10 + step)
        x_full = torch.randn(32, in_f, generator=gen, dtype=torch.float64)
        g_full = torch.randn(32, out_f, generator=gen, dtype=torch.float64)
        if aligned and kind == "row":
            x_full = _align_amax(x_full, 1)
        if aligned and kind in ("column", "dense_pg"):
            g_full = _align_amax(g_full, 1)
        x_full, g_full = (t.to(device=_DEVICE, dtype=dtype) for t in (x_full, g_full))
        ref_out, ref_dx, ref_grads = _fp8_step(single, x_full, g_full, is_first_microbatch=first)
        out, dx, grads = _fp8_step(layer, x_full[x_at], g_full[out_at], is_first_microbatch=first, **kwargs)
        results = [("output", out, ref_out[out_at]), ("grad x", dx, ref_dx[x_at])]
        results += [(f"grad {n}", g, ref_grads[n][cut[n]]) for n, g in grads.items()]
        for what, got, ref in results:
            err = rel_err(got, ref)
            tol = _fp8_tolerance(kind, aligned, dtype, scaling, what)
            if os.environ.get("FD_FP8_ERRORS"):
                print(f"FP8ERR {kind} {aligned} {sequence_parallel} {scaling} {what} {err:.3e}", flush=True)
            assert err <= tol, (f"rank {_RANK}/{_WORLD}: {kind} {scaling} step {step}: {what}: relative error "
                                f"{err:.3e} > {tol:.2g}")
        if scaling == "delayed":
            for i in _FP8_WHOLE_SLOTS[kind]:
                assert torch.equal(layer.fp8_amax[i], single.fp8_amax[i]), f"step {step}: amax of slot {i}"
    if scaling == "delayed":
        state = layer.state_dict()
        assert {"fp8_amax_history", "fp8_scales", "fp8_amax"} <= set(state), sorted(state)
        _, fresh, *_ = _fp8_pair(kind, None, sequence_parallel, dtype)
        fresh.load_state_dict(state)
        for name in ("fp8_amax_history", "fp8_scales", "fp8_amax"):
            assert torch.equal(getattr(fresh, name), getattr(layer, name)), name


@pytest.mark.parametrize("aligned", [True, False], ids=["aligned", "random"])
@pytest.mark.parametrize("scaling", ["current", "delayed"])
@pytest.mark.parametrize("sequence_parallel", [True, False], ids=["sp", "tp"])
@pytest.mark.parametrize("kind", ["column", "row", "mlp", "gated"])
@pytest.mark.parametrize("world_size", [2])
@pytest.mark.parametrize("backend", BACKENDS)
def test_parallel_fp8(backend, world_size, kind, sequence_parallel, scaling, aligned):
    _skip_unless_fp8(backend)
    for dtype in _dtypes(backend):
        run_distributed(backend, world_size, "_w_fp8_layer", kind=kind, sequence_parallel=sequence_parallel,
                        scaling=scaling, dtype=dtype, aligned=aligned)


@pytest.mark.parametrize("kind", ["column", "row", "mlp", "gated"])
@pytest.mark.parametrize("world_size", [2])
@pytest.mark.parametrize("backend", BACKENDS)
def test_parallel_fp8_without_weight_copies(backend, world_size, kind):
    """save_weight_fp8=False on the shards: each rank's backward quantizes its weight shard again
    (the shard's own amax, as its forward did), within the same tolerances of the single-process
    layer."""
    _skip_unless_fp8(backend)
    for dtype in _dtypes(backend):
        run_distributed(backend, world_size, "_w_fp8_layer", kind=kind, sequence_parallel=True, scaling="current",
                        dtype=dtype, aligned=False, save_weight=False)


@pytest.mark.parametrize("aligned", [True, False], ids=["aligned", "random"])
@pytest.mark.parametrize("scaling", ["current", "delayed"])
@pytest.mark.parametrize("kind", ["dense_pg", "mlp_pg"])
@pytest.mark.parametrize("world_size", [2])
@pytest.mark.parametrize("backend", BACKENDS)
def test_modules_with_process_group_fp8(backend, world_size, kind, scaling, aligned):
    """FusedDense / FusedMLP.forward(x, process_group) in FP8: x gathered, the FP8 op on the
    caller's shards, FusedMLP's partial sums reduce-scattered, as in the model's dtype."""
    _skip_unless_fp8(backend)
    for dtype in _dtypes(backend):
        run_distributed(backend, world_size, "_w_fp8_layer", kind=kind, sequence_parallel=True, scaling=scaling,
                        dtype=dtype, aligned=aligned)


def _w_fp8_options():
    """fp8_autocast and convert_to_fp8 reach the parallel layers; the size rule reads the full
    widths; what FP8 does not run is refused with errors that name it."""
    import fused_dense
    from fused_dense import Float8Recipe, FusedDense, FusedMLP, fp8_autocast
    from fused_dense.parallel import ColumnParallelLinear, ParallelFusedGatedMLP, ParallelFusedMLP, RowParallelLinear

    group, recipe = dist.group.WORLD, Float8Recipe(min_features=0)
    x = _rank_tensor((8, 32), 0, torch.float32)
    with torch.no_grad():
        for delayed in (False, True):
            r = Float8Recipe(scaling="delayed" if delayed else "current", min_features=0)
            torch.manual_seed(0)
            explicit = ParallelFusedMLP(32, 64, process_group=group, sequence_parallel=False, fp8=r)
            torch.manual_seed(0)
            plain = ParallelFusedMLP(32, 64, process_group=group, sequence_parallel=False)
            with fp8_autocast(recipe=r):
                auto = plain(x)
            once = explicit(x)  # (each FP8 call advances the delayed-scaling state: one call each)
            assert torch.equal(auto, once), "fp8_autocast"
            assert not torch.equal(plain(x), once)  # outside the block: the model's dtype
            model = fused_dense.convert_to_fp8(nn.Sequential(plain), r)
            assert plain.fp8 == r and plain.fc1.fp8 == r
            assert torch.equal(model(x), explicit(x)), "convert_to_fp8"

    # The size rule on the full widths: 64 wide over 2 ranks (32 each) passes min_features=64.
    wide = Float8Recipe(min_features=64)
    assert ColumnParallelLinear(64, 64, group, fp8=wide)._fp8_recipe() == wide
    assert RowParallelLinear(64, 64, group, fp8=wide)._fp8_recipe() == wide
    assert ParallelFusedMLP(64, 64, process_group=group, fp8=wide)._fp8_recipe() == wide
    assert ParallelFusedMLP(32, 64, process_group=group, fp8=wide)._fp8_recipe() is None  # in_features 32
    assert FusedDense(64, 32, fp8=wide)._fp8_recipe(group) == wide  # the caller's shard, 32 of 64
    assert FusedDense(64, 32, fp8=wide)._fp8_recipe() is None
    assert FusedMLP(64, 32, 64, fp8=wide)._fp8_recipe(group) == wide

    for make in (lambda fp8: ColumnParallelLinear(32, 64, group, overlap_chunks=2, fp8=fp8),
                 lambda fp8: RowParallelLinear(64, 32, group, overlap_chunks=2, fp8=fp8),
                 lambda fp8: ParallelFusedMLP(32, 64, process_group=group, overlap_chunks=2, fp8=fp8)):
        with pytest.raises(NotImplementedError, match="fp8 with overlap_chunks=2 is not supported"):
            make(recipe)
        make(Float8Recipe())  # the size rule keeps these narrow layers in the model's dtype: pipelined
        layer = make(None)
        local_x = _rank_tensor((8, getattr(layer, "in_features", 32)), 0, torch.float32)
        layer(local_x)
        with fp8_autocast(recipe=recipe), pytest.raises(NotImplementedError, match="overlap_chunks=2"):
            layer(local_x)
    # without sequence parallelism a column layer has nothing to pipeline: FP8 runs
    ColumnParallelLinear(32, 64, group, sequence_parallel=False, overlap_chunks=2, fp8=recipe)(x)

    shards = [40 // _WORLD] * _WORLD
    with pytest.raises(ValueError, match=r"shard of out_features=40 to be a multiple of 16, got shards "
                                         + re.escape(str(shards)) + r".*multiple_of=16 makes them so"):
        ColumnParallelLinear(32, 40, group, fp8=recipe)
    with pytest.raises(ValueError, match=r"shard of hidden_features=40 .*choose hidden_features so"):
        ParallelFusedMLP(32, 40, process_group=group, fp8=recipe)
    ColumnParallelLinear(32, 40, group)  # fine in the model's dtype
    with pytest.raises(NotImplementedError, match="ParallelFusedGatedMLP: fp8 with overlap_chunks=2"):
        ParallelFusedGatedMLP(32, 64, process_group=group, overlap_chunks=2, fp8=recipe)
    with pytest.raises(ValueError, match=r"ParallelFusedGatedMLP: FP8 needs each rank's shard of hidden_features=40"):
        ParallelFusedGatedMLP(32, 40, process_group=group, fp8=recipe)
    assert ParallelFusedGatedMLP(32, 64, process_group=group, fp8=Float8Recipe())._fp8_recipe() is None  # size rule
    with pytest.raises(TypeError, match="fp8 must be None, a bool or a fused_dense.Float8Recipe"):
        RowParallelLinear(64, 32, group, fp8="e4m3")


@pytest.mark.parametrize("world_size", [2])
@pytest.mark.parametrize("backend", ["gloo"])
def test_parallel_fp8_options(backend, world_size):
    run_distributed(backend, world_size, "_w_fp8_options")


# ---- FSDP2 (fully_shard) over FP8 layers


class _FP8Net(nn.Module):
    def __init__(self, recipe=None):
        super().__init__()
        from fused_dense import Float8Recipe, FusedMLP

        recipe = recipe or Float8Recipe(min_features=0)
        self.mlp1, self.norm, self.mlp2 = FusedMLP(32, 64, fp8=recipe), nn.LayerNorm(32), FusedMLP(32, 64, fp8=recipe)

    def forward(self, x, is_first_microbatch=None):
        h = x + self.mlp1(x, is_first_microbatch=is_first_microbatch)
        return self.mlp2(self.norm(h), is_first_microbatch=is_first_microbatch)


# FSDP2 against one process: both quantize the same tensors (each micro-batch's x, the whole
# weights that FSDP2 gathers before each layer), so they differ only by the float32 order of the
# gradient average over ranks, unless a weight, moved by that after an optimizer step, crosses an
# FP8 rounding boundary. test_fp8.py's FP8_TOL (the same quantization) bounds both; measured here:
# at most 1e-7.
FSDP_FP8_TOL = 2e-2


def _w_fsdp2_fp8(microbatches, steps=3):
    """fully_shard over a model of FusedMLP(fp8) layers, data parallel on every rank, trained
    `steps` SGD steps against the same model unsharded in this process running every rank's
    micro-batches. With several micro-batches per step, the first casts the weights to FP8 and
    keeps the copies (is_first_microbatch=True) and the others reuse them (False) while FSDP2
    frees and re-gathers the unsharded weights around each forward and backward."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    ref = _FP8Net().to(_DEVICE)
    torch.manual_seed(0)
    model = _FP8Net().to(_DEVICE)
    mesh = init_device_mesh(_DEVICE.type, (_WORLD,))
    fully_shard(model.mlp1, mesh=mesh)
    fully_shard(model.mlp2, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt, opt_ref = torch.optim.SGD(model.parameters(), lr=0.5), torch.optim.SGD(ref.parameters(), lr=0.5)
    flags = [None] if microbatches == 1 else [True] + [False] * (microbatches - 1)

    def batch(step, rank, micro):
        g = torch.Generator().manual_seed(100 * step + 10 * rank + micro)
        return (torch.randn(16, 32, generator=g).to(_DEVICE), torch.randn(16, 32, generator=g).to(_DEVICE))

    def full(t):
        return t.full_tensor() if hasattr(t, "full_tensor") else t

    for step in range(steps):
        losses = {}
        for rank in range(_WORLD):  # every rank's micro-batches, one after the other, one cast per step
            for micro, flag in enumerate(flags):
                x, target = batch(step, rank, micro)
                loss = F.mse_loss(ref(x, is_first_microbatch=flag if rank == 0 or flag is None else False), target)
                (loss / (microbatches * _WORLD)).backward()
                losses[rank, micro] = loss.detach()
        for micro, flag in enumerate(flags):  # FSDP2 averages the gradients over the ranks
            x, target = batch(step, _RANK, micro)
            loss = F.mse_loss(model(x, is_first_microbatch=flag), target)
            (loss / microbatches).backward()
            err = rel_err(loss.detach(), losses[_RANK, micro])
            assert err <= FSDP_FP8_TOL, f"rank {_RANK}: step {step} micro-batch {micro}: loss error {err:.3e}"
        ref_params = dict(ref.named_parameters())
        for name, p in model.named_parameters():
            err = rel_err(full(p.grad), ref_params[name].grad)
            assert err <= FSDP_FP8_TOL, f"rank {_RANK}: step {step}: grad of {name}: relative error {err:.3e}"
        opt.step()
        opt_ref.step()
        opt.zero_grad()
        opt_ref.zero_grad()
    for name, p in model.named_parameters():
        err = rel_err(full(p.detach()), dict(ref.named_parameters())[name].detach())
        assert err <= FSDP_FP8_TOL, f"rank {_RANK}: {name} after training: relative error {err:.3e}"


@pytest.mark.parametrize("microbatches", [1, 3])
def test_fsdp2_fp8_matches_single_process(microbatches):
    try:
        from torch.distributed.fsdp import fully_shard  # noqa: F401
    except ImportError:
        pytest.skip("this torch has no torch.distributed.fsdp.fully_shard")
    run_distributed("gloo", 2, "_w_fsdp2_fp8", microbatches=microbatches)


# ---- delayed scaling's amaxes shared over a process group


def _gather(t):
    out = [torch.empty_like(t) for _ in range(_WORLD)]
    dist.all_gather(out, t.contiguous())
    return out


def _w_fp8_amax_group():
    """With amax_reduction_group, each step's amaxes enter every rank's history as their max over
    the ranks (without it, each rank's own), so the ranks derive the same scales; a NaN amax on one
    rank enters every rank's history as inf and keeps the scale."""
    from fused_dense import Float8Recipe, FusedDense, FusedMLP
    from fused_dense.fp8 import scaling_started

    grouped = Float8Recipe(scaling="delayed", min_features=0, amax_reduction_group=dist.group.WORLD)
    local = Float8Recipe(scaling="delayed", min_features=0)
    for make in (lambda r: FusedMLP(32, 64, fp8=r), lambda r: FusedDense(32, 48, fp8=r)):
        torch.manual_seed(0)
        g = make(grouped).to(_DEVICE)
        torch.manual_seed(0)
        u = make(local).to(_DEVICE)
        scaling_started(u, True)  # its first step at scale 1, as a group's (without: current scaling)
        width = 48 if isinstance(g, FusedDense) else 32
        for step in range(3):
            x = _rank_tensor((16, 32), 10 * step + _RANK, torch.float32, scale=1.0 + _RANK + step)
            if step == 2 and _RANK == 1:
                x[3, 5] = float("nan")
            target = _rank_tensor((16, width), 100 + _RANK, torch.float32)
            for m in (g, u):
                (m(x) * target).sum().backward()
            rec_g, rec_u = g.fp8_amax.clone(), u.fp8_amax.clone()  # this step's records
            if step == 0:
                assert torch.equal(rec_g, rec_u)  # both started from scale 1
            ranks = torch.stack(_gather(rec_g))
            expect = torch.where(torch.isnan(ranks).any(0), torch.inf, ranks.amax(0))
            with torch.no_grad():  # the next forward pushes the records and derives the scales
                g(x.nan_to_num())
                u(x.nan_to_num())
            assert torch.equal(g.fp8_amax_history[0], expect), f"step {step}: {g.fp8_amax_history[0]} != {expect}"
            assert torch.equal(u.fp8_amax_history[0].nan_to_num(nan=-1.0), rec_u.nan_to_num(nan=-1.0))
            for name in ("fp8_amax_history", "fp8_scales"):
                copies = _gather(getattr(g, name))
                assert all(torch.equal(c, copies[0]) for c in copies), f"{name} differs between ranks"
            assert torch.isfinite(g.fp8_scales).all()
        theirs = _gather(u.fp8_scales)
        assert not all(torch.equal(c, theirs[0]) for c in theirs), "without the group the ranks' scales differ"
    with pytest.raises(ValueError, match="amax_reduction_group applies to scaling='delayed'"):
        Float8Recipe(amax_reduction_group=dist.group.WORLD)
    with pytest.raises(TypeError, match="amax_reduction_group must be a torch.distributed.ProcessGroup, got int"):
        Float8Recipe(scaling="delayed", amax_reduction_group=0)


@pytest.mark.parametrize("world_size", [2])
@pytest.mark.parametrize("backend", ["gloo"])
def test_fp8_amax_reduction_group(backend, world_size):
    run_distributed(backend, world_size, "_w_fp8_amax_group")


def _w_fsdp2_fp8_delayed(steps=3):
    """fully_shard over FusedMLP layers with delayed scaling and the amaxes shared over the ranks,
    against one process training on every rank's batch at once: the union's amax is the max of
    the ranks', so both keep the same scaling state, quantize alike and take the same steps."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from fused_dense import Float8Recipe

    mesh = init_device_mesh(_DEVICE.type, (_WORLD,))
    recipe = Float8Recipe(scaling="delayed", min_features=0, amax_reduction_group=dist.group.WORLD)
    from fused_dense.fp8 import scaling_started

    torch.manual_seed(0)
    ref = _FP8Net(Float8Recipe(scaling="delayed", min_features=0)).to(_DEVICE)
    for sub in (ref.mlp1, ref.mlp2):  # a group's first step runs at scale 1: so does the reference's
        scaling_started(sub, True)
    torch.manual_seed(0)
    model = _FP8Net(recipe).to(_DEVICE)
    fully_shard(model.mlp1, mesh=mesh)
    fully_shard(model.mlp2, mesh=mesh)
    fully_shard(model, mesh=mesh)
    # FSDP2's gradients are the ranks' average, the reference's their sum
    opt = torch.optim.SGD(model.parameters(), lr=0.005 * _WORLD)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.005)

    def batch(step, rank):
        g = torch.Generator().manual_seed(100 * step + 10 * rank)
        return (torch.randn(16, 32, generator=g).to(_DEVICE), torch.randn(16, 32, generator=g).to(_DEVICE))

    for step in range(steps):
        xs, ts = zip(*(batch(step, r) for r in range(_WORLD)))
        # summed losses: each row's output gradient is the same in both (so are the amaxes)
        ref_loss = (ref(torch.cat(xs)) - torch.cat(ts)).square().sum()
        ref_loss.backward()
        x, target = batch(step, _RANK)
        loss = (model(x) - target).square().sum()
        loss.backward()
        total = loss.detach().clone()
        dist.all_reduce(total)
        err = rel_err(total, ref_loss.detach())
        assert err <= FSDP_FP8_TOL, f"rank {_RANK}: step {step}: loss error {err:.3e}"
        ref_params = dict(ref.named_parameters())
        for name, p in model.named_parameters():  # FSDP2 averages the gradients over the ranks
            err = rel_err(p.grad.full_tensor() * _WORLD, ref_params[name].grad)
            assert err <= FSDP_FP8_TOL, f"rank {_RANK}: step {step}: grad of {name}: relative error {err:.3e}"
        for sub in ("mlp1", "mlp2"):
            mine, theirs = getattr(model, sub), getattr(ref, sub)
            union = torch.stack(_gather(mine.fp8_amax)).amax(0)  # what the next step pushes
            err = rel_err(union, theirs.fp8_amax)
            assert err <= FSDP_FP8_TOL, f"rank {_RANK}: step {step}: {sub} amaxes {union} vs {theirs.fp8_amax}"
            err = rel_err(mine.fp8_amax_history, theirs.fp8_amax_history)
            assert err <= FSDP_FP8_TOL, f"rank {_RANK}: step {step}: {sub} amax history: relative error {err:.3e}"
        opt.step()
        opt_ref.step()
        opt.zero_grad()
        opt_ref.zero_grad()


def test_fsdp2_fp8_delayed_shares_amaxes():
    try:
        from torch.distributed.fsdp import fully_shard  # noqa: F401
    except ImportError:
        pytest.skip("this torch has no torch.distributed.fsdp.fully_shard")
    run_distributed("gloo", 2, "_w_fsdp2_fp8_delayed")


def test_constructor_errors():
    from fused_dense import ColumnParallelLinear, ParallelFusedGatedMLP, ParallelFusedMLP, RowParallelLinear
    with pytest.raises(ValueError, match="ParallelFusedGatedMLP needs a process_group"):
        ParallelFusedGatedMLP(8, 16)
    with pytest.raises(ValueError, match="bias must be False"):
        ParallelFusedGatedMLP(8, 16, bias=True)
    with pytest.raises(ValueError, match=r"activation must be one of \['swiglu', 'geglu'\], got 'gelu_approx'"):
        ParallelFusedGatedMLP(8, 16, activation="gelu_approx")

    with pytest.raises(ValueError, match="process_group"):
        ParallelFusedMLP(8, 16)
    with pytest.raises(ValueError, match="process_group"):
        ColumnParallelLinear(8, 16, None)
    with pytest.raises(ValueError, match="process_group"):
        RowParallelLinear(8, 16, None)
    with pytest.raises(ValueError, match="activation"):
        ParallelFusedMLP(8, activation="tanh")
    with pytest.raises(ValueError, match="checkpoint_lvl"):
        ParallelFusedMLP(8, checkpoint_lvl=3)
    with pytest.raises(ValueError, match="heuristic"):
        ParallelFusedMLP(8, heuristic="fast")


# ---- a GPT-style model trained 5 steps: tensor parallel vs one process


class _Attention(nn.Module):
    """Causal self-attention. qkv output features are laid out [head, (q, k, v), head_dim] so
    that a column split in units of 3 * head_dim gives each rank whole heads."""

    def __init__(self, dim, n_heads, group, sequence_parallel):
        super().__init__()
        from fused_dense.parallel import ColumnParallelLinear, RowParallelLinear

        self.head_dim = dim // n_heads
        if group is None:
            self.qkv = nn.Linear(dim, 3 * dim)
            self.proj = nn.Linear(dim, dim)
        else:
            self.qkv = ColumnParallelLinear(dim, 3 * dim, group, sequence_parallel=sequence_parallel,
                                            multiple_of=3 * self.head_dim)
            self.proj = RowParallelLinear(dim, dim, group, sequence_parallel=sequence_parallel,
                                          multiple_of=self.head_dim)

    def forward(self, x, batch):
        qkv = self.qkv(x)                                   # [batch * seq, local heads * 3 * hd]
        qkv = qkv.view(batch, -1, qkv.shape[-1] // (3 * self.head_dim), 3, self.head_dim)
        q, k, v = qkv.permute(3, 0, 2, 1, 4).unbind(0)      # [batch, heads, seq, hd]
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(o.transpose(1, 2).reshape(-1, o.shape[1] * self.head_dim))


class _RefMLP(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(dim, hidden), nn.Linear(hidden, dim)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


class _Block(nn.Module):
    def __init__(self, dim, n_heads, group, sequence_parallel):
        super().__init__()
        from fused_dense.parallel import ParallelFusedMLP

        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = _Attention(dim, n_heads, group, sequence_parallel)
        if group is None:
            self.mlp = _RefMLP(dim, 4 * dim)
        else:
            self.mlp = ParallelFusedMLP(dim, 4 * dim, process_group=group, sequence_parallel=sequence_parallel)

    def forward(self, x, batch):
        x = x + self.attn(self.ln1(x), batch)
        return x + self.mlp(self.ln2(x))


class _GPT(nn.Module):
    """Tokens in, summed cross-entropy out. Rows are the flattened (batch, seq) positions; under
    sequence parallelism each rank embeds, normalises and scores only its slice of the rows."""

    def __init__(self, vocab, dim, n_heads, n_layers, seq, group=None, sequence_parallel=False):
        super().__init__()
        self.group, self.sequence_parallel, self.seq = group, sequence_parallel, seq
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(seq, dim)
        self.blocks = nn.ModuleList(_Block(dim, n_heads, group, sequence_parallel) for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        if group is not None:  # mark the replicated parameters for the distributed helpers
            replicated = [self.tok, self.pos, self.ln_f, self.head] + [m for b in self.blocks for m in (b.ln1, b.ln2)]
            for m in replicated:
                for p in m.parameters():
                    p._shared_params = True
                    if sequence_parallel:
                        p._sequence_parallel = True

    def forward(self, tokens, targets):
        batch = tokens.shape[0]
        rows = torch.arange(tokens.numel(), device=tokens.device)
        tokens, targets = tokens.reshape(-1), targets.reshape(-1)
        if self.group is not None and self.sequence_parallel:
            n = tokens.numel() // dist.get_world_size(self.group)
            mine = slice(dist.get_rank(self.group) * n, (dist.get_rank(self.group) + 1) * n)
            tokens, targets, rows = tokens[mine], targets[mine], rows[mine]
        x = self.tok(tokens) + self.pos(rows % self.seq)
        for block in self.blocks:
            x = block(x, batch)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.float(), targets, reduction="sum")


def _load_shards(tp_model, ref_model):
    """Copies the reference weights into the tensor-parallel model, each rank its shard."""
    from fused_dense.parallel import ColumnParallelLinear, RowParallelLinear

    ref_modules = dict(ref_model.named_modules())
    with torch.no_grad():
        for name, m in tp_model.named_modules():
            ref = ref_modules[name]
            if isinstance(m, ColumnParallelLinear):
                m.weight.copy_(ref.weight[m.shard])
                if m.bias is not None:
                    m.bias.copy_(ref.bias[m.shard])
            elif isinstance(m, RowParallelLinear):
                m.weight.copy_(ref.weight[:, m.shard])
                if m.bias is not None:
                    m.bias.copy_(ref.bias)
            elif isinstance(m, (nn.LayerNorm, nn.Embedding, nn.Linear)):
                for p, rp in zip(m.parameters(), ref.parameters()):
                    p.copy_(rp)


def _w_gpt(sequence_parallel, steps, dtype):
    from fused_dense.distributed import allreduce_sequence_parallel_grad, sync_shared_params
    from fused_dense.parallel import ColumnParallelLinear, RowParallelLinear

    # 6 heads: 3 + 3 on 2 ranks, 2 + 2 + 1 + 1 on 4 (uneven, through multiple_of).
    vocab, dim, heads, layers, batch, seq = 64, 48, 6, 2, 2, 8
    group = dist.group.WORLD
    torch.manual_seed(0)
    ref = _GPT(vocab, dim, heads, layers, seq).to(device=_DEVICE, dtype=dtype)
    torch.manual_seed(1 + _RANK)  # different init per rank: the shards come from `ref`
    tp = _GPT(vocab, dim, heads, layers, seq, group, sequence_parallel).to(device=_DEVICE, dtype=dtype)
    _load_shards(tp, ref)
    if _RANK != 0:  # replicated parameters must come from rank 0
        with torch.no_grad():
            for p in tp.parameters():
                if getattr(p, "_shared_params", False):
                    p.add_(1.0)
    sync_shared_params(tp, group)

    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.01)
    opt_tp = torch.optim.AdamW(tp.parameters(), lr=1e-2, weight_decay=0.01)
    g = torch.Generator().manual_seed(7)
    data = torch.randint(0, vocab, (batch, seq + 1), generator=g).to(_DEVICE)  # one batch, memorised
    tokens, targets = data[:, :-1], data[:, 1:]
    losses_ref, losses_tp = [], []
    for _ in range(steps):
        loss_ref = ref(tokens, targets) / targets.numel()
        loss_ref.backward()
        opt_ref.step()
        opt_ref.zero_grad()
        loss_tp = tp(tokens, targets) / targets.numel()
        loss_tp.backward()
        allreduce_sequence_parallel_grad(tp, group)
        opt_tp.step()
        opt_tp.zero_grad()
        total = loss_tp.detach().clone()
        if sequence_parallel:  # each rank scored its rows only
            dist.all_reduce(total, group=group)
        losses_ref.append(loss_ref.item())
        losses_tp.append(total.item())
    tol = 10 * TOL[dtype]
    for step, (a, b) in enumerate(zip(losses_tp, losses_ref)):
        assert abs(a - b) <= tol * abs(b), f"rank {_RANK}: step {step}: TP loss {a} vs reference {b}"
    assert losses_ref[-1] < losses_ref[0], f"training did not reduce the loss: {losses_ref}"
    ref_modules = dict(ref.named_modules())
    for name, m in tp.named_modules():
        r = ref_modules[name]
        if isinstance(m, ColumnParallelLinear):
            _check(m.weight, r.weight[m.shard], dtype, f"{name}.weight after training")
        elif isinstance(m, RowParallelLinear):
            _check(m.weight, r.weight[:, m.shard], dtype, f"{name}.weight after training")
            if m.bias is not None:
                _check(m.bias, r.bias, dtype, f"{name}.bias after training")
        elif isinstance(m, (nn.LayerNorm, nn.Embedding)) or type(m) is nn.Linear:
            for (pn, p), rp in zip(m.named_parameters(), r.parameters()):
                _check(p, rp, dtype, f"{name}.{pn} after training")


@pytest.mark.parametrize("sequence_parallel", [True, False], ids=["sp", "tp"])
@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_gpt_training_matches_single_process(backend, world_size, sequence_parallel):
    dtype = torch.float32
    run_distributed(backend, world_size, "_w_gpt", sequence_parallel=sequence_parallel, steps=5, dtype=dtype)


# ---- the tensor-parallel GPT example under torchrun

EXAMPLE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "train_gpt_tp.py")


def _run_example(nproc, *args, timeout=240):
    import subprocess

    root = os.path.dirname(os.path.dirname(EXAMPLE))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", EXAMPLE,
           *args]
    try:
        return subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{' '.join(cmd)} did not finish within {timeout}s:\n{e.stdout}\n{e.stderr}", pytrace=False)


def test_example_torchrun_cpu():
    proc = _run_example(2, "--device", "cpu", "--steps", "5", "--d-model", "48", "--heads", "6", "--batch", "4",
                        "--seq", "16")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "2 rank(s), gloo on cpu" in proc.stdout
    assert "OK: TP=2 matches one process" in proc.stdout, proc.stdout + proc.stderr
    assert "5/5" in proc.stderr  # the progress bar


@pytest.mark.cuda
def test_example_torchrun_cuda():
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 GPUs, {torch.cuda.device_count()} present")
    proc = _run_example(2, "--device", "cuda", "--steps", "100")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "2 rank(s), nccl on cuda" in proc.stdout
    assert "OK: TP=2 matches one process" in proc.stdout, proc.stdout + proc.stderr
