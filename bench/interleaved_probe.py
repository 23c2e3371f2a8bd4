"""Is FusedMLP behind eager at a large shape, or is that the clock drifting between two variants
timed one after the other? This probe times them in alternating rounds instead: each round runs
every variant for a few steps (order rotated per round), so slow drift in clocks or temperature
touches all of them alike; it reports the median over rounds of each variant's time and of its
ratio to eager within the same round.

    python bench/interleaved_probe.py [--shape 16384x8192] [--rounds 8] [--steps 4] [--budget 100] [--compile]

A probe for issue #5, not part of bench/run.py. Variants: eager (nn.Linear, F.gelu tanh,
nn.Linear), FusedMLP 'auto' at checkpoint level 0 and 1, FusedMLP unfused (heuristic -1), and with
--compile torch.compile of the eager module (compiled before the rounds; its compile time is
printed, not timed).
"""
import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.run import EagerMLP, copy_weights  # noqa: E402
from fused_dense import FusedMLP  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="16384x8192")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--steps", type=int, default=4, help="forward + backward steps per variant per round")
    ap.add_argument("--budget", type=float, default=100.0, help="stop starting rounds after this many seconds")
    ap.add_argument("--device", default="cuda", help="cuda, or cpu for a smoke test at a tiny shape")
    ap.add_argument("--compile", action="store_true", help="add torch.compile of the eager module")
    args = ap.parse_args()
    M, d = (int(v) for v in args.shape.split("x"))
    h, dt, dev = 4 * d, torch.bfloat16, args.device
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
    t_start = time.perf_counter()
    eager = EagerMLP(d, h, "gelu_approx", dev, dt)
    variants = {"eager": eager}
    for name, lvl, heur in (("auto", 0, "auto"), ("auto ckpt1", 1, "auto"), ("unfused", 0, -1)):
        mod = FusedMLP(d, h, d, activation="gelu_approx", checkpoint_lvl=lvl, heuristic=heur, device=dev, dtype=dt)
        copy_weights(mod, eager)
        variants[name] = mod
    if args.compile:
        variants["compile"] = torch.compile(eager)  # same parameters as eager
    x = torch.randn(M, d, device=dev, dtype=dt, requires_grad=True)
    dy = torch.randn(M, d, device=dev, dtype=dt)

    def step(mod):
        for p in list(mod.parameters()) + [x]:
            p.grad = None
        mod(x).backward(dy)

    for name, mod in variants.items():  # first call: tuning; then a warm-up step
        t0 = time.perf_counter()
        step(mod)
        sync()
        step(mod)
        sync()
        print(f"{args.shape} {name}: first two steps {time.perf_counter() - t0:.2f} s", flush=True)

    names = list(variants)
    times = {n: [] for n in names}
    ratios = {n: [] for n in names}
    for r in range(args.rounds):
        if time.perf_counter() - t_start > args.budget:
            print(f"budget reached after {r} rounds", flush=True)
            break
        order = names[r % len(names):] + names[:r % len(names)]
        this = {}
        for n in order:
            sync()
            t0 = time.perf_counter()  # host clock around a synchronized stretch of whole steps
            for _ in range(args.steps):
                step(variants[n])
            sync()
            this[n] = (time.perf_counter() - t0) * 1e3 / args.steps
        for n in names:
            times[n].append(this[n])
            ratios[n].append(this["eager"] / this[n])
        print(f"round {r}: " + ", ".join(f"{n} {this[n]:.2f} ms" for n in names), flush=True)
    for n in names:
        if times[n]:
            print(f"{args.shape} {n:12s} median {statistics.median(times[n]):8.3f} ms  "
                  f"eager/this per round: median {statistics.median(ratios[n]):.4f} "
                  f"(min {min(ratios[n]):.4f}, max {max(ratios[n]):.4f}, {len(ratios[n])} rounds)", flush=True)


if __name__ == "__main__":
    main()
