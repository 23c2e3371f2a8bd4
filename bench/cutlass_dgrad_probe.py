"""Would a GEMM of our own with the GELU backward in its epilogue close #5's gap at d = 1024?

fc2's data gradient is where fused_dense loses most to the plain-GEMM floor: a cuBLASLt GEMM
writes d_act [M, 4d], then the library's elementwise pass reads it back with the pre-activation,
writes d_pre and reduces fc1's bias gradient (cuBLASLt's own DGELU_BGRAD epilogue is slower still,
session 4). This probe times, in alternating rounds (order rotated per round), per shape:
  floor    torch.mm(dY, W2): the GEMM alone, writing d_act
  ours     fused_dense.ops.act_linear_dgrad(..., 'gelu_approx', has_d_bias=True, 'auto')
  cutlassC/S/R  bench/cutlass_dgrad: one CUTLASS 3 sm_90a GEMM whose epilogue reads pre_act,
           applies fused_dense's GELU derivative in fp32 and reduces the bias gradient; C the tile
           config, S/R the tile scheduler's swizzle and raster order (--schedules); config 3 is
           the same GEMM with a plain epilogue (CUTLASS's own floor, not checked), configs 5
           and 6 leave out the bias reduction (d_pre checked only)
and checks every variant against a float64 reference (relative error of d_pre and d_bias), with
the outputs' memory poisoned with NaN first so an unwritten element shows.

    python bench/cutlass_dgrad/build.py            # once, on a machine with nvcc (sm_90a)
    python bench/cutlass_dgrad_probe.py [--shapes 8192x1024 ...] [--schedules 1:0 8:2] [--rounds 5] [--json out.json]
"""
import argparse
import json
import math
import os
import statistics
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import fused_dense  # noqa: E402
from fused_dense import ops  # noqa: E402

DEFAULT_LIB = os.path.join(ROOT, ".prebuilt_probe", "fused_dense_cutlass_probe.so")


def gelu_approx_grad_f64(p):
    k0, k1 = math.sqrt(2.0 / math.pi), 0.044715
    t = torch.tanh(k0 * (p + k1 * p ** 3))
    return 0.5 * (1 + t) + 0.5 * p * (1 - t * t) * k0 * (1 + 3 * k1 * p * p)


def rel(out, ref):
    return ((out.double() - ref).norm() / ref.norm()).item()


def poisoned_call(fn, nbytes):
    """fn() with the caching allocator's free blocks of that size filled with NaN first, so an
    output element the kernel leaves unwritten is NaN, not a stale correct-looking value."""
    junk = torch.full((nbytes // 2 + 64,), float("nan"), dtype=torch.bfloat16, device="cuda")
    del junk
    return fn()


def time_rounds(variants, rounds, reps):
    """Median ms per call per variant over rounds; each round runs every variant reps times."""
    names = list(variants)
    per = {n: [] for n in names}
    for r in range(rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for n in order:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(reps):
                variants[n]()
            end.record()
            end.synchronize()
            per[n].append(start.elapsed_time(end) / reps)
    return {n: statistics.median(v) for n, v in per.items()}, per


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="+", default=["8192x1024", "8192x2048", "8192x4096", "16384x8192"],
                    help="M tokens x d; fc2 maps 4d -> d")
    ap.add_argument("--schedules", nargs="+", default=["1:0", "8:0", "8:1", "8:2"],
                    help="SWIZZLE:RASTER pairs (raster 0 heuristic, 1 along M, 2 along N)")
    ap.add_argument("--configs", nargs="+", type=int, default=None, help="default: all")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=6)
    ap.add_argument("--lib", default=DEFAULT_LIB)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.ops.load_library(args.lib)
    probe = torch.ops.fused_dense_probe
    configs = args.configs if args.configs is not None else list(range(probe.num_configs()))
    schedules = [tuple(int(v) for v in spec.split(":")) for spec in args.schedules]
    unfused = {c for c in configs if "not fused" in probe.config_name(c)}
    no_bias = {c for c in configs if "no bias" in probe.config_name(c)}
    print("GPU", torch.cuda.get_device_name(), "torch", torch.__version__, "CUDA", torch.version.cuda)
    print("fused_dense CUDA kernels:", fused_dense.has_cuda_kernels())
    results = []
    for spec in args.shapes:
        M, d = (int(v) for v in spec.split("x"))
        h = 4 * d
        torch.manual_seed(hash(spec) % 1000 + int.from_bytes(os.urandom(2), "little"))
        w2 = torch.randn(d, h, dtype=torch.bfloat16, device="cuda") / d ** 0.5
        g = torch.randn(M, d, dtype=torch.bfloat16, device="cuda")
        pre = torch.randn(M, h, dtype=torch.bfloat16, device="cuda")
        d_act = (g.double() @ w2.double())
        ref = d_act * gelu_approx_grad_f64(pre.double())
        del d_act
        ref_bias = ref.sum(0)
        variants = {
            "floor": lambda: torch.mm(g, w2),
            "ours": lambda: ops.act_linear_dgrad(w2, g, pre, "gelu_approx", True, "auto"),
        }
        for c in configs:
            for sw, ra in schedules:
                variants[f"cutlass{c}/{sw}/{ra}"] = (lambda c=c, sw=sw, ra=ra: probe.act_dgrad(w2, g, pre, c, sw, ra))
        row = {"shape": spec, "M": M, "d": d, "errors": {}, "failed": {}}
        for name, fn in variants.items():
            if name == "floor" or (name.startswith("cutlass") and int(name[7:].split("/")[0]) in unfused):
                continue
            try:
                out, bias = poisoned_call(fn, M * h * 2)
                torch.cuda.synchronize()
                errs = {"d_pre": rel(out, ref)}
                if not (name.startswith("cutlass") and int(name[7:].split("/")[0]) in no_bias):
                    errs["d_bias"] = rel(bias, ref_bias)
                row["errors"][name] = errs
            except RuntimeError as exc:  # a config CUTLASS refuses for this shape
                row["failed"][name] = str(exc).splitlines()[0]
        del ref, ref_bias
        for name in row["failed"]:
            variants.pop(name)
        for fn in variants.values():  # warm-up ('auto' tunes on its first call)
            fn()
        torch.cuda.synchronize()
        med, per = time_rounds(variants, args.rounds, args.reps)
        row["median_ms"] = med
        row["per_round_ms"] = per
        floor, ours = med["floor"], med["ours"]
        print(f"\n{spec} (fc2 data gradient: [{M}, {d}] x [{d}, {h}], GELU backward, bias gradient)")
        print(f"  {'variant':<14} {'median us':>10} {'/ floor':>8} {'/ ours':>8} {'err d_pre':>10} {'err d_bias':>10}")
        for name, ms in med.items():
            e = row["errors"].get(name, {})
            print(f"  {name:<14} {ms * 1e3:10.1f} {ms / floor:8.3f} {ms / ours:8.3f} "
                  f"{e.get('d_pre', float('nan')):10.2e} {e.get('d_bias', float('nan')):10.2e}")
        for name, why in row["failed"].items():
            print(f"  {name}: refused: {why}")
        results.append(row)
    names = {c: probe.config_name(c) for c in configs}
    print("\nconfigs:", "; ".join(f"cutlass{c} = {n}" for c, n in names.items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "cuda": torch.version.cuda, "configs": names, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
