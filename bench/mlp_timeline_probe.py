"""Where FusedMLP's forward + backward spends its time inside the step, against the six plain GEMMs
(the floor): one kernel timeline per step from torch.profiler, L2 flushed before each step as in
bench/run.py. Per variant and shape it prints the step's span (first kernel start to last kernel
end), the sum of its kernels' durations, the idle time between them, and each kernel's median
duration in the step. The tuner (and bench/run.py's op tables) time each op alone; this shows
whether the step costs more than its ops because of gaps between kernels, kernels that run
slower inside the step than alone, or kernels the op tables do not count. Each profiled block
follows WARM_S seconds of the same steps, and the two variants alternate over ROUNDS rounds; log
the clocks beside it (nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,... -lms 100): the
block times are printed in UTC to match.

    python bench/mlp_timeline_probe.py --shapes 8192x1024 8192x2048
"""
import statistics
import time

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from _probe import mlp_shapes
from fused_dense import FusedMLP

STEPS = 20
ROUNDS = 4
WARM_S = 1.5
MIB = 1 << 20


def floor_step(x, w1, w2, dy, h_act, d_pre):
    """The six GEMMs of the step on pre-made tensors (bench/run.py's floor)."""
    torch.mm(x, w1.t())
    torch.mm(h_act, w2.t())
    torch.mm(dy, w2)
    torch.mm(dy.t(), h_act)
    torch.mm(d_pre, w1)
    torch.mm(d_pre.t(), x)


def timeline(step, flush):
    """Kernel events of STEPS steps, each after an L2 flush; per step (start, end, [(name, us)])."""
    # sustained load first: the clocks settle (ramp up from idle, or down under the power cap)
    t_end = time.time() + WARM_S
    while time.time() < t_end:
        for _ in range(5):
            step()
        torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(STEPS):
            flush.zero_()
            torch.cuda.synchronize()
            step()
            torch.cuda.synchronize()
    kernels = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                     key=lambda e: e.time_range.start)
    steps, current = [], None
    for e in kernels:
        # the flush (a fill of the 256 MiB buffer) opens each step
        if "fill" in e.name.lower() or "memset" in e.name.lower():
            if e.time_range.end - e.time_range.start > 20:  # a big fill is the flush, not a zero_ of an output
                current = []
                steps.append(current)
                continue
        if current is not None:
            current.append(e)
    return steps


def hms(t):
    return time.strftime("%H:%M:%S", time.gmtime(t)) + f".{int(t % 1 * 1000):03d}"


def summarize(label, steps, t0, t1):
    spans, busy, per_kernel = [], [], {}
    for events in steps:
        if not events:
            continue
        start = min(e.time_range.start for e in events)
        end = max(e.time_range.end for e in events)
        spans.append(end - start)
        busy.append(sum(e.time_range.end - e.time_range.start for e in events))
        for i, e in enumerate(events):
            per_kernel.setdefault((i, e.name), []).append(e.time_range.end - e.time_range.start)
    span, work = statistics.median(spans), statistics.median(busy)
    print(f"  {label}: span {span:8.1f} us, kernels {work:8.1f} us, idle {span - work:6.1f} us, "
          f"{len(per_kernel)} kernels per step; {hms(t0)}-{hms(t1)} UTC")
    for (i, name), durs in sorted(per_kernel.items()):
        print(f"    {i:2d} {statistics.median(durs):8.1f} us  {name[:110]}")
    return span


def main():
    torch.manual_seed(0)
    flush = torch.empty(256 * MIB, dtype=torch.int8, device="cuda")
    dtype = torch.bfloat16
    print(f"GPU {torch.cuda.get_device_name()} torch {torch.__version__} CUDA {torch.version.cuda}")
    for M, d in mlp_shapes(("8192x1024", "8192x2048")):
        h = 4 * d
        print(f"M={M} d={d} bf16 gelu_approx, median of {STEPS} steps")
        mlp = FusedMLP(d, h, activation="gelu_approx", device="cuda", dtype=dtype)
        x = torch.randn(M, d, device="cuda", dtype=dtype, requires_grad=True)
        dy = torch.randn(M, d, device="cuda", dtype=dtype)

        def fused_step():
            x.grad = None
            for p in mlp.parameters():
                p.grad = None
            mlp(x).backward(dy)

        w1 = torch.randn(h, d, device="cuda", dtype=dtype) / d ** 0.5
        w2 = torch.randn(d, h, device="cuda", dtype=dtype) / h ** 0.5
        h_act = F.gelu(torch.randn(M, h, device="cuda", dtype=dtype), approximate="tanh")
        d_pre = torch.randn(M, h, device="cuda", dtype=dtype)
        xd = x.detach()

        # alternated, so the GPU's clock and temperature drift over the run weigh on both alike
        spans = {"six GEMMs (floor)": [], "FusedMLP auto": []}
        for rnd in range(ROUNDS):
            for label, step in (("six GEMMs (floor)", lambda: floor_step(xd, w1, w2, dy, h_act, d_pre)),
                                ("FusedMLP auto", fused_step)):
                t0 = time.time()
                steps = timeline(step, flush)
                spans[label].append(summarize(f"round {rnd} {label}", steps, t0, time.time()))
        floor, fused = (statistics.median(v) for v in spans.values())
        print(f"  median span over rounds: floor {floor:.1f} us, FusedMLP {fused:.1f} us, "
              f"ratio {fused / floor:.3f}")


if __name__ == "__main__":
    main()
