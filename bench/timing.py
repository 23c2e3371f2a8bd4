"""How a figure is timed: medians of repetitions with a cold L2, and interleaved rounds.

Bench(fn) times one function: triton.testing.do_bench when importable (else CUDA events around
each repetition), warm-up of at least warmup_ms and 2 calls, at least rep_ms and min_reps
repetitions, the L2 cache flushed before each; a figure whose p80 / p20 exceeds RETRY_SPREAD is
measured once more and the steadier of the two kept. Bench.interleaved(fns, rounds) times several
functions in rounds, the order rotated by one place per round, each block after the whole warm-up.
No figure holds the library's tuner at work: 'auto' measures a problem's candidates the first time
it meets it, or later where its pace (fused_dense.tuning, FUSED_DENSE_TUNING_PACE) deferred it,
which can fall inside timed repetitions; a block or figure during whose repetitions the tuner
measured (tuner_seconds grew) is timed again, up to RETIME_TUNED times (untuned), and counted
(`retimed`).
SavedStorages and step_memory: what a step keeps for backward and the peak it allocates.
"""
import contextlib
import gc
import math
import statistics
import time

import torch

MIB = 1024 * 1024
L2_FLUSH_BYTES = 256 * MIB  # written before each timed repetition: larger than any GPU's L2
_flush_buffers = {}
RETIME_TUNED = 3  # times a block whose repetitions held a tuner measurement is timed again


def tuner_seconds(device):
    """Seconds the library's tuner has spent measuring in this process (fused_dense.tuning.stats'
    measuring_s): 0 off CUDA and without the library's CUDA kernels, where nothing is tuned."""
    if device.type != "cuda":
        return 0.0
    import fused_dense
    if not fused_dense.has_cuda_kernels():
        return 0.0
    return fused_dense.tuning.stats()["measuring_s"]


def untuned(run, device):
    """(run()'s result, times it ran again): run() again while the library's tuner measured during
    it (tuner_seconds grew), at most RETIME_TUNED times more; the rule of every timed block and
    profile of the benchmarks."""
    for retimed in range(RETIME_TUNED + 1):
        tuned_at = tuner_seconds(device)
        out = run()
        if tuner_seconds(device) == tuned_at:
            break
    return out, retimed


def l2_flush_buffer(device):
    """The buffer whose zero_() before a repetition leaves the L2 cache cold (one per device, kept)."""
    buf = _flush_buffers.get(device)
    if buf is None:
        buf = _flush_buffers[device] = torch.empty(L2_FLUSH_BYTES, dtype=torch.int8, device=device)
    return buf


def summary(times):
    """Median and 20th / 80th percentiles (ms) of a list of repetition times."""
    times = sorted(times)

    def q(p):
        return times[min(len(times) - 1, int(round(p * (len(times) - 1))))]
    return {"ms": statistics.median(times), "p20": q(0.2), "p80": q(0.8), "reps": len(times)}


def spread(res):
    p20, p80 = res.get("p20"), res.get("p80")
    return p80 / p20 if p20 and p80 else None


class Bench:
    RETRY_SPREAD = 1.05  # p80 / p20 above this: the figure is measured again

    def __init__(self, device, warmup_ms=50.0, rep_ms=200.0, min_reps=8, cpu_reps=5, timer="auto"):
        self.device, self.cuda = device, device.type == "cuda"
        self.warmup_ms, self.rep_ms, self.min_reps, self.cpu_reps = warmup_ms, rep_ms, min_reps, cpu_reps
        self.do_bench = None
        self._flush = None
        self.retimed = 0  # blocks and figures timed again so far (untuned)
        self.method = "cpu perf_counter median"
        if self.cuda:
            self.method = "CUDA events median (cold L2 each rep)"
            if timer != "events":
                try:
                    from triton.testing import do_bench
                    self.do_bench = do_bench
                    self.method = "triton.testing.do_bench median (cold L2 each rep)"
                except ImportError:
                    self.method += "; triton not importable"

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def allocator_calls(self):
        """cudaMalloc + cudaFree calls of PyTorch's caching allocator on this device so far."""
        if not self.cuda:
            return 0
        stats = torch.cuda.memory_stats(self.device)
        return stats.get("num_device_alloc", 0) + stats.get("num_device_free", 0)

    @staticmethod
    def _reset(grad_to_none):
        for t in grad_to_none or ():
            t.grad = None

    def _estimate_ms(self, fn, grad_to_none):
        """One warm call, then the mean of 2 calls, synchronized."""
        self._reset(grad_to_none)
        fn()
        self.sync()
        t = time.perf_counter()
        for _ in range(2):
            self._reset(grad_to_none)
            fn()
        self.sync()
        return max((time.perf_counter() - t) * 1e3 / 2, 1e-3)

    def __call__(self, fn, grad_to_none=None):
        est = self._estimate_ms(fn, grad_to_none)
        if not self.cuda:
            return summary(self._timed(fn, grad_to_none, 0, self.cpu_reps))
        before = self.allocator_calls()
        retimed_at = self.retimed
        res = self._cuda_once(fn, grad_to_none, est)
        s = spread(res)
        if s is not None and s > self.RETRY_SPREAD:
            # a clock or power transient disturbed the repetitions: once more, keep the steadier
            again = self._cuda_once(fn, grad_to_none, est)
            kept, dropped = (again, res) if (spread(again) or 0.0) < s else (res, again)
            kept["remeasured"] = {"dropped": {k: dropped.get(k) for k in ("ms", "p20", "p80")},
                                  "reason": f"p80 / p20 = {s:.3f} > {self.RETRY_SPREAD}"}
            res = kept
        # cudaMalloc / cudaFree inside the timing stall the GPU: such a figure includes the allocator
        res["allocator_calls"] = self.allocator_calls() - before
        res["retimed"] = self.retimed - retimed_at
        return res

    def _cuda_once(self, fn, grad_to_none, est):
        rep = max(self.rep_ms, self.min_reps * est)
        warm = max(self.warmup_ms, 2 * est)
        n = max(1, int(rep / est))
        if self.do_bench is None:
            return summary(self._timed(fn, grad_to_none, max(1, int(warm / est)), n))
        # do_bench under untuned, its own warm-up inside the span watched (_timed watches its calls)
        q, retimed = untuned(lambda: self.do_bench(fn, warmup=warm, rep=rep, grad_to_none=grad_to_none,
                                                   quantiles=[0.5, 0.2, 0.8]), self.device)
        self.retimed += retimed
        return {"ms": float(q[0]), "p20": float(q[1]), "p80": float(q[2]), "reps": n}

    def _timed(self, fn, grad_to_none, warm, n):
        """warm untimed calls, then the times (ms) of n calls: on CUDA events around each with the
        L2 flushed before each, on the CPU perf_counter around each. Gradients are dropped after.
        The n calls run under untuned (the warm-up is outside the span watched)."""
        for _ in range(warm):
            self._reset(grad_to_none)
            fn()
        times, retimed = untuned(lambda: self._reps(fn, grad_to_none, n), self.device)
        self.retimed += retimed
        return times

    def _reps(self, fn, grad_to_none, n):
        if not self.cuda:
            times = []
            for _ in range(n):
                self._reset(grad_to_none)
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e3)
            self._reset(grad_to_none)
            return times
        if self._flush is None:
            self._flush = l2_flush_buffer(self.device)
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
        for i in range(n):
            self._reset(grad_to_none)
            self._flush.zero_()
            starts[i].record()
            fn()
            ends[i].record()
        self.sync()
        self._reset(grad_to_none)
        return [s.elapsed_time(e) for s, e in zip(starts, ends)]

    def interleaved(self, fns, rounds, before_each=None, windows=None, progress=None):
        """Times each of fns ({key: (fn, grad_to_none)}) in `rounds` rounds; each round gives each
        key a block: the whole warm-up, then its share of the repetitions. The order rotates by one
        place per round, so a drift of clocks or temperature, or the transient left by one variant's
        first call, falls on all keys alike. Every block gets the whole warm-up because it starts
        after the host's gap between blocks, and must be timed once clocks have settled again.

        Returns {key: summary + rounds, round_ms (each block's median), allocator_calls}, or
        {key: {"error": exception}} for a key that raised (it leaves the later rounds).
        before_each(key) runs before each block; windows, a dict, receives per key the wall-clock
        span (time.time()) of each block's repetitions and the last third of its warm-up (at most
        300 ms), to match against clock samples; progress(round, rounds) runs after each round."""
        keys = list(fns)
        est, failed = {}, {}
        times = {k: [] for k in keys}
        per_round = {k: [] for k in keys}
        allocs = dict.fromkeys(keys, 0)
        retimed = dict.fromkeys(keys, 0)
        for r in range(rounds):
            live = [k for k in keys if k not in failed]
            shift = r % len(live) if live else 0
            for k in live[shift:] + live[:shift]:
                if before_each is not None:
                    before_each(k)
                fn, grad_to_none = fns[k]
                before = self.allocator_calls()
                try:
                    if k not in est:
                        est[k] = self._estimate_ms(fn, grad_to_none)
                    rep = max(self.rep_ms, self.min_reps * est[k]) / rounds
                    warm = max(1, int(self.warmup_ms / est[k]))
                    retimed_at = self.retimed
                    block = self._timed(fn, grad_to_none, warm, max(2, math.ceil(rep / est[k])))
                    retimed[k] += self.retimed - retimed_at
                except Exception as exc:  # noqa: BLE001 - recorded for this key; the others go on
                    failed[k] = exc
                    continue
                if windows is not None:
                    end = time.time()  # _timed synchronized: its repetitions ended just now
                    lead = min(0.3, self.warmup_ms / 1e3 / 3)
                    windows.setdefault(k, []).append((end - sum(block) / 1e3 - lead, end))
                allocs[k] += self.allocator_calls() - before
                times[k] += block
                per_round[k].append(statistics.median(block))
            if progress is not None:
                progress(r + 1, rounds)
        res = {}
        for k in keys:
            if k in failed:
                res[k] = {"error": failed[k]}
                continue
            res[k] = dict(summary(times[k]), rounds=rounds, round_ms=[round(t, 4) for t in per_round[k]],
                          retimed=retimed[k])
            if self.cuda:
                res[k]["allocator_calls"] = allocs[k]
        return res


class SavedStorages:
    """A context in which torch.autograd.graph.saved_tensors_hooks counts what is saved for
    backward: the distinct storages (by their untyped storage's data_ptr), so a tensor saved twice,
    or two views of one storage, count once and two copies of one tensor count twice; the storages
    of `exclude` (parameters) are left out. bytes: their total; storages: how many."""

    def __init__(self, exclude=()):
        self.exclude = {t.untyped_storage().data_ptr() for t in exclude}
        self.saved = {}
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, t):
        s = t.untyped_storage()
        if s.data_ptr() not in self.exclude:
            self.saved[s.data_ptr()] = s.nbytes()
        return t

    def __enter__(self):
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        return self._hooks.__exit__(*exc)

    @property
    def bytes(self):
        return sum(self.saved.values())

    @property
    def storages(self):
        return len(self.saved)


def step_memory(device, step, exclude=(), count_saved=True):
    """One call of step() measured alone: {before_bytes: allocated before it, peak_bytes: the most
    allocated during it minus before_bytes (both None off the GPU), saved_bytes / saved_storages:
    SavedStorages(exclude) over it (None where not count_saved: compiled code, where hooks at call
    time make Dynamo recompile, so what ran would not be what is timed)}."""
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
    gc.collect()
    before = None
    if cuda:
        torch.cuda.empty_cache()
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
    counter = SavedStorages(exclude) if count_saved else None
    with counter if counter is not None else contextlib.nullcontext():
        step()
    out = {"before_bytes": before, "peak_bytes": None, "saved_bytes": None, "saved_storages": None}
    if counter is not None:
        out.update(saved_bytes=counter.bytes, saved_storages=counter.storages)
    if cuda:
        torch.cuda.synchronize(device)
        out["peak_bytes"] = torch.cuda.max_memory_allocated(device) - before
    return out
