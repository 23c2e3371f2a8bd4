"""What is timed (the sections ceiling, mlp, ops, host and sustained; bench/README.md lists them)
and the run's state: results, time budget, what crashed the process.
"""
import contextlib
import copy
import ctypes
import gc
import json
import os
import statistics
import time
import traceback
import zlib

import torch
import torch.nn as nn
import torch.nn.functional as F

from bench import power, report
from bench.timing import Bench, SavedStorages

T0 = time.time()  # run.py sets it to the supervisor's start, so budget and log clock span restarts
EXIT_CUDA_BROKEN = 3  # worker exit code: the CUDA context is unusable; the supervisor restarts

FD_IMPORT_ERROR = fd_ops = FusedMLP = fd_functional = None
try:
    from fused_dense import FusedMLP, functional as fd_functional, ops as fd_ops
except Exception as exc:  # noqa: BLE001  (the baselines are still measured)
    FD_IMPORT_ERROR = f"import fused_dense failed: {type(exc).__name__}: {exc}"
try:
    from flash_attn.ops.fused_dense import FusedMLP as FlashFusedMLP
except Exception:  # noqa: BLE001
    FlashFusedMLP = None

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
BASELINES = ("floor", "eager", "compile")
FULL_VARIANTS = ["floor", "eager", "compile", "auto_l0", "auto_exact_l0", "auto_l1", "auto_l2", "h-1_l0", "h0_l0", "h1_l0",
                 "h2_l0"] + (["flash_attn"] if FlashFusedMLP is not None else [])
REDUCED_VARIANTS = ["floor", "eager", "compile", "auto_l0"]
OPS_HEURISTICS = ["auto", 0, -1, 1, 2]
FINAL = ("ok", "unavailable", "error", "skipped", "crashed")


def log(msg):
    print(f"[{time.time() - T0:7.1f}s] {msg}", flush=True)


def errstr(exc, limit=400):
    s = f"{type(exc).__name__}: {exc}".strip().replace("\n", " ")
    return s if len(s) <= limit else s[:limit] + "..."


def fused_spec(key):
    """'auto_l1' -> ('auto', 1); 'auto_exact_l0' -> ('auto', 0); 'h-1_l0' -> (-1, 0)."""
    h, lvl = key.split("_l")
    return ("auto" if h.startswith("auto") else int(h[1:])), int(lvl)


# 'auto_exact' variants: 'auto' with the tuner keyed by the exact token count, unpaced, a generous
# budget per problem and no process budget: the choice the package's defaults (buckets, shipped
# table, default budgets) are held against, in the same process. Every other variant runs under
# the settings the process started with; the seconds the exact variants spent measuring are added
# to the process budget there, so they do not take it from the defaults.
EXACT_TUNER = dict(buckets=0, budget_s=1e6, problem_budget_ms=1000.0, pace=1.0)


class TunerModes:
    """Switches the tuner between the defaults and EXACT_TUNER per variant (enter(key))."""

    def __init__(self):
        self.defaults, self.exact_spent_s, self.current = None, 0.0, None

    def enter(self, key):
        exact = key.startswith("auto_exact")
        if fd_functional is None or (not exact and self.defaults is None):
            return
        import fused_dense
        from fused_dense import tuning
        if not fused_dense.has_cuda_kernels():  # a CPU build has no tuner: the variant is plain 'auto'
            return
        if self.defaults is None:
            self.defaults = tuning.settings()
        if exact == self.current:
            return
        if self.current:  # leaving the exact mode: what it measured stays out of the defaults' budget
            self.exact_spent_s += tuning.stats()["measuring_s"] - self._spent_at_entry
        if exact:
            self._spent_at_entry = tuning.stats()["measuring_s"]
            tuning.configure(**EXACT_TUNER)
        else:
            tuning.configure(**dict(self.defaults, budget_s=self.defaults["budget_s"] + self.exact_spent_s))
        self.current = exact


TUNER = TunerModes()


def fused_path(key):
    """The code path a variant exercises (a crash there skips it for the rest of the run)."""
    if key in BASELINES:
        return None
    return "flash_attn FusedMLP" if key == "flash_attn" else f"FusedMLP heuristic={fused_spec(key)[0]}"


class EagerMLP(nn.Module):
    """nn.Linear -> F.gelu(tanh) or F.relu -> nn.Linear, parameter names as FusedMLP's."""

    def __init__(self, d, h, activation, device, dtype):
        super().__init__()
        self.fc1 = nn.Linear(d, h, device=device, dtype=dtype)
        self.fc2 = nn.Linear(h, d, device=device, dtype=dtype)
        self.activation = activation

    def forward(self, x):
        y = self.fc1(x)
        return self.fc2(F.gelu(y, approximate="tanh") if self.activation == "gelu_approx" else F.relu(y))


def first(out):
    return out[0] if isinstance(out, (tuple, list)) else out


def rel_err(a, ref):
    return float((a.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30))


class Unavailable(Exception):
    """A fused variant that cannot run here (e.g. a heuristic index past cuBLASLt's list)."""


class Ctx:
    """The run: its results (saved after every measurement, so a crash loses nothing measured),
    the timers, the time budget, and what crashed the process in an earlier worker."""

    def __init__(self, args, device, paths, results=None):
        self.args, self.device, self.cuda, self.paths = args, device, device.type == "cuda", paths
        self.bench = Bench(device, warmup_ms=args.warmup_ms, rep_ms=args.rep_ms, timer=args.timer)
        self.sustained_bench = Bench(device, warmup_ms=args.sustained_warmup_ms, rep_ms=args.rep_ms,
                                     timer=args.timer)
        self.results = results or {"schema": 1, "env": {}, "method": {}, "ceiling": None, "mlp": [], "ops": [],
                                   "host": None, "sustained": [], "done": [], "skipped": [], "crashed": [],
                                   "in_progress": None}
        self.crashed = {(c["item"], c["variant"]): c for c in self.results.get("crashed", [])}

    def time_left(self):
        return T0 + self.args.budget - time.time()

    def seed(self, item_id):
        """Fresh random data per item, the same in a worker that resumes the item."""
        torch.manual_seed(zlib.crc32(item_id.encode()) & 0x7FFFFFFF)

    def randn(self, *shape, dtype, scale=1.0):
        return (torch.randn(*shape, device=self.device) * scale).to(dtype)

    def sync(self):
        self.bench.sync()

    def free(self):
        gc.collect()
        if self.cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()

    def record(self, section, item_id, **fields):
        """The item's record in results[section], created with fields when new."""
        recs = self.results.setdefault(section, [])
        rec = next((r for r in recs if r.get("id") == item_id), None)
        if rec is None:
            rec = dict(id=item_id, **fields)
            recs.append(rec)
        return rec

    def precheck(self, item_id, variant, fused):
        """A final record to store instead of measuring, or None to measure. fused: the code path
        ('FusedMLP heuristic=auto', 'linear_act h=0', ...) or None for a baseline; a path that
        crashed the process is skipped for the rest of the run, and after --max-fused-crashes
        crashes every fused measurement is."""
        crashes = self.results.get("crashed", [])
        c = self.crashed.get((item_id, variant))
        if c:
            return {"status": "crashed", "error": f"the process died (exit {c.get('rc')}) during this "
                                                  "measurement; the bench restarted without it"}
        same = [c for c in crashes if fused and c.get("fused") == fused]
        if same:
            return {"status": "skipped", "error": f"not run: '{fused}' crashed the process earlier in this run "
                                                  f"(at {same[0]['item']} / {same[0]['variant']})"}
        n = sum(1 for c in crashes if c.get("fused"))
        if fused and n >= self.args.max_fused_crashes:
            return {"status": "skipped", "error": f"not run: fused code crashed the process {n} times in this run"}
        if self.time_left() < 0:
            return {"status": "skipped", "error": "time budget exhausted"}
        if variant.endswith("compile") and self.args.no_compile:
            return {"status": "skipped", "error": "--no-compile"}
        if fused and fused.startswith("FusedMLP") and FusedMLP is None:
            return {"status": "unavailable", "error": FD_IMPORT_ERROR}
        return None

    def begin(self, item_id, variant, fused):
        """What is being measured, on disk, so the supervisor can tell what crashed the process."""
        self.results["in_progress"] = {"item": item_id, "variant": variant, "fused": fused}
        self.save(markdown=False)
        hook = os.environ.get("FD_BENCH_TEST_CRASH")  # tests: "ITEM_SUBSTRING:VARIANT" segfaults there
        if hook and (item_id, variant) not in self.crashed:
            it, _, var = hook.rpartition(":")
            if it in item_id and var == variant:
                log(f"FD_BENCH_TEST_CRASH: crashing on purpose at {item_id} {variant}")
                ctypes.string_at(0)

    def end(self):
        self.results["in_progress"] = None

    def check_cuda(self, exc):
        """After an exception: if the CUDA context is unusable, save and exit for a restart."""
        if not self.cuda:
            return
        try:
            torch.cuda.synchronize(self.device)
            torch.ones(1, device=self.device).add_(1).item()
        except Exception as exc2:  # noqa: BLE001
            log(f"CUDA context unusable after '{errstr(exc, 160)}' ({errstr(exc2, 160)}); exiting for a restart")
            self.end()
            self.save(markdown=False)
            os._exit(EXIT_CUDA_BROKEN)

    def save(self, markdown=True):
        save_results(self.results, self.paths, markdown)


def save_results(results, paths, markdown=True):
    """results to paths['json'] (atomically) and, with markdown, its report to paths['md']."""
    os.makedirs(os.path.dirname(paths["json"]) or ".", exist_ok=True)
    results["elapsed_s"] = round(time.time() - T0, 1)
    with open(paths["json"] + ".tmp", "w") as f:
        json.dump(results, f, indent=1)
    os.replace(paths["json"] + ".tmp", paths["json"])
    if markdown:
        try:
            with open(paths["md"], "w") as f:
                f.write(report.markdown(results))
        except Exception as exc:  # noqa: BLE001
            log(f"WARNING: {paths['md']} not written: {errstr(exc)}")
            traceback.print_exc()


# ---- sections -------------------------------------------------------------------------------------


def run_ceiling(ctx, item_id, key="ceiling"):
    n = ctx.args.ceiling_n
    dtype = torch.bfloat16 if ctx.cuda else torch.float32
    pre = ctx.precheck(item_id, "mm", None)
    if pre:
        ctx.results[key] = pre
        return
    ctx.seed(item_id)
    a, b = ctx.randn(n, n, dtype=dtype), ctx.randn(n, n, dtype=dtype)
    ctx.begin(item_id, "mm", None)
    t = ctx.bench(lambda: torch.mm(a, b))
    ctx.end()
    tf = 2 * n ** 3 / t["ms"] / 1e9
    ctx.results[key] = {"status": "ok", "n": n, "dtype": str(dtype).replace("torch.", ""), **t, "tflops": tf}
    log(f"{key} {n}^3 {dtype}: {t['ms']:.3f} ms, {tf:.0f} TF/s")


def floor_steps(ctx, M, d, h, dtype, fc1_width=None):
    """The six plain GEMMs of one MLP step on pre-made tensors, no bias, no activation: the step,
    and each GEMM alone by name. fc1_width: fc1's output width when it is not h (2h: a gated MLP's
    gate and up as one GEMM)."""
    n1 = h if fc1_width is None else fc1_width
    x, dy = ctx.randn(M, d, dtype=dtype), ctx.randn(M, d, dtype=dtype)
    hh, dh = ctx.randn(M, h, dtype=dtype), ctx.randn(M, n1, dtype=dtype)
    w1 = ctx.randn(n1, d, dtype=dtype, scale=d ** -0.5)
    w2 = ctx.randn(d, h, dtype=dtype, scale=h ** -0.5)
    parts = {"fwd1": lambda: torch.mm(x, w1.t()), "fwd2": lambda: torch.mm(hh, w2.t()),
             "dgrad2": lambda: torch.mm(dy, w2), "wgrad2": lambda: torch.mm(dy.t(), hh),
             "dgrad1": lambda: torch.mm(dh, w1), "wgrad1": lambda: torch.mm(dh.t(), x)}

    def six():
        for gemm in parts.values():
            gemm()
    return six, parts


def baseline_module(key, eager):
    """The eager module itself, or its torch.compile (default mode); None for any other key."""
    if key == "eager":
        return eager
    if key == "compile":
        torch._dynamo.reset()
        return torch.compile(eager, dynamic=False)
    return None


def make_module(key, eager, act, d, h, device, dtype):
    base = baseline_module(key, eager)
    if base is not None:
        return base
    try:
        if key == "flash_attn":
            mod = FlashFusedMLP(d, h, d, activation=act, device=device, dtype=dtype)
        else:
            heur, lvl = fused_spec(key)
            mod = FusedMLP(d, h, d, activation=act, checkpoint_lvl=lvl, heuristic=heur, device=device, dtype=dtype)
        mod.load_state_dict(eager.state_dict())
    except Exception as exc:  # noqa: BLE001
        raise Unavailable(errstr(exc)) from exc
    return mod


def measure_pass(ctx, mod, x, dy, params, use_hooks=True):
    """One forward + backward: memory kept for backward, and the outputs for the accuracy check.
    saved_bytes: unique non-parameter storages packed by saved_tensors_hooks in the forward (not
    for torch.compile: hooks at call time make Dynamo recompile, so what ran would not be what was
    timed; it gets the allocator figures only)."""
    for t in params + [x]:
        t.grad = None
    ctx.free()
    saved = SavedStorages(params)
    base = torch.cuda.memory_allocated(ctx.device) if ctx.cuda else 0
    if ctx.cuda:
        torch.cuda.reset_peak_memory_stats(ctx.device)
    with saved if use_hooks else contextlib.nullcontext():
        out = first(mod(x))
    ctx.sync()
    kept = torch.cuda.memory_allocated(ctx.device) - base - out.numel() * out.element_size() if ctx.cuda else None
    out.backward(dy)
    ctx.sync()
    mem = {"saved_bytes": saved.bytes, "saved_storages": saved.storages} if use_hooks else {}
    if ctx.cuda:
        mem.update(alloc_kept_bytes=kept, peak_delta_bytes=torch.cuda.max_memory_allocated(ctx.device) - base)
    outs = {"out": out.detach(), "dx": x.grad}
    outs.update({"d" + n: p.grad for n, p in zip(["w1", "b1", "w2", "b2"], params)})
    return mem, outs


def float32_pass(ref, eager, x, dy):
    """{out, dx} of ref (a float32 module of eager's kind) with eager's weights, in float32 without tf32."""
    ref.load_state_dict({k: v.float() for k, v in eager.state_dict().items()})
    xr = x.detach().float().requires_grad_(True)
    prev = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        out = ref(xr)
        out.backward(dy.float())
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev
    return {"out": out.detach(), "dx": xr.grad}


def reference(ctx, eager, x, dy):
    """float32 (no tf32) out, dx, dW1, dW2 of the eager MLP."""
    ref = EagerMLP(eager.fc1.in_features, eager.fc1.out_features, eager.activation, ctx.device, torch.float32)
    return dict(float32_pass(ref, eager, x, dy), dw1=ref.fc1.weight.grad, dw2=ref.fc2.weight.grad)


def ratios(variants):
    """x_floor = time / floor's; speedup_vs_eager / _vs_compile = their time / time."""
    base = {k: variants[k]["ms"] for k in BASELINES if (variants.get(k) or {}).get("status") == "ok"}
    for v in variants.values():
        if v.get("status") != "ok":
            continue
        for name, k in (("x_floor", "floor"), ("speedup_vs_eager", "eager"), ("speedup_vs_compile", "compile")):
            if k in base:
                v[name] = v["ms"] / base[k] if k == "floor" else base[k] / v["ms"]


def record_failure(ctx, rec, tag, key, v, exc):
    v = {k: v[k] for k in ("heuristic", "checkpoint_lvl") if k in v}
    v.update(status="unavailable" if isinstance(exc, Unavailable) else "error",
             error=str(exc) if isinstance(exc, Unavailable) else errstr(exc))
    rec["variants"][key] = v
    log(f"{tag} {key}: {v['status'].upper()} {v['error']}")
    if not isinstance(exc, Unavailable):
        traceback.print_exception(exc)
    ctx.check_cuda(exc)


def run_mlp(ctx, item_id, dtype_name, act, M, d, variants, section="mlp"):
    """One shape's variants: each one's first call, memory and accuracy pass, then all of them
    timed in interleaved rounds. The sustained section times with each block after a long warm-up
    of its own steps, samples clock and power beside it, and leaves out the accuracy and memory
    pass (the mlp section takes them for the same shapes)."""
    dtype, h = DTYPES[dtype_name], 4 * d
    flops = 12 * M * d * h
    rec = ctx.record(section, item_id, dtype=dtype_name, activation=act, M=M, d=d, h=h, flops=flops, variants={})
    ctx.seed(item_id)
    eager = EagerMLP(d, h, act, ctx.device, dtype)
    x = ctx.randn(M, d, dtype=dtype).requires_grad_(True)
    dy = ctx.randn(M, d, dtype=dtype)

    def settings(key):
        if key in BASELINES or key == "flash_attn":
            return {}
        return dict(zip(("heuristic", "checkpoint_lvl"), fused_spec(key)),
                    **({"tuner": EXACT_TUNER} if key.startswith("auto_exact") else {}))
    spec = VariantSpec(build=lambda key: make_module(key, eager, act, d, h, ctx.device, dtype),
                       floor=lambda: floor_steps(ctx, M, d, h, dtype), fused_path=fused_path, settings=settings,
                       reference=lambda: reference(ctx, eager, x, dy), enter=TUNER.enter)
    run_variants(ctx, item_id, section, rec, f"{section} {dtype_name} {act} M={M} d={d}", variants, spec, x, dy,
                 eager, floor_parts=section == "mlp" and not ctx.args.quick and variants == FULL_VARIANTS)


class VariantSpec:
    """What run_variants needs of a section: build(key) -> the module of a variant (Unavailable
    where it cannot run here); floor() -> (step, {name: GEMM}); fused_path(key) -> the code path or
    None; settings(key) -> fields recorded with the variant; reference() -> {name: float32 tensor}
    compared with a pass's outputs of the same names (out, dx, dw1, ...), or None. floors: {key:
    () -> (step, {name: GEMM})} where a section has floors other than 'floor' (default: floor as
    'floor'); compiled(key): whether the variant is torch.compile'd (no saved-tensor hooks in its
    memory pass; default: 'compile' in its key); enter(key): runs before each of the variant's
    calls are made (its first call and passes, each timed block)."""

    def __init__(self, build, floor, fused_path, settings, reference, floors=None, compiled=None, enter=None):
        self.build, self.floor, self.fused_path, self.settings, self.reference = (build, floor, fused_path, settings,
                                                                                   reference)
        self.enter = enter or (lambda key: None)
        self.floors = floors if floors is not None else ({"floor": floor} if floor is not None else {})
        self.compiled = compiled or (lambda key: "compile" in key)


def run_variants(ctx, item_id, section, rec, tag, variants, spec, x, dy, eager, floor_parts=False, rounds=None):
    """A shape's variants into rec['variants']: each one's first call, memory and accuracy pass,
    then all of them timed in interleaved rounds (the sustained section: each block after a long
    warm-up of its own steps, clock and power sampled, no accuracy or memory pass). floor_parts:
    each floor's GEMMs also timed one by one; rounds: other than --rounds."""
    sustained = section == "sustained"
    bench = ctx.sustained_bench if sustained else ctx.bench
    flops = rec["flops"]
    todo = [k for k in variants if rec["variants"].get(k, {}).get("status") not in FINAL]
    ref = None
    if not ctx.args.no_accuracy and not sustained and any(k not in spec.floors for k in todo):
        ref = spec.reference()
        x.grad = None

    prepared, parts = {}, {}  # key -> (step, tensors whose grads reset, record, fused path); floor -> GEMMs
    for key in todo:
        fused = spec.fused_path(key)
        pre = ctx.precheck(item_id, key, fused)
        if pre is not None:
            rec["variants"][key] = pre
            log(f"{tag} {key}: {pre['status']} ({pre['error']})")
            continue
        ctx.begin(item_id, key, fused)
        spec.enter(key)
        v = {"status": "ok"}
        try:
            if key in spec.floors:
                step, parts[key] = spec.floors[key]()
                step()
                ctx.sync()
                prepared[key] = (step, None, v, fused)
                continue
            v.update(spec.settings(key))
            mod = spec.build(key)
            params = list(mod.parameters())

            def step(mod=mod):
                first(mod(x)).backward(dy)
            t0 = time.perf_counter()  # first call: compilation, tuning, plans; kept out of the figures
            try:
                step()
                ctx.sync()
            except Exception as exc:  # noqa: BLE001
                raise (Unavailable(errstr(exc)) if fused else exc) from exc
            v["first_call_s"] = round(time.perf_counter() - t0, 3)
            if not sustained:
                v["memory"], outs = measure_pass(ctx, mod, x, dy, params, use_hooks=not spec.compiled(key))
                if ref is not None:
                    v["rel_err"] = {k: rel_err(outs[k], r) for k, r in ref.items() if outs.get(k) is not None}
            prepared[key] = (step, params + [x], v, fused)
        except Exception as exc:  # noqa: BLE001
            record_failure(ctx, rec, tag, key, v, exc)
        finally:
            ctx.end()
            held = prepared[key][1] if key in prepared else None
            for t in [x, *eager.parameters(), *(held or [])]:
                t.grad = None  # the prepared modules stay alive through the rounds, their gradients not
            mod = step = outs = None  # noqa: F841
            ctx.free()

    if prepared:
        rounds = rounds or ctx.args.rounds
        log(f"{tag}: timing {len(prepared)} variants in {rounds} interleaved rounds"
            + (f", each block after {bench.warmup_ms:.0f} ms of its own steps" if sustained else ""))
        windows = {}
        sampler = power.PowerSampler(ctx.device.index or 0) if sustained and ctx.cuda else None
        last = [time.time()]

        def progress(r, n):
            if time.time() - last[0] > 10 and r < n:
                last[0] = time.time()
                log(f"{tag}: round {r}/{n} done")
        try:
            if sampler is not None:
                sampler.start()
            timed = bench.interleaved({k: p[:2] for k, p in prepared.items()}, rounds, windows=windows,
                                      before_each=lambda k: (ctx.begin(item_id, k, prepared[k][3]), spec.enter(k)),
                                      progress=progress)
        finally:
            if sampler is not None:
                sampler.stop()
        ctx.end()
        if sampler is not None:
            power.record_clocks(rec, {k: p[2] for k, p in prepared.items()}, sampler, windows)
        for fk in parts if floor_parts else ():
            if fk in prepared and "error" not in timed[fk]:
                timed[fk]["parts_ms"] = {name: ctx.bench(fn)["ms"] for name, fn in parts[fk].items()}
        for key, (_, _, v, _) in prepared.items():
            if "error" in timed[key]:
                record_failure(ctx, rec, tag, key, v, timed[key]["error"])
                continue
            v.update(timed[key], tflops=flops / timed[key]["ms"] / 1e9)
            rec["variants"][key] = v
            log(f"{tag} {key}: {v['ms']:.3f} ms ({v['p20']:.3f}-{v['p80']:.3f}), {v['tflops']:.0f} TF/s"
                + (f", {v['allocator_calls']} cudaMalloc/cudaFree" if v.get("allocator_calls") else "")
                + (f", SM {v['clocks'].get('sm_mhz', 0):.0f} MHz {v['clocks'].get('power_w', 0):.0f} W"
                   if "clocks" in v else ""))
    ratios(rec["variants"])
    ctx.save()
    prepared = parts = timed = ref = None  # noqa: F841
    torch._dynamo.reset()
    ctx.free()


def run_ops(ctx, item_id, M, K, N, dtype_name="bf16"):
    """Each op at x[M,K] @ W[N,K]^T against torch.mm and the unfused eager composition."""
    dtype, flops = DTYPES[dtype_name], 2 * M * N * K
    rec = ctx.record("ops", item_id, dtype=dtype_name, M=M, K=K, N=N, flops=flops, fwd={}, dgrad={}, wgrad={})
    ctx.seed(item_id)
    x, b = ctx.randn(M, K, dtype=dtype), ctx.randn(N, dtype=dtype)
    w = ctx.randn(N, K, dtype=dtype, scale=K ** -0.5)
    dout = ctx.randn(M, N, dtype=dtype)
    pre = ctx.randn(M, K, dtype=dtype)  # the previous layer's saved pre-activation

    def add(group, name, fn, fused=None):
        if rec[group].get(name, {}).get("status") in FINAL:
            return
        r = ctx.precheck(item_id, f"{group}/{name}", fused)
        if r is None:
            ctx.begin(item_id, f"{group}/{name}", fused)
            try:
                fn()
                ctx.sync()
                r = dict(ctx.bench(fn), status="ok")
                r["tflops"] = flops / r["ms"] / 1e9
            except Exception as exc:  # noqa: BLE001
                r = {"status": "unavailable" if fused else "error", "error": errstr(exc)}
                ctx.check_cuda(exc)
            ctx.end()
        rec[group][name] = r

    add("fwd", "mm", lambda: torch.mm(x, w.t()))
    add("fwd", "linear_bias", lambda: F.linear(x, w, b))
    add("fwd", "eager_linear_gelu", lambda: F.gelu(F.linear(x, w, b), approximate="tanh"))
    if ctx.cuda:
        add("fwd", "addmm_activation", lambda: torch._addmm_activation(b, x, w.t(), use_gelu=True))
    add("dgrad", "mm", lambda: torch.mm(dout, w))

    def eager_dgrad():
        g = torch.ops.aten.gelu_backward(torch.mm(dout, w), pre, approximate="tanh")
        return g, g.sum(0)
    add("dgrad", "eager_mm_gelu_bgrad", eager_dgrad)
    add("wgrad", "mm", lambda: torch.mm(dout.t(), x))
    add("wgrad", "eager_mm_bgrad", lambda: (torch.mm(dout.t(), x), dout.sum(0)))
    if fd_ops is None:
        for g in ("fwd", "dgrad", "wgrad"):
            rec[g]["fused_dense"] = {"status": "unavailable", "error": FD_IMPORT_ERROR}
    else:
        for hh in OPS_HEURISTICS:
            add("fwd", f"linear_act h={hh}", lambda hh=hh: fd_ops.linear_act(x, w, b, "gelu_approx", True, hh),
                fused=f"linear_act h={hh}")
        for hh in OPS_HEURISTICS:
            add("dgrad", f"act_linear_dgrad h={hh}",
                lambda hh=hh: fd_ops.act_linear_dgrad(w, dout, pre, "gelu_approx", True, hh),
                fused=f"act_linear_dgrad h={hh}")
        add("wgrad", "linear_bias_wgrad", lambda: fd_ops.linear_bias_wgrad(x, dout, True), fused="linear_bias_wgrad")
    for g in ("fwd", "dgrad", "wgrad"):
        mm = rec[g].get("mm", {})
        for r in rec[g].values():
            if r.get("status") == "ok" and mm.get("status") == "ok":
                r["x_mm"] = r["ms"] / mm["ms"]
    log(f"ops {dtype_name} M={M} K={K} N={N}: " + "; ".join(
        f"{g} " + " ".join(f"{k.split(' ')[-1]}={r['ms']:.3f}" for k, r in rec[g].items() if r.get("status") == "ok")
        for g in ("fwd", "dgrad", "wgrad")))
    ctx.free()


HOST_VARIANTS = [("eager", None), ("compile", None), ("auto_l0", "auto"), ("h0_l0", 0), ("h-1_l0", -1)]


def run_host(ctx, item_id):
    """Host CPU time per forward + backward where the host dominates: time.process_time() (all
    threads) over N steps issued without synchronization, read before the closing synchronize."""
    M, d, n_iter, reps = ctx.args.host_m, ctx.args.host_d, ctx.args.host_iters, 5
    h, dtype = 4 * d, torch.bfloat16
    rec = ctx.results.get("host")
    if not rec or rec.get("id") != item_id:
        rec = ctx.results["host"] = {
            "id": item_id, "M": M, "d": d, "h": h, "dtype": "bf16", "iters": n_iter, "reps": reps, "variants": {},
            "method": "time.process_time() (all host threads) over N forward + backward iterations issued "
                      "without synchronization, read before the closing synchronize; median of reps"}
    ctx.seed(item_id)
    eager = EagerMLP(d, h, "gelu_approx", ctx.device, dtype)
    x = ctx.randn(M, d, dtype=dtype).requires_grad_(True)
    dy = ctx.randn(M, d, dtype=dtype)
    for key, heur in HOST_VARIANTS:
        if rec["variants"].get(key, {}).get("status") in FINAL:
            continue
        fused = None if heur is None else f"FusedMLP heuristic={heur}"
        v = ctx.precheck(item_id, key, fused)
        if v is None:
            ctx.begin(item_id, key, fused)
            try:
                mod = make_module(key, eager, "gelu_approx", d, h, ctx.device, dtype)
                step = _stepper(mod, x, dy)
                for _ in range(20):
                    step()
                cpu, issue, wall = [], [], []
                for _ in range(reps):
                    ctx.sync()
                    c0, w0 = time.process_time(), time.perf_counter()
                    for _ in range(n_iter):
                        step()
                    c1, w1 = time.process_time(), time.perf_counter()
                    ctx.sync()
                    cpu.append((c1 - c0) / n_iter * 1e6)
                    issue.append((w1 - w0) / n_iter * 1e6)
                    wall.append((time.perf_counter() - w0) / n_iter * 1e6)
                v = {"status": "ok", "cpu_us": statistics.median(cpu), "issue_wall_us": statistics.median(issue),
                     "wall_us": statistics.median(wall), "cpu_us_all": cpu}
                log(f"host M={M} d={d} {key}: cpu {v['cpu_us']:.1f} us/iter, issue {v['issue_wall_us']:.1f} us")
            except Exception as exc:  # noqa: BLE001
                v = {"status": "unavailable" if fused else "error", "error": errstr(exc)}
                log(f"host {key}: {v['status']} ({v['error']})")
                ctx.check_cuda(exc)
            ctx.end()
        rec["variants"][key] = v
        ctx.save()
    e = rec["variants"].get("eager", {}).get("cpu_us")
    for v in rec["variants"].values():
        if e and v.get("cpu_us"):
            v["x_eager"] = v["cpu_us"] / e
    if "interleaved" not in rec and all(rec["variants"].get(k, {}).get("status") == "ok" for k in ("eager", "auto_l0")):
        try:
            rec["interleaved"] = host_interleaved(ctx, eager, x, dy, d, h, dtype)
        except Exception as exc:  # noqa: BLE001
            rec["interleaved"] = {"status": "error", "error": errstr(exc)}
            ctx.check_cuda(exc)
        ctx.save()
    torch._dynamo.reset()
    ctx.free()


HOST_LAYER_WIDTHS = (768, 4096)  # a small and a large width; M = args.host_layers_m tokens (host-bound)


class Projections(nn.Module):
    """An attention's q / k / v projections of one input (GQA: k and v a quarter of q's width),
    bias-free as Llama's: what fuse_qkv_projections turns into one FusedQKV."""

    def __init__(self, d, device, dtype):
        super().__init__()
        self.q_proj = nn.Linear(d, d, bias=False, device=device, dtype=dtype)
        self.k_proj = nn.Linear(d, d // 4, bias=False, device=device, dtype=dtype)
        self.v_proj = nn.Linear(d, d // 4, bias=False, device=device, dtype=dtype)

    def forward(self, x):
        return self.q_proj(x), self.k_proj(x), self.v_proj(x)


def _host_layer_pairs(d, device, dtype):
    """[(name, unfused module, fused module)] of the same weights, for one width d."""
    from bench.gated import EagerGatedMLP  # noqa: PLC0415  (bench.gated imports this module)
    from fused_dense import FusedDense, FusedGatedMLP, fuse_qkv_projections  # noqa: PLC0415
    lin = nn.Linear(d, d, device=device, dtype=dtype)
    fd = FusedDense(d, d, device=device, dtype=dtype)
    fd.load_state_dict(lin.state_dict())
    mlp = EagerMLP(d, 4 * d, "gelu_approx", device, dtype)
    fmlp = make_module("auto_l0", mlp, "gelu_approx", d, 4 * d, device, dtype)
    hg = 8 * d // 3 // 64 * 64
    gated = EagerGatedMLP(d, hg, "swiglu", device, dtype)
    fgated = FusedGatedMLP(d, hg, activation="swiglu", device=device, dtype=dtype)
    fgated.load_state_dict(gated.state_dict())
    qkv = Projections(d, device, dtype)
    fqkv = copy.deepcopy(qkv)
    fuse_qkv_projections(fqkv)
    return [("linear", lin, fd), ("mlp", mlp, fmlp), ("gated", gated, fgated), ("qkv", qkv, fqkv)]


def run_host_layers(ctx, item_id):
    """Host CPU time and allocations per forward + backward of each fused layer against the module it
    replaces (FusedDense / nn.Linear, FusedMLP / nn.Linear MLP, FusedGatedMLP / LlamaMLP-shaped
    nn.Linear gated MLP), at a small and a large width, few tokens so the host is the bottleneck.
    The two alternate round after round; the ratio is taken within each round."""
    # 20 steps a block: few enough launches (< 1024) that a GPU-bound width never fills the launch
    # queue, whose wait would count as host time
    M, n_iter, rounds, dtype = ctx.args.host_layers_m, 20, 15, torch.bfloat16
    rec = ctx.results["host_layers"] = {
        "id": item_id, "M": M, "dtype": "bf16", "iters": n_iter, "rounds": rounds, "layers": [],
        "method": "time.process_time() (all host threads) over N forward + backward steps issued without "
                  "synchronization, the unfused and the fused module alternating in each round; allocations: "
                  "the caching allocator's allocation count a step (torch.cuda.memory_stats)"}
    ctx.seed(item_id)
    for d in HOST_LAYER_WIDTHS if ctx.cuda else (64,):
        x = ctx.randn(M, d, dtype=dtype).requires_grad_(True)
        dy = ctx.randn(M, d, dtype=dtype)
        ctx.begin(item_id, f"host_layers d={d}", "fused layers")
        try:
            for name, plain, fused in _host_layer_pairs(d, ctx.device, dtype):
                grads = [ctx.randn(M, n, dtype=dtype) for n in (d, d // 4, d // 4)] if name == "qkv" else dy
                steps = {"unfused": _stepper(plain, x, grads), "fused": _stepper(fused, x, grads)}
                allocs = {}
                for k, step in steps.items():
                    for _ in range(20):
                        step()
                    if ctx.cuda:
                        ctx.sync()
                        a0 = torch.cuda.memory_stats(ctx.device).get("allocation.all.allocated", 0)
                        for _ in range(10):
                            step()
                        ctx.sync()
                        allocs[k] = (torch.cuda.memory_stats(ctx.device).get("allocation.all.allocated", 0) - a0) / 10
                times = _cpu_us_rounds(ctx, steps, rounds, n_iter)
                ratios_ = [f / u for f, u in zip(times["fused"], times["unfused"])]
                row = {"layer": name, "d": d, "cpu_us": {k: statistics.median(v) for k, v in times.items()},
                       "cpu_us_all": times, "x_unfused": statistics.median(ratios_),
                       "x_unfused_range": [min(ratios_), max(ratios_)], "allocations": allocs}
                rec["layers"].append(row)
                log(f"host layers d={d} {name}: unfused {row['cpu_us']['unfused']:.1f} us, fused "
                    f"{row['cpu_us']['fused']:.1f} us ({row['x_unfused']:.3f}x), allocations a step {allocs}")
        except Exception as exc:  # noqa: BLE001
            rec["layers"].append({"d": d, "status": "error", "error": errstr(exc)})
            log(f"host layers d={d}: error ({errstr(exc)})")
            ctx.check_cuda(exc)
        ctx.end()
        ctx.save()
    ctx.free()


def _stepper(mod, x, dy, forward=None):
    """A forward + backward step of mod: mod(x), or forward(mod, x) where given; dy a list: the
    gradients of the outputs mod returns (q / k / v), else of its first."""
    params = list(mod.parameters())

    def step():
        for t in params + [x]:
            t.grad = None
        out = mod(x) if forward is None else forward(mod, x)
        if isinstance(dy, list):
            torch.autograd.backward(list(out), dy)
        else:
            first(out).backward(dy)
    return step


def _python_function_mlp(mod, x):
    """FusedMLP's forward through the Python autograd.Function (FusedMLPFunc, the tensor-parallel
    path) instead of the op with its C++ autograd, for the host-time comparison."""
    out = fd_functional.FusedMLPFunc.apply(x.reshape(-1, x.shape[-1]), mod.fc1.weight, mod.fc1.bias,
                                           mod.fc2.weight, mod.fc2.bias, "gelu_approx", True, False, 0,
                                           "auto", None, True)
    return out.reshape(*x.shape[:-1], out.shape[-1])


def _cpu_us_rounds(ctx, steps, rounds, n_iter):
    """{key: [host CPU µs a step, per round]}: each of steps ({key: step}) runs n_iter times in each
    round, in turn, timed by time.process_time() between synchronizations."""
    times = {k: [] for k in steps}
    for _ in range(rounds):
        for k, step in steps.items():
            ctx.sync()
            c0 = time.process_time()
            for _ in range(n_iter):
                step()
            times[k].append((time.process_time() - c0) / n_iter * 1e6)
            ctx.sync()
    return times


def host_interleaved(ctx, eager, x, dy, d, h, dtype, rounds=15, n_iter=100):
    """Eager, FusedMLP('auto') through the C++ autograd op and through the Python autograd.Function,
    alternating round after round so a change in the host's speed hits all alike; the ratio to
    eager is taken within each round."""
    fused = make_module("auto_l0", eager, "gelu_approx", d, h, ctx.device, dtype)
    steps = {"eager": _stepper(eager, x, dy), "auto_l0": _stepper(fused, x, dy),
             "auto_l0_python_function": _stepper(fused, x, dy, _python_function_mlp)}
    for step in steps.values():
        for _ in range(20):
            step()
    times = _cpu_us_rounds(ctx, steps, rounds, n_iter)
    res = {"status": "ok", "rounds": rounds, "iters": n_iter, "native_op": True,
           "method": "time.process_time() per forward + backward; the variants alternate within each of the "
                     "rounds; medians over rounds, and the median of the per-round ratios to eager",
           "cpu_us": {k: statistics.median(v) for k, v in times.items()}, "cpu_us_all": times,
           "x_eager": {k: statistics.median(a / b for a, b in zip(v, times["eager"])) for k, v in times.items()}}
    log("host interleaved: " + ", ".join(f"{k} {res['cpu_us'][k]:.1f} us ({res['x_eager'][k]:.3f}x eager)"
                                         for k in times))
    return res
