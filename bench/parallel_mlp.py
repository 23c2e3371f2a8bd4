#!/usr/bin/env python
"""Tensor-parallel MLP benchmark: ParallelFusedMLP against the same MLP from nn.Linear shards and
synchronous torch.distributed collectives, forward + backward, one process per GPU.

    torchrun --standalone --nproc_per_node=2 bench/parallel_mlp.py --out docs/results
    torchrun --standalone --nproc_per_node=2 bench/parallel_mlp.py --out DIR --device cpu --dims 256 --tokens 64
    python bench/parallel_mlp.py --report docs/results/parallel-mlp-DATE.json   # the markdown again

Per (d, sequence_parallel) it times fused (ParallelFusedMLP; the backward's input gather and
input-gradient reduction overlap GEMMs), plain (nn.Linear shards, synchronous collectives at the
same places), fused_local / plain_local (the same math on this rank's shards, no collectives) and
comm (one fused step's collectives alone, back to back): bf16 (fp32 on the CPU), gelu_approx,
hidden 4d, --tokens rows in all, the slowest rank's median of --reps, after checking that the two
MLPs agree. hidden = (local + comm - step) / comm; on CUDA also the direct measure, the share of
NCCL kernel time other kernels overlap in a torch.profiler timeline. Writes (rank 0)
DIR/parallel-mlp-<YYYY-MM-DD>.json and .md and removes the other parallel-mlp-<date> files there.
On shared hosts set NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1.
"""
import argparse
import datetime
import json
import os
import re
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

RECORD = re.compile(r"^parallel-mlp-\d{4}-\d{2}-\d{2}\.(json|md)$")


def log(msg):
    if dist.get_rank() == 0:
        print(f"[{datetime.datetime.now():%H:%M:%S}] {msg}", flush=True)


# ---- the plain baseline: synchronous collectives as autograd functions ---------------------------------

def _gather(x, group):
    out = x.new_empty((x.shape[0] * dist.get_world_size(group), *x.shape[1:]))
    dist.all_gather_into_tensor(out, x.contiguous(), group=group)
    return out


def _reduce_scatter(x, group):
    out = x.new_empty((x.shape[0] // dist.get_world_size(group), *x.shape[1:]))
    dist.reduce_scatter_tensor(out, x.contiguous(), group=group)
    return out


def _all_reduce(x, group):
    x = x.clone()
    dist.all_reduce(x, group=group)
    return x


def _identity(x, group):
    return x.view_as(x)


class _Collective(torch.autograd.Function):
    """fwd(x, group) in forward, bwd(g, group) in backward."""

    @staticmethod
    def forward(ctx, x, group, fwd, bwd):
        ctx.group, ctx.bwd = group, bwd
        return fwd(x, group)

    @staticmethod
    def backward(ctx, g):
        return ctx.bwd(g, ctx.group), None, None, None


class PlainParallelMLP(nn.Module):
    def __init__(self, fc1_w, fc1_b, fc2_w, fc2_b, group, sequence_parallel):
        super().__init__()
        self.fc1 = nn.Linear(fc1_w.shape[1], fc1_w.shape[0], device=fc1_w.device, dtype=fc1_w.dtype)
        self.fc2 = nn.Linear(fc2_w.shape[1], fc2_w.shape[0], bias=fc2_b is not None,
                             device=fc2_w.device, dtype=fc2_w.dtype)
        with torch.no_grad():
            self.fc1.weight.copy_(fc1_w)
            self.fc1.bias.copy_(fc1_b)
            self.fc2.weight.copy_(fc2_w)
            if fc2_b is not None:
                self.fc2.bias.copy_(fc2_b)
        self.group, self.sp = group, sequence_parallel

    def forward(self, x):
        pre, post = ((_gather, _reduce_scatter), (_reduce_scatter, _gather)) if self.sp else \
            ((_identity, _all_reduce), (_all_reduce, _identity))
        y = self.fc2(F.gelu(self.fc1(_Collective.apply(x, self.group, *pre)), approximate="tanh"))
        return _Collective.apply(y, self.group, *post)


# ---- timing ---------------------------------------------------------------------------------------------

class Timer:
    def __init__(self, device, warmup, reps):
        self.cuda = device.type == "cuda"
        self.device = device
        self.warmup, self.reps = warmup, reps

    def __call__(self, fn):
        for _ in range(self.warmup):
            fn()
        times = []
        for _ in range(self.reps):
            if self.cuda:
                torch.cuda.synchronize()
            dist.barrier()
            if self.cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end))
            else:
                t = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t) * 1e3)
        med = torch.tensor([statistics.median(times)], dtype=torch.float64, device=self.device)
        dist.all_reduce(med, op=dist.ReduceOp.MAX)  # the slowest rank sets the step time
        return med.item()


def rel_err(a, b):
    a, b = a.double(), b.double()
    return (torch.linalg.vector_norm(a - b) / torch.linalg.vector_norm(b)).item()


# ---- overlap from the kernel timeline ----------------------------------------------------------------

def merge_intervals(intervals):
    """Sorted, non-overlapping union of (start, end) intervals."""
    merged = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [tuple(iv) for iv in merged]


def total_length(intervals):
    return sum(end - start for start, end in intervals)


def intersection_length(a, b):
    """Length of (union a) & (union b); both already merged."""
    i = j = 0
    total = 0.0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if hi > lo:
            total += hi - lo
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def timeline_overlap(step, steps=5):
    """Runs `step` under torch.profiler and measures, from the GPU kernel timeline, how long NCCL
    kernels ran and how much of that time other kernels (GEMMs, elementwise, copies) ran at the
    same time on this GPU. Returns per-step milliseconds and the overlapped share."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    comm, compute = [], []
    for e in prof.events():
        if e.device_type != DeviceType.CUDA:
            continue
        (comm if "nccl" in e.name.lower() else compute).append((e.time_range.start, e.time_range.end))
    comm, compute = merge_intervals(comm), merge_intervals(compute)
    comm_us = total_length(comm)
    both_us = intersection_length(comm, compute)
    return {"comm_kernel_ms": comm_us / steps / 1e3, "overlapped_ms": both_us / steps / 1e3,
            "overlapped_share": both_us / comm_us if comm_us > 0 else float("nan")}


def bench_case(args, device, group, d, sp, timer):
    from fused_dense.functional import fused_mlp_func
    from fused_dense.parallel import ParallelFusedMLP, shard_range

    ws, rank = dist.get_world_size(), dist.get_rank()
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    h, rows = 4 * d, args.tokens
    assert rows % ws == 0 and h % ws == 0
    local_rows = rows // ws if sp else rows
    gen = torch.Generator(device="cpu").manual_seed(1234 + d)  # same full weights on every rank
    w1 = (torch.randn(h, d, generator=gen) / d ** 0.5).to(device, dtype)
    b1 = (torch.randn(h, generator=gen) * 0.1).to(device, dtype)
    w2 = (torch.randn(d, h, generator=gen) / h ** 0.5).to(device, dtype)
    b2 = (torch.randn(d, generator=gen) * 0.1).to(device, dtype)
    cols = shard_range(h, ws, rank)

    fused = ParallelFusedMLP(d, h, process_group=group, sequence_parallel=sp, device=device, dtype=dtype)
    with torch.no_grad():
        fused.fc1.weight.copy_(w1[cols])
        fused.fc1.bias.copy_(b1[cols])
        fused.fc2.weight.copy_(w2[:, cols])
        if fused.fc2.bias is not None:
            fused.fc2.bias.copy_(b2)
    plain = PlainParallelMLP(w1[cols], b1[cols], w2[:, cols], b2 if rank == 0 else None, group, sp)

    torch.manual_seed(99 + rank if sp else 99)  # without SP the input is replicated
    x = torch.randn(local_rows, d, device=device, dtype=dtype, requires_grad=True)
    g = torch.randn(local_rows, d, device=device, dtype=dtype)
    total_x = torch.randn(rows, d, device=device, dtype=dtype, requires_grad=True)
    total_g = torch.randn(rows, d, device=device, dtype=dtype)

    # correctness first: the two MLPs agree on output and input gradient
    out_f = fused(x)
    out_f.backward(g)
    gx_f = x.grad.clone()
    x.grad = None
    out_p = plain(x)
    out_p.backward(g)
    check = {"out": rel_err(out_f, out_p), "grad_x": rel_err(gx_f, x.grad),
             "grad_w1": rel_err(fused.fc1.weight.grad, plain.fc1.weight.grad)}
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    bad = {k: v for k, v in check.items() if not v <= tol}
    if bad:
        raise RuntimeError(f"d={d} sp={sp}: fused and plain disagree beyond {tol}: {bad}")

    def zero(*mods):
        x.grad = None
        total_x.grad = None
        for m in mods:
            for p in m.parameters():
                p.grad = None

    def step_fused():
        zero(fused)
        fused(x).backward(g)

    def step_plain():
        zero(plain)
        plain(x).backward(g)

    def step_fused_local():  # same shards, full rows in, no collectives
        zero(fused)
        fused_mlp_func(total_x, fused.fc1.weight, fused.fc2.weight, fused.fc1.bias, fused.fc2.bias,
                       activation="gelu_approx", heuristic="auto").backward(total_g)

    def step_plain_local():
        zero(plain)
        plain.fc2(F.gelu(plain.fc1(total_x), approximate="tanh")).backward(total_g)

    full = torch.empty(rows, d, device=device, dtype=dtype)
    part = torch.empty(rows // ws, d, device=device, dtype=dtype)
    src_full = torch.randn(rows, d, device=device, dtype=dtype)
    src_part = torch.randn(rows // ws, d, device=device, dtype=dtype)

    def step_comm():
        if sp:
            dist.all_gather_into_tensor(full, src_part, group=group)   # x
            dist.reduce_scatter_tensor(part, src_full, group=group)    # out
            dist.all_gather_into_tensor(full, src_part, group=group)   # grad_out
            dist.all_gather_into_tensor(full, src_part, group=group)   # x again (backward)
            dist.reduce_scatter_tensor(part, src_full, group=group)    # grad_x
        else:
            dist.all_reduce(src_full, group=group)                     # out
            dist.all_reduce(src_full, group=group)                     # grad_x

    res = {"d": d, "hidden": h, "tokens": rows, "sequence_parallel": sp, "dtype": str(dtype).split(".")[-1],
           "check_rel_err": check}
    for name, fn in (("fused", step_fused), ("plain", step_plain), ("fused_local", step_fused_local),
                     ("plain_local", step_plain_local), ("comm", step_comm)):
        res[f"{name}_ms"] = timer(fn)
    comm = res["comm_ms"]
    # ParallelFusedMLP with its collectives pipelined in row blocks (overlap_chunks)
    res["overlap_chunks"] = {}
    for n in args.overlap_chunks:
        if n == fused.overlap_chunks:
            continue
        default, fused.overlap_chunks = fused.overlap_chunks, n
        ms = timer(step_fused)
        fused.overlap_chunks = default
        res["overlap_chunks"][str(n)] = {"fused_ms": ms, "hidden": (res["fused_local_ms"] + comm - ms) / comm,
                                         "plain_over_fused": res["plain_ms"] / ms}
    res["hidden_fused"] = (res["fused_local_ms"] + comm - res["fused_ms"]) / comm
    res["hidden_plain"] = (res["plain_local_ms"] + comm - res["plain_ms"]) / comm
    res["plain_over_fused"] = res["plain_ms"] / res["fused_ms"]
    if device.type == "cuda":
        # the direct measure: NCCL kernel time that other kernels ran alongside
        res["timeline_fused"] = timeline_overlap(step_fused)
        res["timeline_plain"] = timeline_overlap(step_plain)
    flops = 6 * 2 * rows * d * h / ws  # six GEMMs per rank
    res["fused_tflops_per_gpu"] = flops / (res["fused_ms"] * 1e-3) / 1e12
    return res


def markdown(env, results):
    lines = [f"# ParallelFusedMLP benchmark ({env['world_size']} x {env['gpu']})", "",
             f"torch {env['torch']}, CUDA {env['cuda']}, NCCL {env['nccl']}, driver {env['driver']}, {env['date']}"
             + (f", source tree {env['git_tree'][:12]}" if env.get("git_tree") else "")
             + f". {results[0]['dtype'] if results else ''}, gelu_approx, hidden 4d, forward + backward, slowest "
             f"rank's median" + (f" of {env['reps']} repetitions" if env.get("reps") else "") + ".", "",
             "| d | tokens | SP | fused ms | plain ms | plain ÷ fused | fused local ms | comm ms | "
             "hidden by overlap (fused) | (plain) | TF/s per GPU |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['d']} | {r['tokens']} | {'on' if r['sequence_parallel'] else 'off'} | "
                     f"{r['fused_ms']:.3f} | {r['plain_ms']:.3f} | {r['plain_over_fused']:.3f} | "
                     f"{r['fused_local_ms']:.3f} | {r['comm_ms']:.3f} | {r['hidden_fused']:.0%} | "
                     f"{r['hidden_plain']:.0%} | {r['fused_tflops_per_gpu']:.0f} |")
    lines += ["", "hidden = (local compute + communication alone − step) ÷ communication alone, a difference of "
              "separate timings: for plain, which cannot overlap, it shows the noise. Fused and plain outputs and "
              "gradients agree (relative error in the JSON)."]
    chunked = [r for r in results if r.get("overlap_chunks")]
    if chunked:
        lines += ["", "ParallelFusedMLP(overlap_chunks=n), the collectives of n row blocks pipelined against "
                  "their GEMMs:", "", "| d | SP | n | fused ms | plain ÷ fused | hidden by overlap |",
                  "|---|---|---|---|---|---|"]
        for r in chunked:
            for n, v in r["overlap_chunks"].items():
                lines.append(f"| {r['d']} | {'on' if r['sequence_parallel'] else 'off'} | {n} | {v['fused_ms']:.3f} | "
                             f"{v['plain_over_fused']:.3f} | {v['hidden']:.0%} |")
    timed = [r for r in results if "timeline_fused" in r]
    if timed:
        lines += ["", "The direct measure, from the kernel timeline (torch.profiler, 5 steps): NCCL kernel time per "
                  "step (including the wait for the other ranks) and the share of it during which other kernels ran "
                  "on the same GPU.", "",
                  "| d | SP | fused: NCCL ms | fused: overlapped | plain: NCCL ms | plain: overlapped |",
                  "|---|---|---|---|---|---|"]
        for r in timed:
            f, p = r["timeline_fused"], r["timeline_plain"]
            lines.append(f"| {r['d']} | {'on' if r['sequence_parallel'] else 'off'} | {f['comm_kernel_ms']:.3f} | "
                         f"{f['overlapped_share']:.0%} | {p['comm_kernel_ms']:.3f} | {p['overlapped_share']:.0%} |")
    return "\n".join(lines) + "\n"


def write(env, results, out):
    """parallel-mlp-<date>.json and .md in out; the other runs of record there are removed."""
    os.makedirs(out, exist_ok=True)
    stem = os.path.join(out, f"parallel-mlp-{env['date']}")
    with open(stem + ".json", "w") as f:
        json.dump({"env": env, "results": results}, f, indent=1)
    with open(stem + ".md", "w") as f:
        f.write(markdown(env, results))
    for name in os.listdir(out):
        if RECORD.match(name) and not os.path.join(out, name).startswith(stem + "."):
            os.remove(os.path.join(out, name))
    return stem


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", help="output directory (docs/results for the run of record)")
    ap.add_argument("--report", metavar="JSON", help="only write the markdown of this JSON beside it")
    ap.add_argument("--dims", type=int, nargs="+", default=[4096, 8192])
    ap.add_argument("--tokens", type=int, default=8192, help="rows over all ranks")
    ap.add_argument("--overlap-chunks", type=int, nargs="+", default=[1, 2, 4],
                    help="ParallelFusedMLP overlap_chunks values timed besides the default (1)")
    ap.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    if args.report:
        with open(args.report) as f:
            data = json.load(f)
        with open(os.path.splitext(args.report)[0] + ".md", "w") as f:
            f.write(markdown(data["env"], data["results"]))
        return
    if not args.out:
        ap.error("--out is required")
    use_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if use_cuda:
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    import fused_dense
    from bench import environment, power

    env = {"world_size": dist.get_world_size(), "torch": torch.__version__, "cuda": torch.version.cuda,
           "nccl": ".".join(map(str, torch.cuda.nccl.version())) if use_cuda else None,
           "gpu": torch.cuda.get_device_name(device) if use_cuda else "CPU",
           "driver": power.gpu_state(local_rank).get("driver") if use_cuda else None,
           "date": datetime.datetime.now(datetime.timezone.utc).date().isoformat(),
           "fused_dense_cuda": fused_dense.has_cuda_kernels(), "warmup": args.warmup, "reps": args.reps,
           "git_tree": environment.source_tree_id() if dist.get_rank() == 0 else None}
    timer = Timer(device, args.warmup, args.reps)
    results = []
    for d in args.dims:
        for sp in (True, False):
            log(f"d={d} sequence_parallel={sp} tokens={args.tokens} world_size={env['world_size']}")
            r = bench_case(args, device, group=dist.group.WORLD, d=d, sp=sp, timer=timer)
            results.append(r)
            log(f"  fused {r['fused_ms']:.3f} ms  plain {r['plain_ms']:.3f} ms"
                f"  (plain/fused {r['plain_over_fused']:.3f})  local {r['fused_local_ms']:.3f}  comm {r['comm_ms']:.3f}  hidden {r['hidden_fused']:.0%}"
                f" (plain {r['hidden_plain']:.0%})")
            if use_cuda:
                torch.cuda.empty_cache()
    if dist.get_rank() == 0:
        stem = write(env, results, args.out)
        print(markdown(env, results))
        log(f"wrote {stem}.json, .md")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
