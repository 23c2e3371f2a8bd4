#!/usr/bin/env python
"""Where the host time of a small FusedMLP step goes: per-call CPU time of each op and of its
plain-PyTorch counterpart, issued back to back without synchronization (the GPU work is tiny,
so the host is the bottleneck), plus torch.profiler's CPU totals of one forward + backward.

    python bench/host_profile.py [--m 512] [--d 512] [--iters 300]
"""
import argparse
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import fused_dense  # noqa: E402
from fused_dense import FusedMLP, ops  # noqa: E402


def per_call_us(fn, iters, reps=5):
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.process_time()
        for _ in range(iters):
            fn()
        times.append((time.process_time() - t0) / iters * 1e6)
    torch.cuda.synchronize()
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--m", type=int, default=512)
    ap.add_argument("--d", type=int, default=512)
    ap.add_argument("--iters", type=int, default=300)
    args = ap.parse_args()
    dev, dt = "cuda", torch.bfloat16
    M, d, h = args.m, args.d, 4 * args.d
    x = torch.randn(M, d, device=dev, dtype=dt)
    w1 = torch.randn(h, d, device=dev, dtype=dt) * d ** -0.5
    b1 = torch.randn(h, device=dev, dtype=dt)
    g = torch.randn(M, h, device=dev, dtype=dt)
    pre = torch.randn(M, h, device=dev, dtype=dt)
    pre_in = torch.randn(M, d, device=dev, dtype=dt)  # dgrad of fc1: pre-activation of its input
    raw = torch.ops.fused_dense
    rows = []
    with torch.no_grad():
        rows.append(("empty_like (allocator floor)", per_call_us(lambda: torch.empty_like(pre), args.iters)))
        rows.append(("F.linear", per_call_us(lambda: F.linear(x, w1, b1), args.iters)))
        rows.append(("F.linear + F.gelu", per_call_us(lambda: F.gelu(F.linear(x, w1, b1), approximate="tanh"),
                                                      args.iters)))
        rows.append(("raw act_forward (elementwise only)", per_call_us(lambda: raw.act_forward(pre, 1), args.iters)))
        for hcode in (0, -1, -2):
            rows.append((f"raw linear_act gelu save h={hcode}",
                         per_call_us(lambda: raw.linear_act(x, w1, b1, 1, True, hcode), args.iters)))
            rows.append((f"raw linear_act none h={hcode}",
                         per_call_us(lambda: raw.linear_act(x, w1, b1, 0, False, hcode), args.iters)))
        rows.append(("python ops.linear_act gelu save 'auto'",
                     per_call_us(lambda: ops.linear_act(x, w1, b1, "gelu_approx", True, "auto"), args.iters)))
        rows.append(("raw act_linear_dgrad gelu d_bias h=-2",
                     per_call_us(lambda: raw.act_linear_dgrad(w1, g, pre_in, 1, True, -2), args.iters)))
        rows.append(("raw linear_bias_wgrad d_bias", per_call_us(lambda: raw.linear_bias_wgrad(x, g, True),
                                                                 args.iters)))
        rows.append(("torch.mm (g.t() @ x)", per_call_us(lambda: g.t() @ x, args.iters)))
    m = FusedMLP(d, h, device=dev, dtype=dt)
    xg = x.clone().requires_grad_()
    dy = torch.randn(M, d, device=dev, dtype=dt)

    def step():
        for p in m.parameters():
            p.grad = None
        m(xg).backward(dy)
    rows.append(("FusedMLP fwd+bwd 'auto'", per_call_us(step, args.iters // 2)))
    with torch.no_grad():
        rows.append(("FusedMLP fwd only, no_grad", per_call_us(lambda: m(x), args.iters)))
    print(f"host CPU time per call (process_time, M={M}, d={d}, bf16), fused_dense CUDA={fused_dense.has_cuda_kernels()}")
    for name, us in rows:
        print(f"  {name:45s} {us:8.1f} us")
    from torch.profiler import ProfilerActivity, profile
    for _ in range(5):
        step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(20):
            step()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))


if __name__ == "__main__":
    main()
