#!/usr/bin/env python
"""Where the host time of a small FusedMLP step goes.

At M=512, d=512 the GPU work of one forward + backward is small, so a loop of steps issued
without synchronization measures the host. Unless it does not: once the launch queue is full a
launch waits (spinning, so it counts as CPU time), and the loop then measures the GPU. This
script tells the two apart. For each variant it reports, per step:

  cpu      time.process_time() (every host thread) over N unsynchronized steps
  main     time.thread_time() of the calling thread alone
  issue    wall time to issue the N steps; wall: the same plus the closing synchronize
  gpu      wall time per step of the same loop measured with CUDA events (the GPU's view)
  sync     wall time of one step followed by torch.cuda.synchronize() (latency, no queueing)
  kernels  kernel launches per step and the summed kernel time per step (torch.profiler)

Variants: eager (nn.Linear, GELU, nn.Linear), FusedMLP ('auto', 0, -1), the six raw op calls
of one FusedMLP step in its order without autograd, the same six in a minimal
autograd.Function, and each raw op alone at the MLP's shapes.

    python bench/host_profile.py [--m 512] [--d 512] [--iters 200] [--json out.json]
"""
import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import fused_dense  # noqa: E402
from fused_dense import FusedMLP  # noqa: E402

GELU, NONE, AUTO = 1, 0, -2


CUDA = torch.cuda.is_available()


def sync():
    if CUDA:
        torch.cuda.synchronize()


def measure(step, iters, reps=5, warmup=20):
    for _ in range(warmup):
        step()
    sync()
    cpu, main, issue, wall, gpu = [], [], [], [], []
    if CUDA:
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(reps):
        sync()
        c0, t0, w0 = time.process_time(), time.thread_time(), time.perf_counter()
        if CUDA:
            start.record()
        for _ in range(iters):
            step()
        if CUDA:
            stop.record()
        c1, t1, w1 = time.process_time(), time.thread_time(), time.perf_counter()
        sync()
        w2 = time.perf_counter()
        cpu.append((c1 - c0) / iters * 1e6)
        main.append((t1 - t0) / iters * 1e6)
        issue.append((w1 - w0) / iters * 1e6)
        wall.append((w2 - w0) / iters * 1e6)
        gpu.append(start.elapsed_time(stop) / iters * 1e3 if CUDA else float("nan"))
    lat = []
    for _ in range(max(20, iters // 4)):
        sync()
        w0 = time.perf_counter()
        step()
        sync()
        lat.append((time.perf_counter() - w0) * 1e6)
    row = {"cpu": statistics.median(cpu), "main": statistics.median(main), "issue": statistics.median(issue),
           "wall": statistics.median(wall), "gpu": statistics.median(gpu), "sync": statistics.median(lat)}
    row.update(kernel_stats(step))
    return row


def kernel_stats(step, iters=10):
    from torch.profiler import ProfilerActivity, profile
    sync()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if CUDA else [])
    with profile(activities=acts) as prof:
        for _ in range(iters):
            step()
        sync()
    launches, busy = 0, 0.0
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            launches += 1
            busy += e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
    return {"launches": launches / iters, "kernel_us": busy / iters}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--m", type=int, default=512)
    ap.add_argument("--d", type=int, default=512)
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--json", default=None, help="also write the rows here")
    ap.add_argument("--no-compile", action="store_true")
    args = ap.parse_args()
    dev, dt = ("cuda" if CUDA else "cpu"), torch.bfloat16
    M, d, h = args.m, args.d, 4 * args.d
    torch.manual_seed(0)
    x = torch.randn(M, d, device=dev, dtype=dt)
    dy = torch.randn(M, d, device=dev, dtype=dt)
    fused = {hk: FusedMLP(d, h, d, heuristic=hk, device=dev, dtype=dt) for hk in ("auto", 0, -1)}
    m = fused["auto"]
    for other in (fused[0], fused[-1]):
        other.load_state_dict(m.state_dict())
    w1, b1 = m.fc1.weight.detach(), m.fc1.bias.detach()
    w2, b2 = m.fc2.weight.detach(), m.fc2.bias.detach()
    eager = torch.nn.Sequential(torch.nn.Linear(d, h), torch.nn.GELU(approximate="tanh"),
                                torch.nn.Linear(h, d)).to(dev, dt)
    eager.load_state_dict({"0.weight": w1, "0.bias": b1, "2.weight": w2, "2.bias": b2})
    xg = x.clone().requires_grad_()
    raw = torch.ops.fused_dense
    la, dg, wg = raw.linear_act.default, raw.act_linear_dgrad.default, raw.linear_bias_wgrad.default

    # One FusedMLP step's op calls at level 0 (forward: fc1 with GELU, fc2; backward: fc2 wgrad,
    # fc2 dgrad through GELU with fc1's bias gradient, fc1 dgrad, fc1 wgrad).
    def raw_fwd(xx):
        act, pre = la(xx, w1, b1, GELU, True, AUTO)
        out = la(act, w2, b2, NONE, False, AUTO)[0]
        return out, act, pre

    def raw_bwd(xx, act, pre, g):
        gw2, gb2 = wg(act, g, True)
        dpre, gb1 = dg(w2, g, pre, GELU, True, AUTO)
        gx = dg(w1, dpre, None, NONE, False, AUTO)[0]
        gw1 = wg(xx, dpre, False)[0]
        return gx, gw1, gb1, gw2, gb2

    def raw_step():
        out, act, pre = raw_fwd(x)
        raw_bwd(x, act, pre, dy)

    class MinimalFunc(torch.autograd.Function):
        @staticmethod
        def forward(ctx, xx, a, b, c, e):
            out, act, pre = raw_fwd(xx)
            ctx.save_for_backward(xx, act, pre)
            return out

        @staticmethod
        def backward(ctx, g):
            xx, act, pre = ctx.saved_tensors
            gx, gw1, gb1, gw2, gb2 = raw_bwd(xx, act, pre, g.contiguous())
            return gx, gw1, gb1, gw2, gb2

    params = [torch.nn.Parameter(t.clone()) for t in (w1, b1, w2, b2)]

    def minimal_step():
        for p in params:
            p.grad = None
        xg.grad = None
        MinimalFunc.apply(xg, *params).backward(dy)

    def module_step(mod):
        ps = list(mod.parameters())

        def step():
            for p in ps:
                p.grad = None
            xg.grad = None
            mod(xg).backward(dy)
        return step

    variants = [("eager nn.Linear+GELU+nn.Linear", module_step(eager))]
    if not args.no_compile:
        variants.append(("torch.compile of eager", module_step(torch.compile(eager))))
    variants += [(f"FusedMLP heuristic={hk!r}", module_step(mod)) for hk, mod in fused.items()]
    variants += [("6 raw ops, no autograd", raw_step), ("6 raw ops in minimal autograd.Function", minimal_step)]

    with torch.no_grad():
        out, act, pre = raw_fwd(x)
        dpre = dg(w2, dy, pre, GELU, True, AUTO)[0]
        single = [
            ("fc1 linear_act gelu save", lambda: la(x, w1, b1, GELU, True, AUTO)),
            ("fc2 linear_act none", lambda: la(act, w2, b2, NONE, False, AUTO)),
            ("fc2 linear_bias_wgrad +bias", lambda: wg(act, dy, True)),
            ("fc2 act_linear_dgrad gelu +bias", lambda: dg(w2, dy, pre, GELU, True, AUTO)),
            ("fc1 act_linear_dgrad none", lambda: dg(w1, dpre, None, NONE, False, AUTO)),
            ("fc1 linear_bias_wgrad", lambda: wg(x, dpre, False)),
            ("F.linear fc1 shape", lambda: F.linear(x, w1, b1)),
            ("torch.mm fc1 wgrad shape", lambda: dpre.t() @ x),
        ]
    rows = {}
    print(f"fused_dense CUDA={fused_dense.has_cuda_kernels()}  M={M} d={d} h={h} bf16, {args.iters} steps x 5 reps, "
          f"median; times in us per step", flush=True)
    hdr = f"{'variant':42s} {'cpu':>7s} {'main':>7s} {'issue':>7s} {'wall':>7s} {'gpu':>7s} {'sync':>7s} " \
          f"{'launch':>6s} {'kern':>7s}"
    print(hdr)
    for name, step in variants + [(n, s) for n, s in single]:
        if name.startswith("fc") or name.startswith("F.") or name.startswith("torch.mm"):
            with torch.no_grad():
                r = measure(step, args.iters)
        else:
            r = measure(step, args.iters)
        rows[name] = r
        print(f"{name:42s} {r['cpu']:7.1f} {r['main']:7.1f} {r['issue']:7.1f} {r['wall']:7.1f} {r['gpu']:7.1f} "
              f"{r['sync']:7.1f} {r['launches']:6.1f} {r['kernel_us']:7.1f}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"M": M, "d": d, "h": h, "iters": args.iters, "torch": torch.__version__,
                       "gpu": torch.cuda.get_device_name() if CUDA else "cpu", "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
