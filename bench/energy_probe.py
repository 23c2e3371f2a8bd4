"""Energy per call of the MLP's two GELU GEMMs at the steady state of sustained load: fused_dense's
own kernels (fc1's forward with the pre-activation saved, fc2's GELU data gradient with the bias
gradient), the unfused path (cuBLASLt's plain GEMM + fused_dense's elementwise pass), and torch.mm's
plain GEMM of the same shape (the benchmark's floor kernel).

Why: under sustained load the H200 sits at its 700 W power cap, and the benchmark's sustained
section (s12r3, s12r4) found FusedMLP at the same power as the six plain GEMMs but a 4-5% lower SM
clock. A kernel that needs more energy per call runs at a lower clock there, whatever its time
alone. This probe puts a figure on each kernel: per call its time, median SM clock and power over
the timed span, energy (power x time) and cycles (clock x time).

Each variant runs WARM_S seconds of back-to-back calls (the clock settles), then TIMED_S seconds
timed with CUDA events, while nvidia-smi samples clock and power every 100 ms (bench/run.py's
ClockSampler); the variants alternate over ROUNDS rounds. Run it with own kernels chosen by
'auto' and nothing else:

    FUSED_DENSE_TUNING_CANDIDATES=own python bench/energy_probe.py --shapes 8192x1024 8192x2048

ENERGY_PROBE_ONLY=fc1 (or fc2) keeps one of the two problems.
"""
import os
import statistics
import time

import torch

from _probe import OPS, mlp_shapes
from run import ClockSampler, clocks_in_windows

WARM_S = 1.5
TIMED_S = 0.5
ROUNDS = 3
GELU, AUTO, UNFUSED = 1, -2, -1


def variants(M, d, dtype=torch.bfloat16):
    """{problem: {variant: fn}} for fc1's forward and fc2's GELU data gradient at M x d (hidden 4d)."""
    h = 4 * d
    x = torch.randn(M, d, dtype=dtype, device="cuda")
    w1 = torch.randn(h, d, dtype=dtype, device="cuda") / d ** 0.5
    b1 = torch.randn(h, dtype=dtype, device="cuda")
    w2 = torch.randn(d, h, dtype=dtype, device="cuda") / h ** 0.5
    dy = torch.randn(M, d, dtype=dtype, device="cuda")
    pre = torch.randn(M, h, dtype=dtype, device="cuda")
    return {
        f"fc1 forward {M}x{d}->{h}": {
            "own ('auto')": lambda: OPS.linear_act(x, w1, b1, GELU, True, AUTO),
            "unfused (-1)": lambda: OPS.linear_act(x, w1, b1, GELU, True, UNFUSED),
            "torch.mm": lambda: torch.mm(x, w1.t()),
        },
        f"fc2 GELU dgrad {M}x{d}->{h}": {
            "own ('auto')": lambda: OPS.act_linear_dgrad(w2, dy, pre, GELU, True, AUTO),
            "unfused (-1)": lambda: OPS.act_linear_dgrad(w2, dy, pre, GELU, True, UNFUSED),
            "torch.mm": lambda: torch.mm(dy, w2),
        },
    }


def sustained_block(fn):
    """WARM_S s of calls, then the ms per call over TIMED_S s and the (start, end) wall span of the
    timed calls."""
    t_end = time.time() + WARM_S
    while time.time() < t_end:
        for _ in range(10):
            fn()
        torch.cuda.synchronize()
    start_ev, end_ev = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    calls = 0
    t0 = time.time()
    start_ev.record()
    while time.time() - t0 < TIMED_S:
        for _ in range(10):
            fn()
        calls += 10
    end_ev.record()
    end_ev.synchronize()
    t1 = time.time()
    return start_ev.elapsed_time(end_ev) / calls, (t0, t1)


def main():
    shapes = mlp_shapes(default=("8192x1024", "8192x2048"))
    print(f"GPU {torch.cuda.get_device_name()}, torch {torch.__version__}, FUSED_DENSE_TUNING_CANDIDATES="
          f"{os.environ.get('FUSED_DENSE_TUNING_CANDIDATES', '(unset)')}; {ROUNDS} rounds of {WARM_S} s warm-up + "
          f"{TIMED_S} s timed per variant")
    only = os.environ.get("ENERGY_PROBE_ONLY", "")
    for M, d in shapes:
        for problem, fns in variants(M, d).items():
            if not problem.startswith(only):
                continue
            for fn in fns.values():  # first calls: tuning, plans
                fn()
            torch.cuda.synchronize()
            times = {k: [] for k in fns}
            windows = {k: [] for k in fns}
            sampler = ClockSampler(gpu_index=torch.cuda.current_device()).start()
            try:
                for r in range(ROUNDS):
                    keys = list(fns)
                    keys = keys[r % len(keys):] + keys[:r % len(keys)]
                    for k in keys:
                        ms, span = sustained_block(fns[k])
                        times[k].append(ms)
                        windows[k].append(span)
            finally:
                samples = sampler.stop()
            clocks = clocks_in_windows(samples, windows)
            print(f"\n{problem}" + (f" (no clock samples: {sampler.note})" if sampler.note else ""))
            print(f"  {'variant':<14} {'ms/call':>8} {'SM MHz':>7} {'W':>6} {'mJ/call':>8} {'Mcycles':>8}"
                  f" {'samples':>7}  ms per round")
            for k in fns:
                ms = statistics.median(times[k])
                c = clocks.get(k, {})
                mhz, watts = c.get("sm_mhz"), c.get("power_w")
                energy = f"{watts * ms:8.2f}" if watts else f"{'-':>8}"
                cycles = f"{mhz * ms / 1e3:8.3f}" if mhz else f"{'-':>8}"
                print(f"  {k:<14} {ms:8.4f} {mhz or '-':>7} {watts or '-':>6} {energy} {cycles} "
                      f"{c.get('samples', 0):>7}  " + " / ".join(f"{t:.4f}" for t in times[k]))


if __name__ == "__main__":
    main()
