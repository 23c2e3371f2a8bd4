"""fp8_quantize's passes one at a time, each called as the FP8 MLPs call it: x's quantize, the
plain MLP's activation cast forward (with and without pre's e4m3 copy, `save_pre_fp8`) and its
gradient cast backward (from pre in bf16, and from pre's e4m3 copy in place), and the same for the
gated MLP (gu, the packed gate / up pre-activation). Each case with the scale given (the cast
pass alone) and with current scaling (the amax pass, then the cast).

    python tools/quantize_passes.py [--rows R] [--hidden H] [--gated gelu,swiglu] [--cases SUBSTR,...]
    python tools/quantize_passes.py --label A --jsonl F; ... --label B --jsonl F; ...
    python tools/quantize_passes.py --compare F

Per case: the median ms over --rounds interleaved rounds (bench.timing.Bench.interleaved, the L2
cache flushed before each call). The rows are the tokens; x has --d columns, the plain MLP's
pre-activation --hidden, the gated MLP's gu 2 x --hidden (gate and up) and the gradient its
backward cast reads (d_h) --hidden.

Two builds of the library (a change to a kernel against the code before it): run each in a
process of its own with its own --label, appending to one --jsonl file, alternating A, B, A, B;
--compare prints each case's median per label and each later label's ratio to the first.
The flags mirror csrc/torch/autograd/mlp_fp8.cpp's calls (rowwise / columnwise copies, the bias
gradient's column sums only where the MLP has fc1's bias: the plain MLP); a case alone is not the
step (tools/fp8_path_profile.py profiles the steps).
"""
import argparse
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import fused_dense  # noqa: E402
from fused_dense import ops  # noqa: E402
from bench.timing import Bench  # noqa: E402


def cases(rows, d, hidden, plain_act, gated_act, device):
    """{name: fn} of the passes at these sizes, inputs made once (fresh random, seeded)."""
    q, qg = torch.ops.fused_dense.fp8_quantize, torch.ops.fused_dense.fp8_quantize_grad_
    e4m3, e5m2 = ops.FP8_FORMATS["e4m3"], ops.FP8_FORMATS["e5m2"]
    bf16 = torch.bfloat16
    g = torch.Generator(device=device).manual_seed(rows * 31 + hidden)

    def randn(*shape, scale=1.0):
        return torch.randn(*shape, dtype=bf16, device=device, generator=g) * scale

    def e4m3_copy(t):
        data, _, _, scale_inv, _, _ = q(t, None, 0, False, e4m3, None, True, False, False)
        return data, scale_inv

    out = {}
    x = randn(rows, d)
    out["x"] = lambda s: q(x, None, 0, False, e4m3, s, True, True, False)
    for family, act, cols in (("plain", plain_act, hidden), ("gated", gated_act, 2 * hidden)):
        code = ops.ACTIVATIONS[act]
        grad_cols = cols // 2 if family == "gated" else cols
        pre = randn(rows, cols, scale=2.0)
        grad = randn(rows, grad_cols)
        pre8, pre8_si = e4m3_copy(pre)
        copy = torch.empty(rows, cols, dtype=torch.float8_e4m3fn, device=device)
        copy_si = torch.empty((), dtype=torch.float32, device=device)
        sums = family == "plain"  # fc1's bias gradient: the plain MLP has fc1's bias, the gated one none
        # in place the gradient's bytes replace pre8's: e5m2 bytes (finite, saturated) read as e4m3
        # are finite too, so the calls after the first read finite values
        in_place = pre8.clone()
        out[f"{family} {act} fwd"] = (
            lambda s, pre=pre, code=code: q(pre, None, code, False, e4m3, s, True, True, False))
        out[f"{family} {act} fwd + pre's e4m3 copy"] = (
            lambda s, pre=pre, code=code, copy=copy, copy_si=copy_si:
            q(pre, None, code, False, e4m3, s, True, False, False, None, copy, copy_si))
        out[f"{family} {act} bwd"] = (
            lambda s, grad=grad, pre=pre, code=code, sums=sums: q(grad, pre, code, True, e5m2, s, True, False, sums))
        out[f"{family} {act} bwd from e4m3 pre"] = (
            lambda s, grad=grad, pre8=pre8, si=pre8_si, code=code, sums=sums:
            q(grad, pre8, code, True, e5m2, s, True, False, sums, si))
        out[f"{family} {act} bwd from e4m3 pre, in place"] = (
            lambda s, grad=grad, buf=in_place, si=pre8_si, code=code, sums=sums: qg(buf, grad, code, e5m2, s, sums, si))
    return out


def compare(path):
    """Each case's median ms per label (over the runs of that label), the later labels' ratios."""
    runs = [json.loads(line) for line in open(path) if line.strip()]
    if not runs:
        raise SystemExit(f"--compare: no runs in {path}")
    labels = list(dict.fromkeys(r["label"] for r in runs))
    names = list(dict.fromkeys(n for r in runs for n in r["ms"]))
    w = max(len(n) for n in names) + 2
    lines = [f"{'case':{w}}" + "".join(f"{lab[:14]:>15}" for lab in labels)
             + "".join(f"{(lab[:9] + '/' + labels[0][:5]):>16}" for lab in labels[1:])]
    for n in names:
        med = {}
        for lab in labels:
            vals = [v for r in runs if r["label"] == lab for v in r["ms"].get(n, [])]
            med[lab] = statistics.median(vals) if vals else None
        cells = "".join(f"{med[lab]:15.4f}" if med[lab] is not None else f"{'-':>15}" for lab in labels)
        base = med[labels[0]]
        ratios = "".join(f"{med[lab] / base:16.3f}" if base and med[lab] is not None else f"{'-':>16}"
                         for lab in labels[1:])
        lines.append(f"{n:{w}}{cells}{ratios}")
    counts = ", ".join(f"{lab}: {sum(r['label'] == lab for r in runs)} runs" for lab in labels)
    print(f"median ms of each case over its label's runs and rounds ({counts})")
    print("\n".join(lines))
    return lines


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=16384, help="tokens (default 16384)")
    p.add_argument("--d", type=int, default=4096, help="x's columns (default 4096)")
    p.add_argument("--hidden", type=int, default=14336, help="the MLP's hidden width (default 14336)")
    p.add_argument("--plain", default="gelu_approx", help=f"the plain MLP's activation ({', '.join(ops.MLP_ACTIVATIONS)})")
    p.add_argument("--gated", default="swiglu", help=f"the gated MLP's ({', '.join(ops.GATED_ACTIVATIONS)})")
    p.add_argument("--cases", default=None, help="comma list of substrings: only the cases whose name holds one")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--device", default="cuda", help="cuda, or cpu (the reference kernels: a smoke run, no timing)")
    p.add_argument("--label", default="this", help="the library's name in --jsonl (e.g. its commit)")
    p.add_argument("--jsonl", default=None, help="append this run's per-round ms to FILE")
    p.add_argument("--compare", metavar="FILE", default=None, help="print the runs in FILE side by side, time nothing")
    args = p.parse_args(argv)
    if args.compare:
        return args
    if args.plain not in ops.MLP_ACTIVATIONS:
        p.error(f"--plain: expected one of {ops.MLP_ACTIVATIONS}, got {args.plain!r}")
    if args.gated not in ops.GATED_ACTIVATIONS:
        p.error(f"--gated: expected one of {ops.GATED_ACTIVATIONS}, got {args.gated!r}")
    for name in ("rows", "d", "hidden", "rounds"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.d % 16 or args.hidden % 16:
        p.error(f"--d and --hidden must be multiples of 16 (the FP8 copies' layout), got {args.d} and {args.hidden}")
    if args.device == "cuda" and not (torch.cuda.is_available() and fused_dense.has_cuda_kernels()):
        p.error("--device cuda needs a GPU and the library's CUDA kernels (--device cpu: a smoke run)")
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.compare:
        compare(args.compare)
        return 0
    device = torch.device(args.device)
    fns = cases(args.rows, args.d, args.hidden, args.plain, args.gated, device)
    if args.cases:
        wanted = args.cases.split(",")
        fns = {n: f for n, f in fns.items() if any(w in n for w in wanted)}
        if not fns:
            raise SystemExit(f"--cases {args.cases!r}: no case's name holds any of them")
    scale = torch.tensor(0.5, dtype=torch.float32, device=device)
    timed = {}
    for n, f in fns.items():
        timed[f"{n}: cast"] = (lambda f=f: f(scale), None)
        timed[f"{n}: current"] = (lambda f=f: f(None), None)
    bench = Bench(device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"{name}; {args.rows} rows, d {args.d}, hidden {args.hidden}; {bench.method}, {args.rounds} interleaved "
          f"rounds; label {args.label}", flush=True)
    res = bench.interleaved(timed, args.rounds,
                            progress=lambda r, n: print(f"  round {r} of {n} done", flush=True))
    failed = {k: v["error"] for k, v in res.items() if "error" in v}
    if failed:
        raise SystemExit(f"cases that raised: {failed}")
    print(f"{'case':56} {'median ms':>10} {'rounds':>24}")
    for k, v in res.items():
        print(f"{k:56} {v['ms']:10.4f} {' '.join(f'{x:.4f}' for x in v['round_ms']):>24}")
    if args.jsonl:
        with open(args.jsonl, "a") as f:
            f.write(json.dumps({"label": args.label, "device": name, "rows": args.rows, "d": args.d,
                                "hidden": args.hidden, "plain": args.plain, "gated": args.gated,
                                "ms": {k: v["round_ms"] for k, v in res.items()}}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
