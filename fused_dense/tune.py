"""Measures 'auto''s choices for MLP widths at the representative token counts and writes them as
a table of choices (the format of the tuning cache file), such as the one shipped in
fused_dense/tuning_tables/choices.txt:

    python -m fused_dense.tune --out fused_dense/tuning_tables/choices.txt

Each item is one forward + backward of FusedMLP(d, 4d) (biases on, as the module's default) or,
with --gated, FusedGatedMLP(d, h) for the --gated-hidden widths, at a representative token count
(fused_dense.tuning.representatives), which measures its problems (forward, data and weight
gradients of both GEMMs) the way the runtime measures, with a longer per-problem budget. With
--fp8 the same modules run once more in bf16 with fp8=Float8Recipe() (current scaling, the
default size rule: widths d below its min_features stay bf16 and are left out), which measures
their FP8 GEMMs (fp8_linear's keys; a weight gradient's is the token count itself); --fp8-only
runs those alone, so a table's bf16 and fp16 lines stay as they were measured. Widths,
dtypes, activations and the token range are options; --minutes bounds the sitting (the items are
ordered so that what is cut is the largest token counts of the last dtype). The output is merged
with the lines already in --out, so a table can be measured in pieces (other widths, dtypes or
token ranges) that merge. A table only serves GPUs of the compute capability and cuBLASLt
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
GATED = ("swiglu", "geglu")


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m fused_dense.tune", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="table to write (merged with its existing lines unless --fresh)")
    p.add_argument("--dims", type=int, nargs="+", default=list(DEFAULT_DIMS), help="model widths d (hidden 4d)")
    p.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    p.add_argument("--activations", nargs="*", default=["gelu_approx", "relu"],
                   choices=["gelu_approx", "relu", "sqrelu"])
    p.add_argument("--min-tokens", type=int, default=1)
    p.add_argument("--max-tokens", type=int, default=65536)
    p.add_argument("--max-tflop", type=float, default=2.5,
                   help="skip items whose fc1 GEMM exceeds this many TFLOP (2 M d h; gated: 2 M d 2h, "
                        "gate and up in one GEMM): the largest token counts at the largest widths")
    p.add_argument("--min-tflop", type=float, default=0.0,
                   help="skip items whose fc1 GEMM is at most this many TFLOP (extends a table measured "
                        "with --max-tflop of that value)")
    p.add_argument("--gated", nargs="*", default=[], choices=list(GATED),
                   help="also measure FusedGatedMLP with these activations (hidden from --gated-hidden)")
    p.add_argument("--gated-hidden", nargs="+", default=["8/3", "3.5"],
                   help="gated hidden widths as multiples of d: 8/3 (Llama's 8/3 d rounded up to a multiple "
                        "of 256), 3.5, or any number")
    p.add_argument("--fp8", action="store_true",
                   help="also measure the bf16 items in FP8 (Float8Recipe(): current scaling, the default size "
                        "rule), for the FP8 GEMMs' choices")
    p.add_argument("--fp8-only", action="store_true",
                   help="measure the FP8 items alone (implies --fp8): adds the FP8 GEMMs' lines to --out and "
                        "leaves its other lines as they are")
    p.add_argument("--buckets", type=int, default=4, choices=[1, 2, 4, 8],
                   help="representatives per octave of M (4: the grid 'auto' uses by default)")
    p.add_argument("--problem-budget-ms", type=float, default=1000.0,
                   help="measuring time per problem (the runtime's default is 100)")
    p.add_argument("--minutes", type=float, default=25.0, help="stop starting items after this long")
    p.add_argument("--fresh", action="store_true", help="drop the existing lines of --out")
    args = p.parse_args(argv)
    args.fp8 = args.fp8 or args.fp8_only
    for name in ("min_tokens", "max_tokens"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.min_tokens > args.max_tokens:
        p.error(f"--min-tokens ({args.min_tokens}) must be <= --max-tokens ({args.max_tokens})")
    if any(d < 1 for d in args.dims):
        p.error(f"--dims must be positive, got {args.dims}")
    return args


def gated_hidden(d, spec):
    """The gated hidden width for model width d: '8/3' is Llama's rule (8/3 d rounded up to a
    multiple of 256), a number r gives r * d rounded to a multiple of 256."""
    if spec == "8/3":
        return -(-8 * d // 3 // 256) * 256
    return max(256, round(float(spec) * d / 256) * 256)


def fc1_tflop(tokens, d, hidden, gated):
    """The fc1 GEMM's TFLOP: [tokens, d] times [d, hidden], or [d, 2 hidden] where gate and up are
    one GEMM (gated). --min-tflop / --max-tflop compare this, as the shipped table's rule for
    long problems does (docs/contract.md)."""
    return 2.0 * tokens * d * hidden * (2 if gated else 1) / 1e12


def work_items(args):
    from fused_dense import tuning
    previous = tuning.configure(buckets=args.buckets)
    try:
        return _work_items(args)
    finally:
        tuning.configure(**previous)


def _work_items(args):
    from fused_dense import tuning
    from fused_dense.fp8 import DEFAULT_MIN_FEATURES
    items = []
    reps = tuning.representatives(args.min_tokens, args.max_tokens)
    for dtype in args.dtypes:
        for d in args.dims:
            kinds = [(act, 4 * d) for act in args.activations]
            kinds += [(act, gated_hidden(d, spec)) for act in args.gated for spec in args.gated_hidden]
            fp8 = ([] if args.fp8_only else [False]) + (
                [True] if args.fp8 and dtype == "bfloat16" and d >= DEFAULT_MIN_FEATURES else [])
            for act, hidden in dict.fromkeys(kinds):
                for rep in reps:
                    if args.min_tflop < fc1_tflop(rep, d, hidden, act in GATED) <= args.max_tflop:
                        items += [(dtype, d, act, hidden, rep, f) for f in fp8]
    # smallest work first within each dtype (FP8 after bf16): a sitting cut short loses the largest
    order = {dt: i for i, dt in enumerate(args.dtypes)}
    items.sort(key=lambda it: (order[it[0]], it[5], it[4] * it[1] * it[3]))
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
    from fused_dense import Float8Recipe, FusedGatedMLP, FusedMLP, tuning
    if not (fused_dense.has_cuda_kernels() and torch.cuda.is_available()):
        sys.exit("python -m fused_dense.tune: needs a CUDA build of fused_dense and a GPU")
    if args.fp8 and torch.cuda.get_device_capability() < (8, 9):
        sys.exit("python -m fused_dense.tune: --fp8 needs a GPU of compute capability 8.9 or later")
    items = work_items(args)
    if args.fp8_only and not items:
        from fused_dense.fp8 import DEFAULT_MIN_FEATURES
        sys.exit(f"python -m fused_dense.tune: --fp8-only measures bfloat16 widths d >= {DEFAULT_MIN_FEATURES} (the "
                 f"FP8 size rule) in the token range; --dtypes {args.dtypes} and --dims {args.dims} give none")
    fd, scratch = tempfile.mkstemp(prefix="fused_dense_tune_", suffix=".txt")
    os.close(fd)
    previous = tuning.configure(enabled=True, budget_s=1e9, pace=1.0, problem_budget_ms=args.problem_budget_ms,
                                buckets=args.buckets, cache=scratch, table="", deterministic=False)
    device = torch.device("cuda")
    print(f"fused_dense.tune: {len(items)} items on {torch.cuda.get_device_name(device)}, "
          f"at most {args.minutes:g} min", flush=True)
    t0 = time.perf_counter()
    done = 0
    try:
        modules = {}
        for i, (dtype_name, d, act, hidden, rep, fp8) in enumerate(items):
            elapsed = time.perf_counter() - t0
            if elapsed > args.minutes * 60:
                print(f"fused_dense.tune: --minutes reached after {done} of {len(items)} items", flush=True)
                break
            key = (dtype_name, d, act, hidden, fp8)
            if key not in modules:
                modules.clear()  # one module at a time: the widest take GiBs
                torch.manual_seed(0)
                kind = FusedGatedMLP if act in GATED else FusedMLP
                modules[key] = kind(d, hidden, activation=act, device=device, dtype=DTYPES[dtype_name],
                                    fp8=Float8Recipe() if fp8 else None)
            mlp = modules[key]
            x = torch.randn(rep, d, device=device, dtype=DTYPES[dtype_name], requires_grad=True)
            t_item = time.perf_counter()
            out = mlp(x)
            out.backward(torch.randn_like(out))
            torch.cuda.synchronize()
            done += 1
            eta = (time.perf_counter() - t0) / done * (len(items) - done)
            print(f"[{done}/{len(items)}] {dtype_name}{' FP8' if fp8 else ''} d={d} h={hidden} {act} M={rep}: "
                  f"{time.perf_counter() - t_item:.2f} s "
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
        f.write(f"# on {torch.cuda.get_device_name(device)}; line: tag, key (op dtype representative-M K N activation "
                "flag flag tf32 representatives-per-octave), choice (fused algorithm cutlass has_algo, 8 words of the algorithm)\n")
        f.write("\n".join(table) + ("\n" if table else ""))
    stats = tuning.stats()
    print(f"fused_dense.tune: {len(lines)} choices measured in {time.perf_counter() - t0:.0f} s "
          f"({stats['measuring_s']:.0f} s measuring); {len(table)} lines in {args.out}", flush=True)


if __name__ == "__main__":
    main()
