"""Measures 'auto''s choices for FusedMLP widths across the token-count buckets and writes them as
a table of choices (the format of the tuning cache file), such as the one shipped in
fused_dense/tuning_tables/choices.txt:

    python -m fused_dense.tune --out fused_dense/tuning_tables/choices.txt

Each item is one forward + backward of FusedMLP(d, 4d) (biases on, as the module's default) at a
bucket's representative token count, which measures its six problems (fc1 and fc2 forward, both
data gradients, both weight gradients). Widths, dtypes, activations and the token range are
options; --minutes bounds the sitting (the items are ordered so that what is cut is the largest
token counts of the last dtype). A table only serves GPUs of the compute capability and cuBLASLt
major.minor it was measured with (its lines' tag); regenerate it on each.
"""
import argparse
import math
import os
import sys
import tempfile
import time

import torch

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}
DEFAULT_DIMS = (768, 1024, 1536, 2048, 2560, 4096, 5120, 8192)


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m fused_dense.tune", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="table to write (merged with its existing lines unless --fresh)")
    p.add_argument("--dims", type=int, nargs="+", default=list(DEFAULT_DIMS), help="model widths d (hidden 4d)")
    p.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    p.add_argument("--activations", nargs="+", default=["gelu_approx", "relu"],
                   choices=["gelu_approx", "relu", "sqrelu"])
    p.add_argument("--min-tokens", type=int, default=1)
    p.add_argument("--max-tokens", type=int, default=65536)
    p.add_argument("--max-tflop", type=float, default=2.5,
                   help="skip items whose fc1 GEMM exceeds this many TFLOP (2 M d 4d): the largest "
                        "token counts at the largest widths")
    p.add_argument("--min-tflop", type=float, default=0.0,
                   help="skip items whose fc1 GEMM is at most this many TFLOP (extends a table measured "
                        "with --max-tflop of that value)")
    p.add_argument("--buckets", type=int, default=2, choices=[1, 2, 4, 8],
                   help="buckets per octave of M (2: the grid 'auto' uses by default)")
    p.add_argument("--problem-budget-ms", type=float, default=120.0, help="measuring time per problem")
    p.add_argument("--minutes", type=float, default=25.0, help="stop starting items after this long")
    p.add_argument("--fresh", action="store_true", help="drop the existing lines of --out")
    args = p.parse_args(argv)
    for name in ("min_tokens", "max_tokens"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.min_tokens > args.max_tokens:
        p.error(f"--min-tokens ({args.min_tokens}) must be <= --max-tokens ({args.max_tokens})")
    if any(d < 1 for d in args.dims):
        p.error(f"--dims must be positive, got {args.dims}")
    return args


def bucket_representatives(lo, hi, per_octave):
    """The representative token counts of the buckets that meet [lo, hi], in order (the buckets
    are csrc/core/tuning/tuner.h's, on the current grid: probing next to each boundary 2^(i/b) finds
    every one)."""
    from fused_dense import tuning
    probes = {lo, hi}
    i = 0
    while 2 ** (i / per_octave) <= hi:
        for m in (math.floor(2 ** (i / per_octave)), math.ceil(2 ** (i / per_octave))):
            if lo <= m <= hi:
                probes.add(m)
        i += 1
    reps = []
    for m in sorted(probes):
        rep = tuning.m_bucket(m)[1]
        if rep not in reps:
            reps.append(rep)
    return reps


def work_items(args):
    from fused_dense import tuning
    previous = tuning.configure(buckets=args.buckets)
    try:
        return _work_items(args)
    finally:
        tuning.configure(**previous)


def _work_items(args):
    items = []
    for dtype in args.dtypes:
        for d in args.dims:
            for act in args.activations:
                for rep in bucket_representatives(args.min_tokens, args.max_tokens, args.buckets):
                    if args.min_tflop < 2.0 * rep * d * 4 * d / 1e12 <= args.max_tflop:
                        items.append((dtype, d, act, rep))
    # smallest work first within each dtype: a sitting cut short loses the largest items
    order = {dt: i for i, dt in enumerate(args.dtypes)}
    items.sort(key=lambda it: (order[it[0]], it[3] * it[1] * it[1]))
    return items


def read_lines(path):
    if not os.path.isfile(path):
        return []
    with open(path) as f:
        return [line.rstrip("\n") for line in f if line.strip() and not line.startswith("#")]


def merge(lines):
    """One line per (tag, key): the last one read wins."""
    merged = {}
    for line in lines:
        words = line.split()
        merged[tuple(words[:11])] = line
    return [merged[k] for k in sorted(merged)]


def main(argv=None):
    args = parse_args(argv)
    import fused_dense
    from fused_dense import FusedMLP, tuning
    if not (fused_dense.has_cuda_kernels() and torch.cuda.is_available()):
        sys.exit("python -m fused_dense.tune: needs a CUDA build of fused_dense and a GPU")
    items = work_items(args)
    fd, scratch = tempfile.mkstemp(prefix="fused_dense_tune_", suffix=".txt")
    os.close(fd)
    previous = tuning.configure(enabled=True, budget_s=1e9, pace=1.0, problem_budget_ms=args.problem_budget_ms,
                                buckets=args.buckets, cache=scratch, table="")
    device = torch.device("cuda")
    print(f"fused_dense.tune: {len(items)} items on {torch.cuda.get_device_name(device)}, "
          f"at most {args.minutes:g} min", flush=True)
    t0 = time.perf_counter()
    done = 0
    try:
        modules = {}
        for i, (dtype_name, d, act, rep) in enumerate(items):
            elapsed = time.perf_counter() - t0
            if elapsed > args.minutes * 60:
                print(f"fused_dense.tune: --minutes reached after {done} of {len(items)} items", flush=True)
                break
            key = (dtype_name, d, act)
            if key not in modules:
                modules.clear()  # one module at a time: the widest take GiBs
                torch.manual_seed(0)
                modules[key] = FusedMLP(d, 4 * d, activation=act, device=device, dtype=DTYPES[dtype_name])
            mlp = modules[key]
            x = torch.randn(rep, d, device=device, dtype=DTYPES[dtype_name], requires_grad=True)
            t_item = time.perf_counter()
            out = mlp(x)
            out.backward(torch.randn_like(out))
            torch.cuda.synchronize()
            done += 1
            eta = (time.perf_counter() - t0) / done * (len(items) - done)
            print(f"[{done}/{len(items)}] {dtype_name} d={d} {act} M={rep}: {time.perf_counter() - t_item:.2f} s "
                  f"(elapsed {time.perf_counter() - t0:.0f} s, at most {eta:.0f} s left)", flush=True)
            del x, out
    finally:
        tuning.configure(**previous)
    lines = read_lines(scratch)
    os.unlink(scratch)
    old = [] if args.fresh else read_lines(args.out)
    table = merge(old + lines)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        f.write("# fused_dense tuning table: heuristic='auto' choices measured by python -m fused_dense.tune\n")
        f.write(f"# on {torch.cuda.get_device_name(device)}; line: tag, key (op dtype bucket K N activation "
                "flag flag tf32 buckets-per-octave), choice (fused algorithm cutlass has_algo, 8 words of the algorithm)\n")
        f.write("\n".join(table) + ("\n" if table else ""))
    stats = tuning.stats()
    print(f"fused_dense.tune: {len(lines)} choices measured in {time.perf_counter() - t0:.0f} s "
          f"({stats['measuring_s']:.0f} s measuring); {len(table)} lines in {args.out}", flush=True)


if __name__ == "__main__":
    main()
