"""Where a training step's host time goes: one bench.model config, some of its variants, each
profiled (torch.profiler, CPU and CUDA activity) over a few steps after warm-up.

    python tools/host_step.py --config gpt2-small --variants hf_compile,fd_compile --causal-sdpa

Prints per variant and step: the step's wall time with a synchronize after each step, the CPU
time the profiler records on the host (self time, summed), the kernels launched, and the ops
with the most self CPU time (fused_dense's ops, aten's GEMMs, launches, Inductor's kernels).
A step whose host time exceeds its kernel time leaves the GPU idle (bench.model's `idle`
column); this says which calls that host time is spent in. Writes JSON with --json.
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


def profile_steps(r, ids_list, top):
    from torch.profiler import ProfilerActivity, profile
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if r.device.type == "cuda" else [])
    r.sync()
    with profile(activities=acts) as prof:
        for ids in ids_list:
            r.step(ids)
        r.sync()
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


def wall_steps(r, ids_list):
    out = []
    for ids in ids_list:
        r.sync()
        t = time.perf_counter()
        r.step(ids)
        t_host = time.perf_counter()
        r.sync()
        out.append(((t_host - t) * 1e3, (time.perf_counter() - t) * 1e3))
    return out


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
    ids_list = bm.batches(bm.text_tokens(), cfg, args.warmup + 2 * args.steps, device)
    res = {"config": args.config, "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
           "variants": {}}
    for key in variants:
        r = bm.Runner(key, base, device)
        for ids in ids_list[:args.warmup]:
            r.step(ids)
        walls = wall_steps(r, ids_list[args.warmup:args.warmup + args.steps])
        prof = profile_steps(r, ids_list[args.warmup + args.steps:], args.top)
        v = {"note": r.note, "host_issue_ms": statistics.median(w[0] for w in walls),
             "synced_step_ms": statistics.median(w[1] for w in walls), **prof}
        res["variants"][key] = v
        print(f"{key}: {r.note}\n  issue {v['host_issue_ms']:.2f} ms, step with sync {v['synced_step_ms']:.2f} ms, "
              f"profiled self CPU {v['self_cpu_ms_a_step']:.2f} ms, kernels {v['kernel_ms_a_step']:.2f} ms, "
              f"{v['launches_a_step']:.0f} launches a step", flush=True)
        for row in v["top"]:
            print(f"    {row['self_cpu_us_a_step']:9.1f} us  {row['calls_a_step']:7.1f} calls  {row['op']}")
        del r
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
