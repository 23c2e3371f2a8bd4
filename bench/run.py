#!/usr/bin/env python
"""fused_dense benchmark suite: one command, one run, everything side by side.

    python bench/run.py --out DIR [--quick] [--shapes 8192x1024 16384x8192 ...] [--budget S]
    python bench/run.py --out DIR --device cpu --quick        # smoke test without a GPU

Writes DIR/bench.json (raw figures + environment), DIR/bench.md (tables, issue-5 targets) and
DIR/bench.png (TF/s per shape per variant; skipped with a warning if matplotlib is missing, make
it later with `python bench/plot.py DIR/bench.json`). bench/README.md describes the method.

Sections, in the order they run (the most important first, so a time budget cut loses the least):
  env       GPU, driver, torch, CUDA, cuBLASLt versions
  ceiling   8192^3 bf16 torch.mm (the card's sustained matmul rate)
  mlp       MLP forward + backward, Linear(d, 4d) -> act -> Linear(4d, d), bf16 gelu_approx, all
            variants (FusedMLP auto at checkpoint_lvl 0/1/2, fixed heuristics -1/0/1/2, eager,
            torch.compile, the six-GEMM floor), activation memory and accuracy per variant
  ops       linear_act / act_linear_dgrad / linear_bias_wgrad against torch.mm at the MLP's GEMMs
  host      host CPU time per forward + backward at M=512, d=512: FusedMLP against eager
  reduced   fp16 gelu_approx, bf16 relu, fp16 relu at M=8192: FusedMLP auto, eager, compile, floor
  sustained the bf16 gelu_approx shapes again (floor, eager, compile, FusedMLP auto), each block after
            --sustained-warmup-ms (1000) of its own steps: the power-capped steady state; SM clock and
            power from nvidia-smi where it exists
"""
import argparse
import ctypes
import datetime
import faulthandler
import gc
import glob
import importlib.util
import json
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import zlib

import torch
import torch.nn as nn
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

T0 = time.time()  # replaced by --t0-epoch in a worker, so the budget and the log clock span restarts
MIB = 1024 * 1024
EXIT_CUDA_BROKEN = 3  # worker exit code: the CUDA context is unusable after an error; restart


def log(msg):
    print(f"[{time.time() - T0:7.1f}s] {msg}", flush=True)


def _load_sibling(name):
    spec = importlib.util.spec_from_file_location(f"_fd_bench_{name}", os.path.join(HERE, f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


report = _load_sibling("report")
plot = _load_sibling("plot")

# ----------------------------------------------------------------------------------------------
# fused_dense imports (guarded: the bench still measures the baselines without them)

FD_IMPORT_ERROR = None
fd_ops = None
FusedMLP = None
try:
    import fused_dense
    from fused_dense import ops as fd_ops
except Exception as exc:  # noqa: BLE001
    FD_IMPORT_ERROR = f"import fused_dense failed: {type(exc).__name__}: {exc}"
if fd_ops is not None:
    try:
        FusedMLP = getattr(fused_dense, "FusedMLP", None)
        if FusedMLP is None:
            from fused_dense.modules import FusedMLP  # noqa: F811
    except Exception as exc:  # noqa: BLE001
        FD_IMPORT_ERROR = f"FusedMLP not available: {type(exc).__name__}: {exc}"

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}

# Variant sets. Keys are stable (bench.json / plot / report use them).
# (Session 8's 'auto_l0_again', 'auto' level 0 timed once more after every other variant, showed the
# order disturbed the first figure; the variants are now timed in interleaved rounds instead, and
# fused_spec still reads that key in older bench.json files.)
FULL_VARIANTS = ["floor", "eager", "compile", "auto_l0", "auto_l1", "auto_l2", "h-1_l0", "h0_l0", "h1_l0", "h2_l0"]
REDUCED_VARIANTS = ["floor", "eager", "compile", "auto_l0"]


def fused_spec(key):
    """'auto_l1' -> ('auto', 1); 'h-1_l0' -> (-1, 0); 'auto_l0_again' -> ('auto', 0)."""
    h, lvl = key.removesuffix("_again").split("_l")
    return ("auto" if h == "auto" else int(h[1:])), int(lvl)


def _f0(x):
    return "?" if x is None else f"{x:.0f}"


def errstr(exc, limit=400):
    s = f"{type(exc).__name__}: {exc}".strip().replace("\n", " ")
    return s if len(s) <= limit else s[:limit] + "..."


# ----------------------------------------------------------------------------------------------
# timing


class Bench:
    """Median time of fn() in ms after warm-up; cold L2 for every repetition on CUDA."""

    def __init__(self, device, warmup_ms=50.0, rep_ms=200.0, min_reps=8, cpu_reps=5, timer="auto"):
        self.device = device
        self.cuda = device.type == "cuda"
        self.warmup_ms = warmup_ms
        self.rep_ms = rep_ms
        self.min_reps = min_reps
        self.cpu_reps = cpu_reps
        self.do_bench = None
        self.method = "cpu perf_counter median"
        if self.cuda and timer == "events":
            self.method = "CUDA events median (cold L2 each rep), --timer events"
            self._flush = None
        elif self.cuda:
            try:
                from triton.testing import do_bench
                self.do_bench = do_bench
                self.method = "triton.testing.do_bench median (cold L2 each rep)"
            except Exception as exc:  # noqa: BLE001
                self.method = f"CUDA events median (cold L2 each rep); triton unavailable: {errstr(exc, 120)}"
            self._flush = None

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def _estimate_ms(self, fn, grad_to_none):
        """One more call (warm), then the mean of 2 calls, synchronized."""
        def call():
            if grad_to_none:
                for t in grad_to_none:
                    t.grad = None
            fn()
        call()
        self.sync()
        t = time.perf_counter()
        for _ in range(2):
            call()
        self.sync()
        return max((time.perf_counter() - t) * 1e3 / 2, 1e-3)

    def __call__(self, fn, grad_to_none=None):
        est = self._estimate_ms(fn, grad_to_none)
        if not self.cuda:
            times = []
            for _ in range(self.cpu_reps):
                if grad_to_none:
                    for t in grad_to_none:
                        t.grad = None
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e3)
            return self._summary(times, len(times))
        allocs_before = self._allocator_calls()
        res = self._cuda_once(fn, grad_to_none, est)
        spread = self.spread(res)
        if spread is not None and spread > self.RETRY_SPREAD:
            # Something disturbed the repetitions (a clock or power transient, often right after a
            # variant's first-call tuning): measure once more and keep the steadier of the two.
            again = self._cuda_once(fn, grad_to_none, est)
            kept, dropped = (again, res) if (self.spread(again) or 0.0) < spread else (res, again)
            kept["remeasured"] = {"dropped": {k: dropped.get(k) for k in ("ms", "p20", "p80")},
                                  "reason": f"p80 / p20 = {spread:.3f} > {self.RETRY_SPREAD}"}
            res = kept
        # cudaMalloc / cudaFree inside the timed loop stall the host and the GPU waits for it: a
        # figure with such calls measures the caching allocator, not the kernels, so it says so
        res["allocator_calls"] = self._allocator_calls() - allocs_before
        return res

    def _allocator_calls(self):
        """cudaMalloc + cudaFree calls of PyTorch's caching allocator on this device so far."""
        stats = torch.cuda.memory_stats(self.device)
        return stats.get("num_device_alloc", 0) + stats.get("num_device_free", 0)

    # A median whose 20th and 80th percentiles are further apart than this is measured again.
    RETRY_SPREAD = 1.05

    @staticmethod
    def spread(res):
        p20, p80 = res.get("p20"), res.get("p80")
        return p80 / p20 if p20 and p80 else None

    def _cuda_once(self, fn, grad_to_none, est):
        rep = max(self.rep_ms, self.min_reps * est)
        warm = max(self.warmup_ms, 2 * est)
        n = max(1, int(rep / est))
        if self.do_bench is not None:
            q = self.do_bench(fn, warmup=warm, rep=rep, grad_to_none=grad_to_none, quantiles=[0.5, 0.2, 0.8])
            if isinstance(q, (list, tuple)):
                return {"ms": float(q[0]), "p20": float(q[1]), "p80": float(q[2]), "reps": n}
            return {"ms": float(q), "p20": None, "p80": None, "reps": n}
        return self._events(fn, grad_to_none, warm, n, est)

    def _events(self, fn, grad_to_none, warm_ms, n, est):
        return self._summary(self._timed(fn, grad_to_none, max(1, int(warm_ms / est)), n), n)

    def _timed(self, fn, grad_to_none, warm, n):
        """warm untimed calls, then the times (ms) of n calls: CUDA events around each, the L2
        cache flushed before each; on the CPU perf_counter around each."""
        def reset():
            if grad_to_none:
                for t in grad_to_none:
                    t.grad = None
        for _ in range(warm):
            reset()
            fn()
        if not self.cuda:
            times = []
            for _ in range(n):
                reset()
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e3)
            reset()
            return times
        if self._flush is None:
            self._flush = torch.empty(256 * MIB, dtype=torch.int8, device=self.device)
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
        for i in range(n):
            reset()
            self._flush.zero_()
            starts[i].record()
            fn()
            ends[i].record()
        self.sync()
        reset()  # between blocks a variant holds no gradients (interleaved: all variants stay alive)
        return [s.elapsed_time(e) for s, e in zip(starts, ends)]

    def interleaved(self, fns, rounds, before_each=None, windows=None):
        """Times every function of fns ({key: (fn, grad_to_none)}) in `rounds` rounds. Each round
        gives each function a full warm-up and its share of the repetitions, in an order rotated by
        one place per round, so a slow drift of clocks or temperature, or a transient left by one
        variant's first-call tuning, falls on all of them alike instead of on whichever was being
        timed then (session 9: 'auto' at 8192 x 4096 timed right after its tuning measured 3% slower
        than the same module timed again after every other variant).

        Returns {key: summary}: median, p20 and p80 over all its repetitions, the median of each
        round (round_ms), allocator_calls on CUDA; or {"error": exception} for a function that
        raised, which then leaves the later rounds. before_each(key) runs before each block.

        windows: a dict that receives, per key, the wall-clock span (time.time() seconds) of each
        block's timed repetitions and the end of its warm-up, to match against samples taken beside
        the run (nvidia-smi's)."""
        keys = list(fns)
        est = {}
        times = {k: [] for k in keys}
        per_round = {k: [] for k in keys}
        allocs = dict.fromkeys(keys, 0)
        failed = {}
        for r in range(rounds):
            live = [k for k in keys if k not in failed]
            shift = r % len(live) if live else 0
            for k in live[shift:] + live[:shift]:
                if before_each is not None:
                    before_each(k)
                fn, grad_to_none = fns[k]
                before = self._allocator_calls() if self.cuda else 0
                try:
                    if k not in est:
                        est[k] = self._estimate_ms(fn, grad_to_none)
                    rep = max(self.rep_ms, self.min_reps * est[k]) / rounds
                    # the whole warm-up before every block, not a share of it: a block starts after
                    # the host's gap (the previous block's synchronize, the crash marker's write),
                    # and must be timed once clocks and power have settled under load again. With
                    # a fifth of it per block (s9r2), the six-GEMM floor measured 713 TF/s against
                    # the 8192^3 mm ceiling's 665 and figures spread 3-9% (p20-p80) against 1%
                    warm = max(1, int(self.warmup_ms / est[k]))
                    block = self._timed(fn, grad_to_none, warm, max(2, math.ceil(rep / est[k])))
                except Exception as exc:  # noqa: BLE001 - recorded for this variant; the others go on
                    failed[k] = exc
                    continue
                if windows is not None:
                    # _timed synchronizes at its end, so its repetitions ended just now and began
                    # their summed time earlier (the L2 flushes between them left out). The span
                    # also takes in the last third of the warm-up, at most 300 ms, the same
                    # variant's steps in the same state: nvidia-smi updates about every 100 ms, so
                    # a 40 ms timed block alone mostly catches no sample (s12: 'auto' got none)
                    end = time.time()
                    lead = min(0.3, self.warmup_ms / 1e3 / 3)
                    windows.setdefault(k, []).append((end - sum(block) / 1e3 - lead, end))
                if self.cuda:
                    allocs[k] += self._allocator_calls() - before
                times[k] += block
                per_round[k].append(statistics.median(block))
        res = {}
        for k in keys:
            if k in failed:
                res[k] = {"error": failed[k]}
                continue
            res[k] = self._summary(times[k], len(times[k]))
            res[k].update(rounds=rounds, round_ms=[round(t, 4) for t in per_round[k]])
            if self.cuda:
                res[k]["allocator_calls"] = allocs[k]
        return res

    @staticmethod
    def _summary(times, n):
        times = sorted(times)

        def q(p):
            return times[min(len(times) - 1, int(round(p * (len(times) - 1))))]
        return {"ms": statistics.median(times), "p20": q(0.2), "p80": q(0.8), "reps": n}


# ----------------------------------------------------------------------------------------------
# environment


def _run(cmd):
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=20).stdout.strip()
    except Exception:  # noqa: BLE001
        return None


def source_tree_id():
    """git's tree id of the checkout's files as they are (tracked and untracked-not-ignored, through
    a throw-away index), whatever HEAD says: a copy whose .git lags its files (the GPU machine's)
    still names the tree that ran, equal to `git rev-parse <commit>^{tree}` of the commit it was."""
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ, GIT_INDEX_FILE=os.path.join(tmp, "index"))
        try:
            subprocess.run(["git", "-C", ROOT, "add", "-A"], env=env, capture_output=True, timeout=60, check=True)
            tree = subprocess.run(["git", "-C", ROOT, "write-tree"], env=env, capture_output=True, text=True,
                                  timeout=20, check=True).stdout.strip()
        except Exception:  # noqa: BLE001  (no git, no .git: the commit field says what is known)
            return None
    return tree if len(tree) == 40 else None


def cublaslt_version():
    """cublasLtGetVersion() of the libcublasLt this process uses (read from /proc/self/maps)."""
    paths = []
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                p = line.split()[-1] if line.strip() else ""
                if "libcublasLt" in p and p not in paths:
                    paths.append(p)
    except OSError:
        pass
    loaded = bool(paths)
    if not paths:
        tl = os.path.join(os.path.dirname(torch.__file__), "lib")
        paths += glob.glob(os.path.join(tl, "libcublasLt.so*"))
        for sp in sys.path:
            paths += glob.glob(os.path.join(sp, "nvidia", "cu*", "lib", "libcublasLt.so*"))
            paths += glob.glob(os.path.join(sp, "nvidia", "cublas", "lib", "libcublasLt.so*"))
        paths += ["libcublasLt.so"]
    for p in paths:
        try:
            lib = ctypes.CDLL(p)
            lib.cublasLtGetVersion.restype = ctypes.c_size_t
            v = int(lib.cublasLtGetVersion())
            return {"cublasLt_version": v,
                    "cublasLt_version_str": f"{v // 10000}.{(v % 10000) // 100}.{v % 100}",
                    "cublasLt_path": p, "cublasLt_loaded_by_process": loaded}
        except Exception:  # noqa: BLE001
            continue
    return {"cublasLt_version": None, "cublasLt_version_str": None}


def environment(args, device):
    env = {
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "argv": sys.argv,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "device": str(device),
        "fused_dense_import_error": FD_IMPORT_ERROR,
    }
    try:
        import triton
        env["triton"] = triton.__version__
    except Exception:  # noqa: BLE001
        env["triton"] = None
    try:
        env["fused_dense"] = getattr(fused_dense, "__version__", None)
        env["fused_dense_cuda_kernels"] = bool(fused_dense.has_cuda_kernels())
    except Exception:  # noqa: BLE001
        pass
    commit = args.commit or _run(["git", "-C", ROOT, "rev-parse", "HEAD"]) or ""
    commit = commit.strip().lower()
    env["git_commit"] = commit if 7 <= len(commit) <= 40 and all(c in "0123456789abcdef" for c in commit) else None
    st = _run(["git", "-C", ROOT, "status", "--porcelain", "--untracked-files=no"]) if env["git_commit"] else None
    env["git_dirty"] = None if st is None else bool(st)
    if args.commit:
        env["git_commit_from"] = "--commit"
    env["git_tree"] = source_tree_id()
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        env.update({
            "gpu": p.name, "capability": f"{p.major}.{p.minor}", "sm_count": p.multi_processor_count,
            "gpu_memory_gib": round(p.total_memory / 1024 ** 3, 1),
            "cudnn": torch.backends.cudnn.version(),
        })
        try:
            env["cuda_driver_api"] = int(torch._C._cuda_getDriverVersion())
        except Exception:  # noqa: BLE001
            pass
        q = _run(["nvidia-smi", "--query-gpu=driver_version,clocks.sm,clocks.max.sm,clocks.mem,power.limit,"
                  "temperature.gpu,pstate", "--format=csv,noheader", f"--id={device.index or 0}"])
        if q:
            keys = ["driver", "clock_sm_mhz", "clock_max_sm_mhz", "clock_mem_mhz", "power_limit", "temp_c", "pstate"]
            env.update({k: v.strip() for k, v in zip(keys, q.split(","))})
    else:
        env["cpu_threads"] = torch.get_num_threads()
    env.update(cublaslt_version())
    return env


# ----------------------------------------------------------------------------------------------
# clocks under load: nvidia-smi sampled beside the sustained section's timing

SMI_INTERVAL_MS = 100
SMI_FIELDS = ("timestamp", "clocks.sm", "power.draw")
# why the clock is below its maximum (bit 0x4: the software power cap); newer drivers call the field
# clocks_event_reasons, and the first name that this nvidia-smi accepts is used
SMI_REASON_FIELDS = ("clocks_throttle_reasons.active", "clocks_event_reasons.active")
SMI_TIMESTAMP_FORMAT = "%Y/%m/%d %H:%M:%S.%f"
_smi_fields_found = {}


def _smi_number(cell):
    """'1410' or '1410 MHz' -> 1410.0; '[N/A]', '[Not Supported]', '' -> None."""
    try:
        return float(cell.split()[0])
    except (IndexError, ValueError):
        return None


def parse_smi_samples(lines):
    """nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw[,<reasons>] --format=csv,noheader
    lines -> [{"t": epoch seconds, "sm_mhz", "power_w", "reasons"}], lines that do not parse left out.

    The timestamp ("2026/11/30 08:50:48.122") is the machine's local time without a zone, read here as
    local time too: nvidia-smi inherits this process's TZ, so it lands on time.time()'s clock."""
    samples = []
    for line in lines:
        cells = [c.strip() for c in line.split(",")]
        if len(cells) < 3:
            continue
        try:
            t = datetime.datetime.strptime(cells[0], SMI_TIMESTAMP_FORMAT).timestamp()
        except ValueError:
            continue
        reasons = cells[3] if len(cells) > 3 and cells[3].lower().startswith("0x") else None
        samples.append({"t": t, "sm_mhz": _smi_number(cells[1]), "power_w": _smi_number(cells[2]),
                        "reasons": reasons})
    return samples


def clocks_in_windows(samples, windows):
    """Per key of windows ({key: [(start, end) epoch seconds]}): the median SM clock and power of the
    samples taken inside one of its spans, their count, and the clock-limit reasons seen there. A key
    with no sample inside its spans is left out, as is a sample that falls in no span (the start of
    each warm-up, the host's gaps between blocks)."""
    res = {}
    for key, spans in windows.items():
        inside = [smp for smp in samples if any(a <= smp["t"] <= b for a, b in spans)]
        if not inside:
            continue
        c = {"samples": len(inside)}
        for field, name in (("sm_mhz", "sm_mhz"), ("power_w", "power_w")):
            vals = [smp[field] for smp in inside if smp[field] is not None]
            if vals:
                c[name] = statistics.median(vals)
        reasons = sorted({smp["reasons"] for smp in inside if smp["reasons"]})
        if reasons:
            c["clock_limit_reasons"] = reasons
        res[key] = c
    return res


def _smi_query(exe, fields, gpu_index):
    return [exe, "--query-gpu=" + ",".join(fields), "--format=csv,noheader,nounits", f"--id={gpu_index}"]


def smi_fields(exe, gpu_index):
    """The query fields this nvidia-smi answers for this GPU, each reasons field name tried in turn
    with one sample, then none; None when even the clock and power query fails."""
    if (exe, gpu_index) not in _smi_fields_found:
        found = None
        for reasons in SMI_REASON_FIELDS + (None,):
            fields = SMI_FIELDS + ((reasons,) if reasons else ())
            try:
                got = subprocess.run(_smi_query(exe, fields, gpu_index), capture_output=True, text=True,
                                     timeout=20)
            except (OSError, subprocess.SubprocessError):
                break
            if got.returncode == 0 and parse_smi_samples(got.stdout.splitlines()):
                found = fields
                break
        _smi_fields_found[(exe, gpu_index)] = found
    return _smi_fields_found[(exe, gpu_index)]


class ClockSampler:
    """nvidia-smi writing the GPU's timestamp, SM clock, power and clock-limit reasons every
    interval_ms, in a background process between start() and stop(); stop() returns the parsed
    samples. Where there is no nvidia-smi (CPU runs, CI) or it cannot query the GPU, start() starts
    nothing, `note` says why and stop() returns []: the run goes on without clock figures."""

    def __init__(self, gpu_index=0, interval_ms=SMI_INTERVAL_MS, exe="nvidia-smi", max_s=3600):
        self.gpu_index = gpu_index
        self.interval_ms = interval_ms
        self.exe = exe
        self.max_s = max_s
        self.fields = None
        self.note = None
        self.samples = []
        self._proc = None
        self._out = None

    @property
    def running(self):
        return self._proc is not None

    def start(self):
        path = shutil.which(self.exe)
        if path is None:
            self.note = f"no {self.exe} on PATH"
            return self
        self.fields = smi_fields(path, self.gpu_index)
        if self.fields is None:
            self.note = f"{path} did not answer --query-gpu={','.join(SMI_FIELDS)} for GPU {self.gpu_index}"
            return self
        cmd = _smi_query(path, self.fields, self.gpu_index) + ["-lms", str(int(self.interval_ms))]
        # a worker killed by a kernel under test never reaches stop(): `timeout` ends the sampler then
        bound = shutil.which("timeout")
        if bound:
            cmd = [bound, str(int(self.max_s))] + cmd
        self._out = tempfile.TemporaryFile(mode="w+")
        try:
            self._proc = subprocess.Popen(cmd, stdout=self._out, stderr=subprocess.DEVNULL,
                                          stdin=subprocess.DEVNULL)
        except OSError as exc:
            self.note = f"{path} did not start: {errstr(exc, 160)}"
            self._out.close()
            self._out = None
        return self

    def stop(self):
        """Ends the sampling process (its own id only) and parses what it wrote; safe to call twice."""
        proc, self._proc = self._proc, None
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)
        if self._out is not None:
            self._out.seek(0)
            self.samples = parse_smi_samples(self._out.read().splitlines())
            self._out.close()
            self._out = None
        return self.samples


# ----------------------------------------------------------------------------------------------
# models


class EagerMLP(nn.Module):
    """The PyTorch reference: nn.Linear -> F.gelu(tanh) or F.relu -> nn.Linear (names as FusedMLP)."""

    def __init__(self, d, h, activation, device, dtype):
        super().__init__()
        self.fc1 = nn.Linear(d, h, device=device, dtype=dtype)
        self.fc2 = nn.Linear(h, d, device=device, dtype=dtype)
        self.activation = activation

    def forward(self, x):
        y = self.fc1(x)
        y = F.gelu(y, approximate="tanh") if self.activation == "gelu_approx" else F.relu(y)
        return self.fc2(y)


def copy_weights(dst, src):
    try:
        dst.load_state_dict(src.state_dict())
        return
    except Exception:  # noqa: BLE001
        pass
    dp = [p for p in dst.parameters()]
    sp = [p for p in src.parameters()]
    if len(dp) != len(sp) or any(a.shape != b.shape for a, b in zip(dp, sp)):
        raise RuntimeError("cannot copy eager weights into FusedMLP: parameter shapes differ")
    with torch.no_grad():
        for a, b in zip(dp, sp):
            a.copy_(b)


def first(out):
    return out[0] if isinstance(out, (tuple, list)) else out


def rel_err(a, ref):
    a = a.float()
    ref = ref.float()
    return float((a - ref).norm() / ref.norm().clamp_min(1e-30))


# ----------------------------------------------------------------------------------------------
# context: results, resume after a crash, time budget

FINAL = ("ok", "unavailable", "error", "skipped", "crashed")
BASELINE_KEYS = ("floor", "eager", "compile")


class Ctx:
    def __init__(self, args, device, results=None):
        self.args = args
        self.device = device
        self.cuda = device.type == "cuda"
        self.bench = Bench(device, warmup_ms=args.warmup_ms, rep_ms=args.rep_ms, timer=args.timer)
        # the sustained section's timing: the same rounds, each block after a warm-up long enough for
        # the card to reach its power-capped clock (Bench.interleaved warms up before every block)
        self.sustained_bench = Bench(device, warmup_ms=args.sustained_warmup_ms, rep_ms=args.rep_ms,
                                     timer=args.timer)
        self.deadline = T0 + args.budget
        self.results = results or {"schema": 1, "env": {}, "method": {}, "ceiling": None, "mlp": [], "ops": [],
                                   "host": None, "sustained": [], "done": [], "skipped": [], "crashed": [],
                                   "in_progress": None}
        self.crashed = {(c["item"], c["variant"]): c for c in self.results.get("crashed", [])}

    def time_left(self):
        return self.deadline - time.time()

    def seed(self, item_id):
        """Deterministic data per item, so an item resumed after a restart sees the same tensors."""
        torch.manual_seed(zlib.crc32(item_id.encode()) & 0x7FFFFFFF)

    def randn(self, *shape, dtype, scale=1.0):
        return (torch.randn(*shape, device=self.device, dtype=torch.float32) * scale).to(dtype)

    def sync(self):
        self.bench.sync()

    def free(self):
        gc.collect()
        if self.cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()

    def find(self, section, item_id):
        for r in self.results[section]:
            if r.get("id") == item_id:
                return r
        return None

    def fused_crashes(self):
        return sum(1 for c in self.results.get("crashed", []) if c.get("fused"))

    def precheck(self, item_id, variant, fused):
        """A final record to store instead of measuring, or None to measure.

        fused: None for a baseline, else the fused_dense code path it exercises ('FusedMLP heuristic=auto',
        'linear_act h=0', ...): after a crash in one path, that path is skipped for the rest of the run,
        and after --max-fused-crashes crashes all fused_dense measurements are. Also skipped: the
        torch.compile variant under --no-compile; unavailable: FusedMLP paths when it did not import.
        """
        c = self.crashed.get((item_id, variant))
        if c:
            return {"status": "crashed", "error": f"the process died (exit {c.get('rc')}) during this "
                                                  "measurement; the bench restarted and went on without it"}
        same = [c for c in self.results.get("crashed", []) if fused and c.get("fused") == fused]
        if same:
            return {"status": "skipped", "error": f"not run: '{fused}' crashed the process earlier in this run "
                                                  f"(at {same[0]['item']} / {same[0]['variant']})"}
        n = self.fused_crashes()
        if fused and n >= self.args.max_fused_crashes:
            return {"status": "skipped", "error": f"not run: fused_dense crashed the process {n} times earlier "
                                                  "in this run (see 'crashed')"}
        if self.time_left() < 0:
            return {"status": "skipped", "error": "time budget exhausted"}
        if variant == "compile" and self.args.no_compile:
            return {"status": "skipped", "error": "--no-compile"}
        if fused and fused.startswith("FusedMLP") and FusedMLP is None:
            return {"status": "unavailable", "error": FD_IMPORT_ERROR or "FusedMLP not found"}
        return None

    def begin(self, item_id, variant, fused):
        """Mark what is being measured, on disk, so the supervisor can tell what crashed the process."""
        self.results["in_progress"] = {"item": item_id, "variant": variant, "fused": fused}
        self.save(markdown=False)
        hook = os.environ.get("FD_BENCH_TEST_CRASH")  # test hook: "ITEM_SUBSTRING:VARIANT" segfaults there
        if hook and (item_id, variant) not in self.crashed:
            it, _, var = hook.rpartition(":")
            if it in item_id and var == variant:
                log(f"FD_BENCH_TEST_CRASH: crashing on purpose at {item_id} {variant}")
                ctypes.string_at(0)

    def end(self):
        self.results["in_progress"] = None

    def check_cuda(self, exc):
        """After an exception: when the CUDA context is unusable, save and exit so the supervisor restarts."""
        if not self.cuda:
            return
        try:
            torch.cuda.synchronize(self.device)
            torch.ones(1, device=self.device).add_(1).item()
        except Exception as exc2:  # noqa: BLE001
            log(f"CUDA context unusable after '{errstr(exc, 160)}' ({errstr(exc2, 160)}); exiting for a restart")
            self.results["in_progress"] = None
            self.save(markdown=False)
            sys.stdout.flush()
            os._exit(EXIT_CUDA_BROKEN)

    def save(self, markdown=True):
        save_results(self.results, self.args.out, markdown)


def save_results(results, out, markdown=True):
    os.makedirs(out, exist_ok=True)
    results["elapsed_s"] = round(time.time() - T0, 1)
    tmp = os.path.join(out, "bench.json.tmp")
    with open(tmp, "w") as f:
        json.dump(results, f, indent=1)
    os.replace(tmp, os.path.join(out, "bench.json"))
    if markdown:
        try:
            with open(os.path.join(out, "bench.md"), "w") as f:
                f.write(report.markdown(results))
        except Exception as exc:  # noqa: BLE001
            log(f"WARNING: bench.md not written: {errstr(exc)}")
            traceback.print_exc()


def finalize(results, out):
    """bench.md, bench.png and the console summary from whatever results there are."""
    save_results(results, out)
    png = os.path.join(out, "bench.png")
    try:
        plot.make_png(results, png)
        log(f"wrote {png}")
    except ImportError as exc:
        log(f"WARNING: no PNG ({exc}); make it with: python bench/plot.py {os.path.join(out, 'bench.json')}")
    except Exception as exc:  # noqa: BLE001
        log(f"WARNING: PNG failed: {errstr(exc)}")
    print(report.summary(results), flush=True)
    log(f"done: {os.path.join(out, 'bench.json')}, bench.md")


# ----------------------------------------------------------------------------------------------
# sections


def run_ceiling(ctx, item_id, key="ceiling"):
    """8192^3 torch.mm; run first and again last ('ceiling_end') to show drift in clocks over the run."""
    n = ctx.args.ceiling_n
    dtype = torch.bfloat16 if ctx.cuda else torch.float32
    pre = ctx.precheck(item_id, "mm", None)
    if pre:
        ctx.results[key] = pre
        return
    ctx.seed(item_id)
    a = ctx.randn(n, n, dtype=dtype)
    b = ctx.randn(n, n, dtype=dtype)
    ctx.begin(item_id, "mm", None)
    t = ctx.bench(lambda: torch.mm(a, b))
    ctx.end()
    tf = 2 * n ** 3 / t["ms"] / 1e9
    ctx.results[key] = {"status": "ok", "n": n, "dtype": str(dtype).replace("torch.", ""), **t, "tflops": tf}
    log(f"{key} {n}^3 {dtype}: {t['ms']:.3f} ms, {tf:.0f} TF/s")
    a = b = None  # noqa: F841
    ctx.free()


def measure_pass(ctx, mod, x, dy, params, use_hooks=True):
    """One forward + backward: memory kept for backward, and the outputs for the accuracy check.

    saved_bytes: unique non-parameter storages packed by saved_tensors_hooks during the forward.
    Not used for torch.compile (hooks active at call time make Dynamo recompile, and what runs then
    is not the graph that was timed): there only the allocator figures are taken.
    """
    for t in params + [x]:
        t.grad = None
    ctx.free()
    param_ptrs = set()
    for p in params:
        try:
            param_ptrs.add(p.untyped_storage().data_ptr())
        except Exception:  # noqa: BLE001
            pass
    saved = {}
    counts = {"n": 0}

    def pack(t):
        counts["n"] += 1
        try:
            s = t.untyped_storage()
            ptr = s.data_ptr()
            if ptr not in param_ptrs and ptr not in saved:
                saved[ptr] = s.nbytes()
        except Exception:  # noqa: BLE001
            pass
        return t

    def unpack(t):
        return t

    base = torch.cuda.memory_allocated(ctx.device) if ctx.cuda else 0
    if ctx.cuda:
        torch.cuda.reset_peak_memory_stats(ctx.device)
    if use_hooks:
        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            out = first(mod(x))
    else:
        out = first(mod(x))
    if ctx.cuda:
        ctx.sync()
        after_fwd = torch.cuda.memory_allocated(ctx.device) - base
    out_bytes = out.numel() * out.element_size()
    out.backward(dy)
    ctx.sync()
    res = {}
    if use_hooks:
        res.update(saved_bytes=sum(saved.values()), saved_storages=len(saved), saved_calls=counts["n"])
    if ctx.cuda:
        res["alloc_kept_bytes"] = after_fwd - out_bytes  # allocated after forward, output excluded
        res["peak_delta_bytes"] = torch.cuda.max_memory_allocated(ctx.device) - base
    grads = {"out": out.detach(), "dx": x.grad.detach() if x.grad is not None else None}
    for name, p in zip(["w1", "b1", "w2", "b2"], params):
        grads["d" + name] = p.grad.detach() if p.grad is not None else None
    return res, grads


def reference(ctx, eager, x, dy):
    """float32 reference (no tf32) of out, dx, dW1, dW2."""
    ref = EagerMLP(eager.fc1.in_features, eager.fc1.out_features, eager.activation, ctx.device, torch.float32)
    ref.load_state_dict({k: v.float() for k, v in eager.state_dict().items()})
    xr = x.detach().float().requires_grad_(True)
    prev = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        out = ref(xr)
        out.backward(dy.float())
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev
    r = {"out": out.detach(), "dx": xr.grad, "dw1": ref.fc1.weight.grad, "dw2": ref.fc2.weight.grad}
    del ref, xr, out
    return r


def ratios(variants):
    def ms(k):
        v = variants.get(k) or {}
        return v.get("ms") if v.get("status") == "ok" else None
    for v in variants.values():
        if v.get("status") != "ok":
            continue
        for name, base, inv in (("x_floor", "floor", False), ("speedup_vs_eager", "eager", True),
                                ("speedup_vs_compile", "compile", True)):
            b = ms(base)
            if b:
                v[name] = (b / v["ms"]) if inv else (v["ms"] / b)


def run_mlp(ctx, item_id, dtype_name, act, M, d, variants, section="mlp"):
    """One MLP shape's variants: their first calls, memory and accuracy, then their timing in
    interleaved rounds, into results[section]. section 'sustained' times with ctx.sustained_bench
    (each block after --sustained-warmup-ms of its own steps), samples the SM clock and power beside
    it where nvidia-smi exists, and leaves out the float32 reference and the memory pass, which the
    'mlp' section takes for the same shapes."""
    sustained = section == "sustained"
    bench = ctx.sustained_bench if sustained else ctx.bench
    dtype = DTYPES[dtype_name]
    h = 4 * d
    flops = 12 * M * d * h
    records = ctx.results.setdefault(section, [])  # a bench.json from before the section lacks the list
    rec = ctx.find(section, item_id)
    if rec is None:
        rec = {"id": item_id, "dtype": dtype_name, "activation": act, "M": M, "d": d, "h": h, "flops": flops,
               "variants": {}}
        records.append(rec)
    tag = f"{section} {dtype_name} {act} M={M} d={d}"
    todo = [k for k in variants if rec["variants"].get(k, {}).get("status") not in FINAL]
    log(f"{tag}: start ({len(todo)} of {len(variants)} variants to run)")
    ctx.seed(item_id)
    dev = ctx.device
    eager = EagerMLP(d, h, act, dev, dtype)
    x = ctx.randn(M, d, dtype=dtype).requires_grad_(True)
    dy = ctx.randn(M, d, dtype=dtype)
    ref = None
    if not ctx.args.no_accuracy and not sustained and any(k != "floor" for k in todo):
        try:
            ref = reference(ctx, eager, x, dy)
            x.grad = None
        except Exception as exc:  # noqa: BLE001
            log(f"{tag}: reference failed: {errstr(exc)}")

    # 1. every variant's first call (compilation, plan creation, 'auto' tuning), its memory and
    # accuracy pass; the modules stay alive for the timing
    prepared = {}  # key -> (step, tensors whose grads reset per rep, record, fused path)
    floor_parts = None
    for key in todo:
        fused = None if key in BASELINE_KEYS else f"FusedMLP heuristic={fused_spec(key)[0]}"
        pre = ctx.precheck(item_id, key, fused)
        if pre is not None:
            rec["variants"][key] = pre
            log(f"{tag} {key}: {pre['status']} ({pre['error']})")
            continue
        ctx.begin(item_id, key, fused)
        v = {"status": "ok"}
        try:
            if key == "floor":
                step, floor_parts = floor_steps(ctx, M, d, h, dtype)
                step()
                ctx.sync()
                prepared[key] = (step, None, v, fused)
                continue
            if key == "eager":
                mod = eager
            elif key == "compile":
                torch._dynamo.reset()
                mod = torch.compile(eager, dynamic=False)
            else:
                heur, lvl = fused_spec(key)
                v.update(heuristic=heur, checkpoint_lvl=lvl)
                try:
                    mod = FusedMLP(d, h, d, activation=act, checkpoint_lvl=lvl, heuristic=heur,
                                   device=dev, dtype=dtype)
                    copy_weights(mod, eager)
                except Exception as exc:  # noqa: BLE001
                    raise _Unavailable(exc) from exc
            params = list(mod.parameters())

            def step(mod=mod):
                first(mod(x)).backward(dy)

            # first call: compilation / tuning / plan creation; timed once, kept out of the figures
            for t in params + [x]:
                t.grad = None
            t0 = time.perf_counter()
            try:
                step()
                ctx.sync()
            except Exception as exc:  # noqa: BLE001
                raise (_Unavailable(exc) if fused else exc) from exc
            v["first_call_s"] = round(time.perf_counter() - t0, 3)
            if not sustained:
                mem, outs = measure_pass(ctx, mod, x, dy, params, use_hooks=(key != "compile"))
                v["memory"] = mem
                if ref is not None:
                    v["rel_err"] = {k: rel_err(outs[k], ref[k]) for k in ("out", "dx", "dw1", "dw2")
                                    if outs.get(k) is not None}
                del outs
            prepared[key] = (step, params + [x], v, fused)
        except Exception as exc:  # noqa: BLE001
            record_failure(ctx, rec, tag, key, v, exc)
        finally:
            ctx.end()
            # every prepared module stays alive through the rounds: keep its parameters only, not
            # the gradients of its memory pass (the timing resets them before each repetition)
            held = prepared[key][1] if key in prepared else None
            for t in [x] + list(eager.parameters()) + list(held or []):
                t.grad = None
            mod = step = None  # noqa: F841  (the closure in prepared keeps what is timed)
            ctx.free()

    # 2. the timing, all prepared variants in interleaved rounds (Bench.interleaved says why)
    if prepared:
        rounds = ctx.args.rounds
        log(f"{tag}: timing {len(prepared)} variants in {rounds} interleaved rounds"
            + (f", each block after {bench.warmup_ms:.0f} ms of its own steps" if sustained else ""))
        windows = {}
        sampler = None
        if sustained and ctx.cuda:
            # max_s only ends a sampler whose worker died; generous beside the item's own time
            item_s = len(prepared) * rounds * (bench.warmup_ms + bench.rep_ms) / 1e3
            sampler = ClockSampler(ctx.device.index or 0, max_s=600 + 2 * item_s)
        try:
            if sampler is not None:
                sampler.start()
            timed = bench.interleaved({k: p[:2] for k, p in prepared.items()}, rounds,
                                      before_each=lambda k: ctx.begin(item_id, k, prepared[k][3]), windows=windows)
        finally:
            if sampler is not None:
                sampler.stop()
        ctx.end()
        if sampler is not None:
            record_clocks(rec, {k: p[2] for k, p in prepared.items()}, sampler, windows)
        if "floor" in timed and "error" not in timed["floor"] and variants == FULL_VARIANTS and not ctx.args.quick:
            timed["floor"]["parts_ms"] = {name: ctx.bench(fn)["ms"] for name, fn in floor_parts.items()}
        for key, (_, _, v, _) in prepared.items():
            got = timed[key]
            if "error" in got:
                record_failure(ctx, rec, tag, key, v, got["error"])
                continue
            v.update(got)
            v["tflops"] = flops / v["ms"] / 1e9
            extra = ""
            if "saved_bytes" in v.get("memory", {}):
                extra = f", saved {v['memory']['saved_bytes'] / MIB:.1f} MiB"
            elif "alloc_kept_bytes" in v.get("memory", {}):
                extra = f", kept {v['memory']['alloc_kept_bytes'] / MIB:.1f} MiB"
            if "rel_err" in v:
                extra += f", err out {v['rel_err'].get('out', float('nan')):.1e}"
            if "first_call_s" in v:
                extra += f", first call {v['first_call_s']:.2f} s"
            extra += f", p20-p80 {v['p20']:.3f}-{v['p80']:.3f}, {v['reps']} reps"
            if v.get("allocator_calls"):
                extra += f", {v['allocator_calls']} cudaMalloc/cudaFree calls during warm-up and timing"
            if "clocks" in v:
                c = v["clocks"]
                extra += (f", SM {_f0(c.get('sm_mhz'))} MHz, {_f0(c.get('power_w'))} W (median of "
                          f"{c['samples']} nvidia-smi samples in its blocks)")
            log(f"{tag} {key}: {v['ms']:.3f} ms, {v['tflops']:.0f} TF/s{extra}")
            rec["variants"][key] = v
    ratios(rec["variants"])
    ctx.save()
    prepared = floor_parts = timed = None  # noqa: F841
    torch._dynamo.reset()
    eager = x = dy = ref = None  # noqa: F841
    ctx.free()


def record_clocks(rec, variant_records, sampler, windows):
    """A stopped ClockSampler's samples into an item's records: per variant of variant_records
    ({key: record}) the medians over its blocks (windows, from Bench.interleaved), and the item's
    clock_sampling (what was queried, how many samples). Without nvidia-smi nothing is added; with an
    nvidia-smi that did not answer, clock_sampling says why."""
    if sampler.fields:
        rec["clock_sampling"] = {"tool": "nvidia-smi", "fields": list(sampler.fields),
                                 "interval_ms": sampler.interval_ms, "samples": len(sampler.samples)}
        for key, clocks in clocks_in_windows(sampler.samples, windows).items():
            if key in variant_records:
                variant_records[key]["clocks"] = clocks
    elif sampler.note and shutil.which(sampler.exe):
        rec["clock_sampling"] = {"error": sampler.note}


def record_failure(ctx, rec, tag, key, v, exc):
    """A variant that could not run (_Unavailable) or failed: its record, a log line, and an exit
    for a restart when the CUDA context is gone."""
    real = exc.exc if isinstance(exc, _Unavailable) else exc
    v = {k: v[k] for k in ("heuristic", "checkpoint_lvl") if k in v}
    v.update(status="unavailable" if isinstance(exc, _Unavailable) else "error", error=errstr(real))
    rec["variants"][key] = v
    log(f"{tag} {key}: {v['status'].upper()} {v['error']}")
    if not isinstance(exc, _Unavailable):
        traceback.print_exception(real)
    ctx.check_cuda(real)


class _Unavailable(Exception):
    """A FusedMLP variant that cannot run (e.g. a heuristic index past cuBLASLt's list)."""

    def __init__(self, exc):
        super().__init__(str(exc))
        self.exc = exc


def floor_steps(ctx, M, d, h, dtype):
    """The six plain GEMMs of one MLP step, no bias, no activation, on pre-made tensors: the step,
    and each GEMM alone by name (parts_ms in the full set)."""
    x = ctx.randn(M, d, dtype=dtype)
    w1 = ctx.randn(h, d, dtype=dtype, scale=d ** -0.5)
    w2 = ctx.randn(d, h, dtype=dtype, scale=h ** -0.5)
    hh = ctx.randn(M, h, dtype=dtype)
    dy = ctx.randn(M, d, dtype=dtype)
    dh = ctx.randn(M, h, dtype=dtype)
    parts = {"fwd1": lambda: torch.mm(x, w1.t()),      # [M,d] @ [d,h]
             "fwd2": lambda: torch.mm(hh, w2.t()),     # [M,h] @ [h,d]
             "dgrad2": lambda: torch.mm(dy, w2),       # [M,d] @ [d,h]
             "wgrad2": lambda: torch.mm(dy.t(), hh),   # [d,M] @ [M,h]
             "dgrad1": lambda: torch.mm(dh, w1),       # [M,h] @ [h,d]
             "wgrad1": lambda: torch.mm(dh.t(), x)}    # [h,M] @ [M,d]

    def six():
        for gemm in parts.values():
            gemm()
    return six, parts


OPS_HEURISTICS = ["auto", 0, -1, 1, 2]


def run_ops(ctx, item_id, M, K, N, dtype_name="bf16"):
    """Each op at x[M,K] @ W[N,K]^T against torch.mm (and the eager unfused composition)."""
    dtype = DTYPES[dtype_name]
    flops = 2 * M * N * K
    rec = ctx.find("ops", item_id)
    if rec is None:
        rec = {"id": item_id, "dtype": dtype_name, "M": M, "K": K, "N": N, "flops": flops,
               "fwd": {}, "dgrad": {}, "wgrad": {}}
        ctx.results["ops"].append(rec)
    tag = f"ops {dtype_name} M={M} K={K} N={N}"
    ctx.seed(item_id)
    x = ctx.randn(M, K, dtype=dtype)
    w = ctx.randn(N, K, dtype=dtype, scale=K ** -0.5)
    b = ctx.randn(N, dtype=dtype)
    dout = ctx.randn(M, N, dtype=dtype)
    pre = ctx.randn(M, K, dtype=dtype)   # pre-activation saved by the previous layer's forward

    def add(group, name, fn, fused=None):
        if rec[group].get(name, {}).get("status") in FINAL:
            return
        r = ctx.precheck(item_id, f"{group}/{name}", fused)
        if r is None:
            ctx.begin(item_id, f"{group}/{name}", fused)
            try:
                fn()
                ctx.sync()
                r = ctx.bench(fn)
                r["status"] = "ok"
                r["tflops"] = flops / r["ms"] / 1e9
            except Exception as exc:  # noqa: BLE001
                r = {"status": "unavailable" if fused else "error", "error": errstr(exc)}
                rec[group][name] = r
                ctx.check_cuda(exc)
            ctx.end()
        rec[group][name] = r

    # forward: out = gelu(x @ W^T + b), pre-activation saved
    add("fwd", "mm", lambda: torch.mm(x, w.t()))
    add("fwd", "linear_bias", lambda: F.linear(x, w, b))
    add("fwd", "eager_linear_gelu", lambda: F.gelu(F.linear(x, w, b), approximate="tanh"))
    if ctx.cuda:
        add("fwd", "addmm_activation", lambda: torch._addmm_activation(b, x, w.t(), use_gelu=True))
    # dgrad: d_in = (dout @ W) * gelu'(pre), d_bias = d_in.sum(0)
    add("dgrad", "mm", lambda: torch.mm(dout, w))

    def eager_dgrad():
        g = torch.ops.aten.gelu_backward(torch.mm(dout, w), pre, approximate="tanh")
        return g, g.sum(0)
    add("dgrad", "eager_mm_gelu_bgrad", eager_dgrad)
    # wgrad: dW = dout^T @ x, db = dout.sum(0)
    add("wgrad", "mm", lambda: torch.mm(dout.t(), x))
    add("wgrad", "eager_mm_bgrad", lambda: (torch.mm(dout.t(), x), dout.sum(0)))
    if fd_ops is None:
        for g in ("fwd", "dgrad", "wgrad"):
            rec[g]["fused_dense"] = {"status": "unavailable", "error": FD_IMPORT_ERROR}
    else:
        for hh in OPS_HEURISTICS:
            add("fwd", f"linear_act h={hh}",
                lambda hh=hh: fd_ops.linear_act(x, w, b, "gelu_approx", True, hh), fused=f"linear_act h={hh}")
        for hh in OPS_HEURISTICS:
            add("dgrad", f"act_linear_dgrad h={hh}",
                lambda hh=hh: fd_ops.act_linear_dgrad(w, dout, pre, "gelu_approx", True, hh),
                fused=f"act_linear_dgrad h={hh}")
        add("wgrad", "linear_bias_wgrad", lambda: fd_ops.linear_bias_wgrad(x, dout, True),
            fused="linear_bias_wgrad")
    for g in ("fwd", "dgrad", "wgrad"):
        base = rec[g].get("mm", {}).get("ms") if rec[g].get("mm", {}).get("status") == "ok" else None
        for r in rec[g].values():
            if r.get("status") == "ok" and base:
                r["x_mm"] = r["ms"] / base
    line = "; ".join(f"{g} " + " ".join(f"{k.split(' ')[-1]}={r['ms']:.3f}" for k, r in rec[g].items()
                                         if r.get("status") == "ok") for g in ("fwd", "dgrad", "wgrad"))
    log(f"{tag}: {line}")
    x = w = b = dout = pre = None  # noqa: F841
    ctx.free()


def run_host(ctx, item_id):
    """Host CPU time per forward + backward at a small shape where the host dominates."""
    M, d = (ctx.args.host_m, ctx.args.host_d)
    dtype = torch.bfloat16
    h = 4 * d
    n_iter = ctx.args.host_iters
    reps = 5
    rec = ctx.results.get("host")
    if not rec or rec.get("id") != item_id:
        rec = {"id": item_id, "M": M, "d": d, "h": h, "dtype": "bf16", "iters": n_iter, "reps": reps,
               "method": "time.process_time() (all host threads) over N forward + backward iterations issued "
                         "without synchronization, read before the closing synchronize; median of reps",
               "variants": {}}
        ctx.results["host"] = rec
    ctx.seed(item_id)
    eager = EagerMLP(d, h, "gelu_approx", ctx.device, dtype)
    x = ctx.randn(M, d, dtype=dtype).requires_grad_(True)
    dy = ctx.randn(M, d, dtype=dtype)
    variants = [("eager", None), ("compile", None), ("auto_l0", ("auto", 0)), ("h0_l0", (0, 0)),
                ("h-1_l0", (-1, 0))]
    for key, spec in variants:
        if rec["variants"].get(key, {}).get("status") in FINAL:
            continue
        fused = None if spec is None else f"FusedMLP heuristic={spec[0]}"
        v = ctx.precheck(item_id, key, fused)
        if v is not None:
            rec["variants"][key] = v
            continue
        ctx.begin(item_id, key, fused)
        v = {"status": "ok"}
        mod = None
        try:
            if key == "eager":
                mod = eager
            elif key == "compile":
                torch._dynamo.reset()
                mod = torch.compile(eager, dynamic=False)
            else:
                mod = FusedMLP(d, h, d, activation="gelu_approx", checkpoint_lvl=spec[1], heuristic=spec[0],
                               device=ctx.device, dtype=dtype)
                copy_weights(mod, eager)
            params = list(mod.parameters())

            def step():
                for t in params:
                    t.grad = None
                x.grad = None
                first(mod(x)).backward(dy)
            for _ in range(20):
                step()
            ctx.sync()
            cpu, issue, wall = [], [], []
            for _ in range(reps):
                ctx.sync()
                c0, w0 = time.process_time(), time.perf_counter()
                for _ in range(n_iter):
                    step()
                c1, w1 = time.process_time(), time.perf_counter()
                ctx.sync()
                w2 = time.perf_counter()
                cpu.append((c1 - c0) / n_iter * 1e6)
                issue.append((w1 - w0) / n_iter * 1e6)
                wall.append((w2 - w0) / n_iter * 1e6)
            v.update(cpu_us=statistics.median(cpu), issue_wall_us=statistics.median(issue),
                     wall_us=statistics.median(wall), cpu_us_all=cpu)
            log(f"host M={M} d={d} {key}: cpu {v['cpu_us']:.1f} us/iter, issue wall {v['issue_wall_us']:.1f} us, "
                f"wall incl. sync {v['wall_us']:.1f} us")
        except Exception as exc:  # noqa: BLE001
            v = {"status": "unavailable" if fused else "error", "error": errstr(exc)}
            log(f"host {key}: {v['status']} ({v['error']})")
            rec["variants"][key] = v
            ctx.check_cuda(exc)
        finally:
            ctx.end()
            mod = None  # noqa: F841
        rec["variants"][key] = v
        ctx.save()
    e = rec["variants"].get("eager", {}).get("cpu_us")
    for v in rec["variants"].values():
        if e and v.get("cpu_us"):
            v["x_eager"] = v["cpu_us"] / e
    if "interleaved" not in rec and rec["variants"].get("eager", {}).get("status") == "ok" \
            and rec["variants"].get("auto_l0", {}).get("status") == "ok":
        try:
            rec["interleaved"] = host_interleaved(ctx, eager, x, dy, d, h, dtype)
        except Exception as exc:  # noqa: BLE001
            rec["interleaved"] = {"status": "error", "error": errstr(exc)}
            ctx.check_cuda(exc)
        ctx.save()
    torch._dynamo.reset()
    eager = x = dy = None  # noqa: F841
    ctx.free()


def host_interleaved(ctx, eager, x, dy, d, h, dtype, rounds=15, n_iter=100):
    """Eager and FusedMLP('auto') -- through the C++ autograd op and, for comparison, through the
    Python autograd.Function -- timed in alternation, round after round, so that a change in the
    shared host's speed hits all of them alike; the ratio is taken within each round."""
    from fused_dense import functional as fd_functional

    fused = FusedMLP(d, h, d, activation="gelu_approx", heuristic="auto", device=ctx.device, dtype=dtype)
    copy_weights(fused, eager)
    native = fd_functional._NATIVE_MLP

    def stepper(mod, native_op):
        params = list(mod.parameters())

        def step():
            fd_functional._NATIVE_MLP = native_op
            try:
                for t in params:
                    t.grad = None
                x.grad = None
                first(mod(x)).backward(dy)
            finally:
                fd_functional._NATIVE_MLP = native
        return step
    steps = {"eager": stepper(eager, native), "auto_l0": stepper(fused, native),
             "auto_l0_python_function": stepper(fused, None)}
    times = {k: [] for k in steps}
    for step in steps.values():
        for _ in range(20):
            step()
    for _ in range(rounds):
        for k, step in steps.items():
            ctx.sync()
            c0 = time.process_time()
            for _ in range(n_iter):
                step()
            times[k].append((time.process_time() - c0) / n_iter * 1e6)
            ctx.sync()
    res = {"status": "ok", "rounds": rounds, "iters": n_iter, "native_op": native is not None,
           "method": "time.process_time() per forward + backward; the variants alternate within each of the "
                     "rounds; medians over rounds, and the median of the per-round ratios to eager",
           "cpu_us": {k: statistics.median(v) for k, v in times.items()}, "cpu_us_all": times}
    res["x_eager"] = {k: statistics.median(a / b for a, b in zip(v, times["eager"])) for k, v in times.items()}
    log("host interleaved: " + ", ".join(f"{k} {res['cpu_us'][k]:.1f} us ({res['x_eager'][k]:.3f}x eager)"
                                         for k in times))
    return res


# ----------------------------------------------------------------------------------------------
# plan


def parse_shape(s):
    try:
        m, d = s.lower().split("x")
        return int(m), int(d)
    except ValueError:
        raise argparse.ArgumentTypeError(f"shape must be MxD, e.g. 8192x1024; got {s!r}") from None


def build_plan(args):
    """[(item_id, section, payload)] in run order."""
    if args.device == "cpu":
        shapes, big = (args.shapes or [(256, 64)]), []
    elif args.shapes:
        shapes, big = args.shapes, []
    elif args.quick:
        shapes, big = [(8192, 1024)], []
    else:
        shapes, big = [(8192, 1024), (8192, 2048), (8192, 4096)], [(16384, 8192)]
    full_shapes = shapes + big
    # the reduced configs skip d >= 8192 (each step there is ~80 ms; bf16 gelu covers that shape)
    red_shapes = [s for s in shapes if s[1] < 8192]
    reduced = [("fp16", "relu")] if args.quick else [("fp16", "gelu_approx"), ("bf16", "relu"), ("fp16", "relu")]
    sections = set(args.sections.split(","))
    plan = []
    if "ceiling" in sections:
        plan.append(("ceiling", "ceiling", ()))
    if "mlp" in sections:
        for (M, d) in full_shapes:
            plan.append((f"mlp:bf16:gelu_approx:{M}x{d}", "mlp", ("bf16", "gelu_approx", M, d, FULL_VARIANTS)))
    if "ops" in sections:
        mkns = []
        for (M, d) in full_shapes:
            for mkn in ((M, d, 4 * d), (M, 4 * d, d)):
                if mkn not in mkns:
                    mkns.append(mkn)
        for (M, K, N) in (mkns[:1] if args.quick else mkns):
            plan.append((f"ops:bf16:{M},{K},{N}", "ops", (M, K, N)))
    if "host" in sections:
        plan.append(("host", "host", ()))
    if "reduced" in sections:
        for dt, act in reduced:
            for (M, d) in red_shapes:
                plan.append((f"mlp:{dt}:{act}:{M}x{d}", "mlp", (dt, act, M, d, REDUCED_VARIANTS)))
    if "sustained" in sections:
        for (M, d) in full_shapes:
            plan.append((f"sustained:bf16:gelu_approx:{M}x{d}", "sustained",
                         ("bf16", "gelu_approx", M, d, REDUCED_VARIANTS)))
    if "ceiling" in sections:
        plan.append(("ceiling_end", "ceiling", ("ceiling_end",)))
    return plan


SECTIONS = ("ceiling", "mlp", "ops", "host", "reduced", "sustained")
# the first calls of a shape again (torch.compile compiles anew, 2-4 s on the H200 in s11r3), data
SUSTAINED_PREPARE_S = 5.0
# the MLP step's rate on the H200 (s11r3: 640-670 TF/s), to size a block's share of the repetitions
ESTIMATE_TFLOPS = 650.0


def sustained_estimate_s(plan, args):
    """Rough seconds the plan's sustained items take on the GPU: per shape, every variant's block in
    every round (the warm-up, then its share of the repetitions, at least 2 steps), and the first
    calls. A guide for --budget, not a promise: on the CPU the step time is not modelled."""
    total = 0.0
    for _, section, payload in plan:
        if section != "sustained":
            continue
        _, _, M, d, variants = payload
        step_s = 12 * M * d * 4 * d / (ESTIMATE_TFLOPS * 1e12) if args.device != "cpu" else 0.0
        timed_s = max(max(args.rep_ms / 1e3, 8 * step_s) / args.rounds, 2 * step_s)
        total += len(variants) * args.rounds * (args.sustained_warmup_ms / 1e3 + timed_s) + SUSTAINED_PREPARE_S
    return total


# ----------------------------------------------------------------------------------------------
# main: a supervisor process runs the measurements in a worker process and, if the worker dies
# (a segfault in a kernel under test, an unusable CUDA context), records what it was measuring
# as 'crashed' and starts a new worker that resumes after it.


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="output directory (bench.json, bench.md, bench.png)")
    ap.add_argument("--quick", action="store_true",
                    help="smoke subset: one shape (8192x1024 on GPU), bf16 gelu full + fp16 relu reduced, one op shape")
    ap.add_argument("--shapes", nargs="+", type=parse_shape, metavar="MxD",
                    help="MLP shapes (M tokens x d) instead of the default 8192x{1024,2048,4096} + 16384x8192")
    ap.add_argument("--device", default="cuda", help="cuda (default) or cpu (smoke test at tiny sizes)")
    ap.add_argument("--sections", default=",".join(SECTIONS),
                    help=f"comma list of sections to run (default all: {','.join(SECTIONS)})")
    ap.add_argument("--budget", type=float, default=420.0,
                    help="seconds after which measurements not yet started are recorded as skipped (default 420)")
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile variant")
    ap.add_argument("--no-accuracy", action="store_true", help="skip the float32 reference / error figures")
    ap.add_argument("--warmup-ms", type=float, default=50.0, help="do_bench warm-up (ms, at least 2 calls)")
    ap.add_argument("--rep-ms", type=float, default=200.0, help="do_bench measuring time (ms, at least 8 calls)")
    ap.add_argument("--rounds", type=int, default=5,
                    help="interleaved rounds over the variants of each MLP shape (default 5; Bench.interleaved)")
    ap.add_argument("--sustained-warmup-ms", type=float, default=1000.0,
                    help="sustained section: warm-up before each block, of that variant's own steps (ms, "
                         "default 1000: the H200 settles at its power cap within about a second)")
    ap.add_argument("--timer", choices=["auto", "events"], default="auto",
                    help="auto: triton do_bench when importable, else CUDA events; events: CUDA events always")
    ap.add_argument("--commit", default=os.environ.get("FUSED_DENSE_COMMIT"),
                    help="fused_dense commit to record when the tree has no .git (default: $FUSED_DENSE_COMMIT "
                         "or git rev-parse HEAD)")
    ap.add_argument("--max-restarts", type=int, default=10, help="worker restarts after crashes (default 10)")
    ap.add_argument("--max-fused-crashes", type=int, default=6,
                    help="after this many crashes inside fused_dense, skip the remaining fused_dense variants")
    ap.add_argument("--no-supervise", action="store_true", help="measure in this process (no crash recovery)")
    ap.add_argument("--resume", action="store_true", help="continue the run whose bench.json is in --out")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--t0-epoch", type=float, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.rounds < 1:
        ap.error(f"--rounds must be at least 1, got {args.rounds}")
    if args.sustained_warmup_ms < 0:
        ap.error(f"--sustained-warmup-ms must not be negative, got {args.sustained_warmup_ms:g}")
    unknown = [name for name in args.sections.split(",") if name not in SECTIONS]
    if unknown:
        ap.error(f"--sections: unknown {', '.join(map(repr, unknown))}; known: {','.join(SECTIONS)}")
    return ap, args


def load_results(out):
    try:
        with open(os.path.join(out, "bench.json")) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def supervise(args, argv):
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "bench.json")
    if not args.resume and os.path.exists(path):
        os.remove(path)
    resume = args.resume
    restarts = 0
    while True:
        cmd = [sys.executable, os.path.abspath(__file__)] + argv + ["--worker", "--t0-epoch", repr(T0)]
        if resume and "--resume" not in argv:
            cmd.append("--resume")
        rc = subprocess.call(cmd)
        if rc == 0:
            return 0
        res = load_results(args.out)
        ip = res.get("in_progress") if res else None
        if res is None or (ip is None and rc != EXIT_CUDA_BROKEN):
            log(f"worker failed (exit {rc}) outside any measurement; not restarting")
            if res:
                finalize(res, args.out)
            return rc if rc > 0 else 1
        if ip:
            res.setdefault("crashed", []).append({**ip, "rc": rc, "at_s": round(time.time() - T0, 1)})
            res["in_progress"] = None
            save_results(res, args.out, markdown=False)
        if restarts >= args.max_restarts:
            log(f"worker died (exit {rc}) during {ip}; {restarts} restarts already, giving up")
            finalize(res, args.out)
            return 1
        restarts += 1
        resume = True
        log(f"worker died (exit {rc}) during {ip}; restart {restarts}/{args.max_restarts}, resuming")


def worker(ap, args):
    global T0
    faulthandler.enable()  # a segfault in a kernel under test prints the Python stack that led there
    if args.t0_epoch is not None:
        T0 = args.t0_epoch
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("CUDA is not available; use --device cpu --quick for a smoke test")
    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if device.type == "cuda":
        torch.cuda.set_device(device)
        # create the context and the cuBLAS handle on this thread before autograd's device thread does
        torch.mm(torch.ones(8, 8, device=device), torch.ones(8, 8, device=device)).sum().item()
        args.ceiling_n, args.host_m, args.host_d, args.host_iters = 8192, 512, 512, 200
    else:
        args.ceiling_n, args.host_m, args.host_d, args.host_iters = 256, 64, 64, 20

    prev = load_results(args.out) if args.resume else None
    ctx = Ctx(args, device, prev)
    if FD_IMPORT_ERROR:
        log(f"WARNING: {FD_IMPORT_ERROR}")
    if prev is None:
        ctx.results["env"] = environment(args, device)
        ctx.results["method"] = {
            "timer": ctx.bench.method, "warmup_ms": args.warmup_ms, "rep_ms": args.rep_ms,
            "min_reps": ctx.bench.min_reps, "budget_s": args.budget,
            "mlp_timer": f"MLP variants of a shape timed in {args.rounds} interleaved rounds (order rotated per "
                         "round), " + ("CUDA events around each rep, L2 flushed before each" if device.type == "cuda"
                                       else "perf_counter around each rep") + "; median over all reps",
            "mlp": "fwd + bwd of Linear(d,4d) -> act -> Linear(4d,d) on x[M,d] (requires grad) with a random "
                   "dY; param and input grads reset to None before every rep; TF/s = 12*M*d*h/time",
            "floor": "the six plain torch.mm of the step (x@W1^T, h@W2^T, dY@W2, dY^T@h, dH@W1, dH^T@x) on "
                     "pre-made tensors, no bias, no activation",
            "memory": "saved_bytes: unique non-parameter storages packed by saved_tensors_hooks in one forward "
                      "(x included; not for torch.compile); alloc_kept_bytes: memory_allocated after forward "
                      "minus before, output excluded; peak_delta_bytes: max_memory_allocated over fwd+bwd "
                      "minus before",
            "accuracy": "rel. error ||v - ref|| / ||ref|| against a float32 (no tf32) eager reference",
            "sustained_warmup_ms": args.sustained_warmup_ms,
            "sustained": f"floor, eager, compile and FusedMLP auto at the bf16 gelu_approx shapes in {args.rounds} "
                         "interleaved rounds as in the mlp section, but each block after "
                         f"{args.sustained_warmup_ms:.0f} ms of that variant's own steps, so it is timed at the "
                         "steady state of sustained load where training runs (on the H200 the 700 W power cap, "
                         "SM clock 1380-1590 MHz instead of 1980); no float32 accuracy check or memory pass "
                         "(the mlp section takes them for the same shapes). Where nvidia-smi exists it samples "
                         f"SM clock and power every {SMI_INTERVAL_MS} ms, and each variant "
                         "records their medians over the samples inside its timed blocks and the last third "
                         "(at most 300 ms) of their warm-ups",
        }
        env = ctx.results["env"]
        log(f"env: {env.get('gpu', 'cpu')}, driver {env.get('driver')}, torch {torch.__version__}, "
            f"CUDA {torch.version.cuda}, cuBLASLt {env.get('cublasLt_version_str')}")
    else:
        ctx.results["restarts"] = ctx.results.get("restarts", 0) + 1
        log(f"resuming: {len(ctx.results.get('done', []))} items done, crashed so far: "
            f"{[(c['item'], c['variant']) for c in ctx.results.get('crashed', [])]}")
    plan = build_plan(args)
    ctx.results["plan"] = [item_id for item_id, _, _ in plan]
    log(f"plan: {len(plan)} items, budget {args.budget:.0f} s ({ctx.time_left():.0f} s left)")
    n_sustained = sum(1 for _, section, _ in plan if section == "sustained")
    if n_sustained:
        log(f"sustained section: {n_sustained} shapes x {len(REDUCED_VARIANTS)} variants x {args.rounds} rounds, "
            f"each block after {args.sustained_warmup_ms:.0f} ms of warm-up: about "
            f"{sustained_estimate_s(plan, args):.0f} s" + (" on the H200" if device.type == "cuda" else ""))
    ctx.save()
    for item_id, section, payload in plan:
        if item_id in ctx.results["done"]:
            continue
        if ctx.time_left() < 0:
            if item_id not in ctx.results["skipped"]:
                ctx.results["skipped"].append(item_id)
            log(f"skipped (time budget): {item_id}")
            continue
        try:
            if section == "ceiling":
                run_ceiling(ctx, item_id, *payload)
            elif section in ("mlp", "sustained"):
                run_mlp(ctx, item_id, *payload, section=section)
            elif section == "ops":
                run_ops(ctx, item_id, *payload)
            elif section == "host":
                run_host(ctx, item_id)
            ctx.results["done"].append(item_id)
        except Exception as exc:  # noqa: BLE001
            log(f"{item_id}: ERROR {errstr(exc)}")
            traceback.print_exc()
            ctx.results.setdefault("errors", []).append([item_id, errstr(exc)])
            ctx.end()
            ctx.check_cuda(exc)
            ctx.results["done"].append(item_id)
            ctx.free()
        ctx.save()
    ctx.results["complete"] = True
    finalize(ctx.results, args.out)
    return 0


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    ap, args = parse_args(argv)
    if args.worker or args.no_supervise:
        return worker(ap, args)
    return supervise(args, argv)


if __name__ == "__main__":
    sys.exit(main())
