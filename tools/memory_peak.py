"""What is alive at a training step's memory peak: one bench.model config's variants, each built
alone, warmed up, then one step recorded with torch.cuda.memory._record_memory_history. The
allocation trace is replayed to find the step's peak (bytes allocated since the step began), and
the allocations alive at that moment are listed by size with the Python frame that made them
(the first frame outside torch, or the compiled graph's generated file), grouped and one by one.

    python tools/memory_peak.py --config llama-2048 --variants fd_fp8_current_qkv_compile,torchao_compile \
        --causal-sdpa --out DIR

Writes DIR/memory_peak.json and prints a table per variant. GPU only.
"""
import argparse
import collections
import gc
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench import model as bm  # noqa: E402

MIB = 2**20
SKIP = ("/torch/", "/contextlib.py", "/functools.py")


def label(frames):
    """The frame that says who allocated: the first not inside torch itself (compiled graphs' files
    under torchinductor's cache are kept: they name the graph), else the innermost frame."""
    for f in frames:
        name = f.get("filename", "")
        if "torchinductor" in name or not any(s in name for s in SKIP):
            return f"{os.path.basename(name)}:{f.get('line')}:{f.get('name')}"
    return f"{frames[0].get('filename', '?')}:{frames[0].get('line')}" if frames else "?"


def replay(events):
    """(peak bytes over the step, index of the event that reached it): allocations count from the
    step's start, frees of blocks allocated before it count too (they lower the step's level)."""
    cur = peak = 0
    at = -1
    for i, ev in enumerate(events):
        if ev["action"] == "alloc":
            cur += ev["size"]
            if cur > peak:
                peak, at = cur, i
        elif ev["action"] == "free_completed":
            cur -= ev["size"]
    return peak, at


def alive_at(events, at):
    alive = {}
    for ev in events[:at + 1]:
        if ev["action"] == "alloc":
            alive[ev["addr"]] = ev
        elif ev["action"] == "free_completed":
            alive.pop(ev["addr"], None)
    return list(alive.values())


def measure(key, cfg, base, ids, device, warm=3):
    r = bm.Runner(key, base, device)
    for _ in range(warm):
        r.step(ids)
    r.sync()
    gc.collect()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    torch.cuda.memory._record_memory_history(enabled="all", context="alloc", stacks="python", max_entries=500000)
    r.step(ids)
    r.sync()
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    peak_stat = torch.cuda.max_memory_allocated(device) - before
    events = [e for e in snap["device_traces"][device.index or 0] if e["action"] in ("alloc", "free_completed")]
    peak, at = replay(events)
    alive = alive_at(events, at)
    groups = collections.Counter()
    count = collections.Counter()
    rows = []
    for ev in alive:
        lab = label(ev.get("frames", []))
        groups[lab] += ev["size"]
        count[lab] += 1
        rows.append((ev["size"], lab))
    rows.sort(reverse=True)
    out = {"key": key, "note": r.note, "resident_bytes": before, "peak_bytes": peak_stat, "replayed_peak_bytes": peak,
           "peak_event": label(events[at].get("frames", [])) if at >= 0 else None, "alive_bytes": sum(groups.values()),
           "groups": [[lab, b, count[lab]] for lab, b in groups.most_common()], "largest": rows[:60]}
    del r
    gc.collect()
    torch.cuda.empty_cache()
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="llama-2048", choices=sorted(bm.CONFIGS))
    p.add_argument("--variants", default="fd_fp8_current_qkv_compile,torchao_compile")
    p.add_argument("--causal-sdpa", action="store_true")
    p.add_argument("--out", default=".")
    args = p.parse_args(argv)
    device = torch.device("cuda")
    if args.causal_sdpa:
        bm.causal_sdpa_under_compile()
    bm.allow_compiled_variants()
    cfg = bm.CONFIGS[args.config]
    base = bm.build_hf(cfg, device, torch.bfloat16)
    ids = bm.batches(bm.text_tokens(), cfg, 1, device)[0]
    res = []
    for key in args.variants.split(","):
        m = measure(key, cfg, base, ids, device)
        res.append(m)
        print(f"\n== {key}: step peak over resident {m['peak_bytes'] / MIB:,.0f} MiB (replayed "
              f"{m['replayed_peak_bytes'] / MIB:,.0f}), reached at {m['peak_event']}; alive then, allocated in the step: "
              f"{m['alive_bytes'] / MIB:,.0f} MiB", flush=True)
        for lab, b, n in m["groups"][:25]:
            print(f"  {b / MIB:9,.1f} MiB  {n:4d}  {lab}")
        print("  largest:")
        for b, lab in m["largest"][:25]:
            print(f"  {b / MIB:9,.1f} MiB  {lab}")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "memory_peak.json"), "w") as f:
        json.dump({"config": args.config, "variants": res}, f, indent=1)


if __name__ == "__main__":
    main()
