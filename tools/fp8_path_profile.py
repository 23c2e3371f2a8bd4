"""Where the FP8 MLPs' pre_fp8 save path (Float8Recipe(save_pre_fp8=True)) spends its time against
the default path: bench.memory's MLP shapes and variants, each pair of paths (current and delayed
scaling) timed in many interleaved rounds, the per-round ratio pre_fp8 / default and its median,
then torch.profiler's kernel time a step of each variant, kernel by kernel, the two paths side by
side with the kernels that differ most first.

    python tools/fp8_path_profile.py --json FILE [--rounds 15] [--shapes 0,1,2]

A diagnostic (docs/performance.md, "The pre-activation in e4m3"), not a run of record.
"""
import argparse
import json
import os
import statistics
import sys
from types import SimpleNamespace

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402

from bench import environment, memory, model  # noqa: E402
from bench.gated import EagerGatedMLP  # noqa: E402
from bench.sections import EagerMLP, first  # noqa: E402
from bench.timing import Bench  # noqa: E402

sys.path.insert(0, os.path.join(ROOT, "tools"))
import host_step  # noqa: E402
from sanitize_summary import TEMPLATE_WIDTH, short  # noqa: E402

GAP_STEPS = 5  # steps traced for the gaps
WALL_STEPS = 15  # synchronized steps for the wall and host times


def kernels(fn, calls=3):
    """{kernel name: ms a call} over `calls` calls (bench.model's profile, every kernel kept)."""
    _, top = model.profile_calls(fn, calls, top=None)
    out = {}
    for name, _cls, ms, _launches in top:
        out[name] = out.get(name, 0.0) + ms
    return out


def step_gaps(fn, device):
    """fn's step as the GPU sees it: median wall ms of a synchronized step, median host ms to issue
    it, and its idle gaps (host_step.gap_steps over GAP_STEPS steps)."""
    r = SimpleNamespace(device=device, sync=lambda: torch.cuda.synchronize(device), step=lambda _ids: fn())
    walls = host_step.wall_steps(r, [None] * WALL_STEPS)
    gaps = host_step.gap_steps(r, [None] * GAP_STEPS, top=8)
    return {"wall_ms": round(statistics.median(w for _, w in walls), 4),
            "host_ms": round(statistics.median(h for h, _ in walls), 4), **gaps}


def run_shape(shape, rounds, device, gaps=False):
    label, activation, M, d, h = shape
    torch.manual_seed(0)
    dtype = torch.bfloat16
    eager = (EagerMLP if label == "gelu" else EagerGatedMLP)(d, h, activation, device, dtype)
    x = torch.randn(M, d, device=device, dtype=dtype).requires_grad_(True)
    dy = torch.randn(M, d, device=device, dtype=dtype)
    steps, mods = {}, {}
    for scaling in memory.FP8_SCALINGS:
        for path in memory.FP8_PATHS:
            key = memory.fp8_key(scaling, path)
            mod = memory.build_mlp(key, label, activation, d, h, eager, x, dy, device, dtype)

            def step(mod=mod):
                first(mod(x)).backward(dy)
            for _ in range(3):
                step()
            steps[key] = (step, list(mod.parameters()) + [x])
            mods[key] = mod
    timed = Bench(device).interleaved(steps, rounds)
    rec = {"shape": f"{label} {M} x {d} -> {h}", "ms": {}, "ratios": {}, "kernels": {}}
    for key, t in timed.items():
        rec["ms"][key] = round(t["ms"], 4)
    for scaling in memory.FP8_SCALINGS:
        old, new = memory.fp8_key(scaling, "default"), memory.fp8_key(scaling, "pre_fp8")
        per = [b / a for a, b in zip(timed[old]["round_ms"], timed[new]["round_ms"])]
        rec["ratios"][scaling] = {"median_of_rounds": round(statistics.median(per), 4),
                                  "rounds": [round(r, 4) for r in per],
                                  "ratio_of_medians": round(timed[new]["ms"] / timed[old]["ms"], 4)}
        prof = {k: kernels(steps[k][0]) for k in (old, new)}
        names = set(prof[old]) | set(prof[new])
        rows = sorted(([n, round(prof[old].get(n, 0.0), 4), round(prof[new].get(n, 0.0), 4)] for n in names),
                      key=lambda r: -abs(r[2] - r[1]))
        rec["kernels"][scaling] = {"total": [round(sum(prof[old].values()), 4), round(sum(prof[new].values()), 4)],
                                   "rows": rows[:25]}
        if gaps:
            rec.setdefault("gaps", {}).update({k: step_gaps(steps[k][0], device) for k in (old, new)})
    model.log(json.dumps({k: rec[k] for k in ("shape", "ms", "ratios")}))
    for scaling, kk in rec["kernels"].items():
        model.log(f"{rec['shape']} {scaling}: kernel ms a step default {kk['total'][0]} pre_fp8 {kk['total'][1]}")
        for n, a, b in kk["rows"][:12]:
            model.log(f"  {a:8.4f} {b:8.4f} {b - a:+8.4f}  {short(n, TEMPLATE_WIDTH)}")
    for key, g in rec.get("gaps", {}).items():
        model.log(f"{rec['shape']} {key}: wall {g['wall_ms']} ms, host {g['host_ms']}, idle {g['idle_ms_a_step']:.4f} "
                  f"(host-late {g['host_late_ms_a_step']:.4f})")
        for row in g["gaps_by_op"][:5]:
            model.log(f"    {row['ms_a_step']:8.4f} ms {row['gaps_a_step']:6.1f} gaps  {row['op'][:90]}")
    return rec


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", required=True)
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--shapes", default=",".join(str(i) for i in range(len(memory.SHAPES))),
                   help="indices into bench.memory.SHAPES")
    p.add_argument("--gaps", action="store_true", help="also each step's wall, host and GPU idle time (see above)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("fp8_path_profile: needs a CUDA GPU")
    device = torch.device("cuda")
    out = {"environment": environment.environment(device, sys.argv), "shapes": []}
    for i in (int(s) for s in args.shapes.split(",")):
        out["shapes"].append(run_shape(memory.SHAPES[i], args.rounds, device, args.gaps))
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
        torch._dynamo.reset()
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
