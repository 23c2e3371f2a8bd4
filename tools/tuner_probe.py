#!/usr/bin/env python
"""The tuner's reading of a forward GEMM's candidates against the same choices timed on the call's
own tensors.

    python tools/tuner_probe.py                          # bf16 16384 x 8192 -> 32768, GELU
    python tools/tuner_probe.py --shape 8192 4096 16384 --input uniform
    PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync python tools/tuner_probe.py

First 'auto' measures linear_act (bias, saved pre-activation) at the exact M with the table and the
cache file off, and FUSED_DENSE_TUNING_VERBOSE=2 prints every candidate's median as the tuner read
it (stderr). Then 'auto' (the tuner's pick), the unfused path (-1) and cuBLASLt's fused algorithms
0 and 1 are timed on the call's tensors in interleaved rounds, each both the tuner's way (an L2
flush, one run between CUDA events) and back to back (--batch runs between events). If the
tuner's order of the candidates is not the order here, its measurement misleads it for this
shape. --input uniform fills the input as the tuner's operands are filled (uniform in [-1, 1));
normal is N(0, 1). The weight is N(0, 1/K) in both, the bias N(0, 1).
"""
import argparse
import os
import statistics
import sys

os.environ.setdefault("FUSED_DENSE_TUNING_VERBOSE", "2")

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", type=int, nargs=3, default=[16384, 8192, 32768], metavar=("M", "K", "N"),
                   help="tokens, in_features, out_features")
    p.add_argument("--dtype", choices=["bfloat16", "float16"], default="bfloat16")
    p.add_argument("--input", choices=["normal", "uniform"], default="normal")
    p.add_argument("--budget-ms", type=float, default=3000.0, help="the tuner's budget for the problem")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--batch", type=int, default=8, help="runs between events when timed back to back")
    args = p.parse_args(argv)
    if min(args.shape) < 1 or args.rounds < 1 or args.batch < 1:
        p.error(f"--shape, --rounds and --batch must be positive, got {args.shape}, {args.rounds}, {args.batch}")
    return args


def main(argv=None):
    args = parse_args(argv)
    import fused_dense
    from fused_dense import ops, tuning
    if not (fused_dense.has_cuda_kernels() and torch.cuda.is_available()):
        sys.exit("tools/tuner_probe.py: needs a CUDA build of fused_dense and a GPU")
    tuning.configure(enabled=True, budget_s=1e9, pace=1.0, problem_budget_ms=args.budget_ms, buckets=0,
                     cache="", table="")
    M, K, N = args.shape
    dev, dtype = torch.device("cuda"), getattr(torch, args.dtype)
    torch.manual_seed(0)
    if args.input == "uniform":
        x = (torch.rand(M, K, device=dev) * 2 - 1).to(dtype)
    else:
        x = torch.randn(M, K, device=dev, dtype=dtype)
    w = torch.randn(N, K, device=dev, dtype=dtype) * K ** -0.5
    b = torch.randn(N, device=dev, dtype=dtype)
    l2 = torch.cuda.get_device_properties(dev).L2_cache_size
    flush = torch.empty(2 * l2, dtype=torch.uint8, device=dev)

    def call(h):
        return ops.linear_act(x, w, b, "gelu_approx", True, h)

    call("auto")  # the tuner measures here (its verbose lines go to stderr)
    torch.cuda.synchronize()
    variants = ["auto", -1, 0, 1]
    isolated = {v: [] for v in variants}
    back_to_back = {v: [] for v in variants}
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for v in variants:
        call(v)
    for r in range(args.rounds):
        k = r % len(variants)
        for v in variants[k:] + variants[:k]:
            flush.fill_(r & 0xFF)
            start.record()
            call(v)
            stop.record()
            stop.synchronize()
            isolated[v].append(start.elapsed_time(stop))
            start.record()
            for _ in range(args.batch):
                call(v)
            stop.record()
            stop.synchronize()
            back_to_back[v].append(start.elapsed_time(stop) / args.batch)
    print(f"{torch.cuda.get_device_name(dev)}, {args.dtype} {M} x {K} -> {N}, GELU, input {args.input}, "
          f"allocator {os.environ.get('PYTORCH_CUDA_ALLOC_CONF', 'default')}; ms, median (min-max) of "
          f"{args.rounds} rounds")
    print("| heuristic | after an L2 flush, one run | back to back |")
    print("|---|---|---|")
    for v in variants:
        cells = [f"{statistics.median(t):.3f} ({min(t):.3f}-{max(t):.3f})" for t in (isolated[v], back_to_back[v])]
        print(f"| {v} | {cells[0]} | {cells[1]} |", flush=True)


if __name__ == "__main__":
    main()
