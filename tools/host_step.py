"""Where a training step's host time goes: one bench.model config, some of its variants, each
profiled (torch.profiler, CPU and CUDA activity) over a few steps after warm-up.

    python tools/host_step.py --config gpt2-small --variants hf_compile,fd_compile --causal-sdpa

Prints per variant and step: the step's wall time with a synchronize after each step, the CPU
time the profiler records on the host (self time, summed), the kernels launched, and the ops
with the most self CPU time (fused_dense's ops, aten's GEMMs, launches, Inductor's kernels).
A step whose host time exceeds its kernel time leaves the GPU idle (bench.model's `idle`
column); this says which calls that host time is spent in. With --gaps, the GPU's idle time
within the profiled steps (gaps between one kernel's end and the next one's start), each gap
charged to the op that launched the kernel after it (the innermost CPU op around its launch) and
counted as host-late where that launch came after the gap began. A profile or wall-timed step
during which the library's tuner measured is taken again (bench.timing.untuned). Writes JSON with
--json.
"""
import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench import model as bm  # noqa: E402
from bench import timing  # noqa: E402


def profile_steps(r, ids_list, top):
    from torch.profiler import ProfilerActivity, profile
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if r.device.type == "cuda" else [])

    def run():
        r.sync()
        with profile(activities=acts) as prof:
            for ids in ids_list:
                r.step(ids)
            r.sync()
        return prof
    prof = timing.untuned(run, r.device)[0]
    n = len(ids_list)
    rows, launches, kernel_us = [], 0, 0.0
    for ev in prof.key_averages():
        self_cpu = ev.self_cpu_time_total
        dev = getattr(ev, "self_device_time_total", None) or getattr(ev, "self_cuda_time_total", 0)
        if ev.key.startswith("cudaLaunchKernel") or ev.key.startswith("cuLaunchKernel"):
            launches += ev.count
        if dev and not ev.key.startswith(("cuda", "cu", "ProfilerStep")) and self_cpu == 0:
            kernel_us += dev
        rows.append({"op": ev.key[:120], "calls_a_step": ev.count / n, "self_cpu_us_a_step": self_cpu / n})
    rows.sort(key=lambda x: -x["self_cpu_us_a_step"])
    total_cpu = sum(x["self_cpu_us_a_step"] for x in rows)
    return {"self_cpu_ms_a_step": total_cpu / 1e3, "launches_a_step": launches / n,
            "kernel_ms_a_step": kernel_us / n / 1e3, "top": rows[:top]}


def gap_steps(r, ids_list, top, min_gap_us=2.0):
    """GPU idle gaps over the given steps from a Chrome trace of torch.profiler: total idle a step,
    the part whose next kernel was launched after the gap began (host-late), and the gaps by the
    innermost CPU op around the next kernel's launch, largest first."""
    import bisect
    import tempfile
    from torch.profiler import ProfilerActivity, profile
    def run():
        r.sync()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for ids in ids_list:
                r.step(ids)
            r.sync()
        return prof
    prof = timing.untuned(run, r.device)[0]
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        path = f.name
    prof.export_chrome_trace(path)
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    os.unlink(path)
    kern = sorted((e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")), key=lambda e: e["ts"])
    # launches by the runtime API (cudaLaunchKernel) and the driver API (cuLaunchKernel: Triton's)
    launch = {e["args"].get("correlation"): e for e in events
              if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}
    ops = sorted((e for e in events if e.get("cat") == "cpu_op"), key=lambda e: e["ts"])
    starts = [e["ts"] for e in ops]

    def innermost(ts, tid):
        best = None
        for e in ops[max(0, bisect.bisect_right(starts, ts) - 400):bisect.bisect_right(starts, ts)]:
            if e["tid"] == tid and e["ts"] <= ts <= e["ts"] + e.get("dur", 0):
                if best is None or e.get("dur", 0) <= best.get("dur", 0):
                    best = e
        return best["name"][:100] if best else "(no CPU op)"

    by, total, late = {}, 0.0, 0.0
    for prev, nxt in zip(kern, kern[1:]):
        gap = nxt["ts"] - (prev["ts"] + prev.get("dur", 0))
        if gap < min_gap_us:
            continue
        total += gap
        lc = launch.get(nxt.get("args", {}).get("correlation"))
        is_late = lc is not None and lc["ts"] + lc.get("dur", 0) > prev["ts"] + prev.get("dur", 0)
        late += gap if is_late else 0.0
        name = innermost(lc["ts"], lc["tid"]) if lc is not None else "(no launch found)"
        row = by.setdefault(name, [0.0, 0, 0.0])
        row[0] += gap
        row[1] += 1
        row[2] += gap if is_late else 0.0
    n = len(ids_list)
    rows = sorted(([k, v[0] / n / 1e3, v[1] / n, v[2] / n / 1e3] for k, v in by.items()), key=lambda x: -x[1])
    return {"idle_ms_a_step": total / n / 1e3, "host_late_ms_a_step": late / n / 1e3,
            "gaps_by_op": [{"op": k, "ms_a_step": round(a, 4), "gaps_a_step": c, "host_late_ms_a_step": round(b, 4)}
                           for k, a, c, b in rows[:top]]}


def wall_steps(r, ids_list):
    """(host ms, synchronized wall ms) of each step; a step the tuner measured in is taken again."""
    def one(ids):
        r.sync()
        t = time.perf_counter()
        r.step(ids)
        t_host = time.perf_counter()
        r.sync()
        return (t_host - t) * 1e3, (time.perf_counter() - t) * 1e3
    return [timing.untuned(lambda: one(ids), r.device)[0] for ids in ids_list]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default="gpt2-small")
    p.add_argument("--variants", default="hf_compile,fd_compile")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--warmup", type=int, default=8)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--causal-sdpa", action="store_true")
    p.add_argument("--json", default=None)
    p.add_argument("--gaps", action="store_true", help="also the GPU's idle gaps by the op after each (see above)")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    table = bm.CONFIGS if device.type == "cuda" else bm.CPU_CONFIGS
    if args.config not in table:
        p.error(f"--config: unknown {args.config!r} on {device.type} (known: {list(table)})")
    cfg = table[args.config]
    variants = args.variants.split(",")
    bad = [v for v in variants if v not in bm.VARIANTS]
    if bad:
        p.error(f"--variants: unknown {bad} (known: {bm.VARIANTS})")
    if args.causal_sdpa:
        bm.causal_sdpa_under_compile()
    base = bm.build_hf(cfg, device, torch.bfloat16)
    ids_list = bm.batches(bm.text_tokens(), cfg, args.warmup + 3 * args.steps, device)
    res = {"config": args.config, "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
           "variants": {}}
    for key in variants:
        r = bm.Runner(key, base, device)
        for ids in ids_list[:args.warmup]:
            r.step(ids)
        walls = wall_steps(r, ids_list[args.warmup:args.warmup + args.steps])
        prof = profile_steps(r, ids_list[args.warmup + args.steps:args.warmup + 2 * args.steps], args.top)
        if args.gaps and device.type == "cuda":
            prof["gaps"] = gap_steps(r, ids_list[args.warmup + 2 * args.steps:], args.top)
        v = {"note": r.note, "host_issue_ms": statistics.median(w[0] for w in walls),
             "synced_step_ms": statistics.median(w[1] for w in walls), **prof}
        res["variants"][key] = v
        print(f"{key}: {r.note}\n  issue {v['host_issue_ms']:.2f} ms, step with sync {v['synced_step_ms']:.2f} ms, "
              f"profiled self CPU {v['self_cpu_ms_a_step']:.2f} ms, kernels {v['kernel_ms_a_step']:.2f} ms, "
              f"{v['launches_a_step']:.0f} launches a step", flush=True)
        for row in v["top"]:
            print(f"    {row['self_cpu_us_a_step']:9.1f} us  {row['calls_a_step']:7.1f} calls  {row['op']}")
        if "gaps" in v:
            g = v["gaps"]
            print(f"  GPU idle {g['idle_ms_a_step']:.3f} ms a step, host-late {g['host_late_ms_a_step']:.3f}; by the op "
                  "launching the kernel after the gap:")
            for row in g["gaps_by_op"]:
                print(f"    {row['ms_a_step']:8.4f} ms ({row['host_late_ms_a_step']:.4f} late) {row['gaps_a_step']:6.1f} "
                      f"gaps  {row['op']}")
        del r
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
