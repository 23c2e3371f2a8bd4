#!/usr/bin/env python
"""The dynamic benchmark: heuristic='auto' when the token count changes every step.

    python -m bench.dynamic --out docs/results          # the run of record (H200: ~3 min)
    python -m bench.dynamic --out DIR --device cpu --quick   # a functional check of the script

Parts, all bf16, gelu_approx, hidden 4d, forward + backward:
  passes   40 distinct token counts drawn from [1024, 16384): one pass over them, then a second
           pass over the same counts, for FusedMLP and for the nn.Linear MLP, each in a fresh
           process (its own CUDA context, caches and tuner), --rounds processes each,
           interleaved, under two protocols: cold (both warmed up only on an unrelated small
           shape, so neither pays CUDA's initialisation, but each loads its GEMM kernels and
           builds its plans on the way: what a fresh process sees) and warm (both first run an
           nn.Linear MLP of the same width over 40 other token counts, which loads cuBLAS's
           kernels for the range: what is left is each MLP's own per-token-count cost, for
           FusedMLP the tuner's). At d = 1024 (a width in the shipped table) and at d = 1280
           with the table left out (FUSED_DENSE_TUNING_TABLE=0), so bucketing and the budget do
           the work. Reported: each pass's wall time and its ratio to nn.Linear's (medians).
  buckets  bucketed against exact-M choices at 20 token counts that are no bucket's
           representative on the default grid, at d = 1024 and 4096: the bucket rule alone (refine
           off) on grids of 2, 4 (the default) and 8 representatives per octave, and the default
           (4 per octave, refine on: a count is measured at its own M once measuring is allowed,
           and then holds the exact-M key's choice, so this row shows what timing noise alone
           moves); every mode's choices measured first (unpaced), then each count timed under
           each, interleaved in --rounds rounds, the L2 cache flushed before each step; a count
           where a mode loses more than 3% is timed again, exact-M and that mode, in 5 more
           rounds, and the re-timing's loss is the one reported (the first kept beside it).
           Reported: the loss t_mode / t_exact - 1 per count and mode, median and maximum, and
           how many counts were re-timed.
  training examples/train_gpt.py --variable-length (each MLP in its own process): cumulative
           tokens/s of FusedMLP over nn.Linear's after each step.
Targets (the H200): passes at d = 1024 first <= 1.3x nn.Linear and second <= today's 0.67x; at
d = 1280 first <= 5x and second <= 1x; buckets median loss <= 1%, none > 3%; training never behind.
Writes DIR/dynamic-<YYYY-MM-DD>.json, .md and .png and removes the other dynamic-<date> files there.
"""
import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from bench import report, timing  # noqa: E402

TARGETS = {"passes_tabled_first": 1.3, "passes_tabled_second": 0.67, "passes_untabled_first": 5.0,
           "passes_untabled_second": 1.0, "buckets_median_loss": 0.01, "buckets_max_loss": 0.03}


def log(msg):
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


class PlainMLP(nn.Module):
    def __init__(self, d, h, device, dtype):
        super().__init__()
        self.fc1 = nn.Linear(d, h, device=device, dtype=dtype)
        self.fc2 = nn.Linear(h, d, device=device, dtype=dtype)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


def make_mlp(model, d, device, dtype):
    if model == "fused":
        from fused_dense import FusedMLP
        return FusedMLP(d, 4 * d, activation="gelu_approx", device=device, dtype=dtype)
    return PlainMLP(d, 4 * d, device, dtype)


def token_counts(n, lo, hi, seed, exclude=()):
    rng = random.Random(seed)
    counts = []
    while len(counts) < n:
        m = rng.randrange(lo, hi)
        if m not in counts and m not in exclude:
            counts.append(m)
    return counts


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ---- workers (each in its own process)


def worker_passes(args):
    """Prints one JSON line: the two passes' wall times (and the tuner's counters for FusedMLP)."""
    device, dtype = torch.device(args.device), torch.bfloat16 if args.device == "cuda" else torch.float32
    torch.manual_seed(0)
    counts = json.loads(args.counts_json)
    warm = make_mlp(args.model, 64, device, dtype)  # CUDA context, cuBLAS handle, the library's plans
    x = torch.randn(64, 64, device=device, dtype=dtype, requires_grad=True)
    warm(x).sum().backward()
    if args.protocol == "warm":  # cuBLAS's kernels for the range, loaded by other token counts
        plain = make_mlp("linear", args.d, device, dtype)
        for m in token_counts(len(counts), min(counts), max(counts) + 1, seed=31, exclude=counts):
            x = torch.randn(m, args.d, device=device, dtype=dtype, requires_grad=True)
            plain(x).sum().backward()
        del plain, x
    mlp = make_mlp(args.model, args.d, device, dtype)
    xs = [torch.randn(m, args.d, device=device, dtype=dtype).requires_grad_() for m in counts]
    gs = [torch.randn(m, args.d, device=device, dtype=dtype) for m in counts]
    sync(device)
    passes = []
    for _ in range(2):
        t0 = time.perf_counter()
        for x, g in zip(xs, gs):
            mlp(x).backward(g)
        sync(device)
        passes.append(time.perf_counter() - t0)
    out = {"first_s": passes[0], "second_s": passes[1]}
    if args.model == "fused" and device.type == "cuda":
        from fused_dense import tuning
        out["tuning"] = tuning.stats()
    print("RESULT " + json.dumps(out), flush=True)


def time_step(mlp, x, g, reps):
    """Median ms of reps forward + backward steps (CUDA events), the L2 cache flushed before each."""
    flush = timing.l2_flush_buffer(x.device)
    times = []
    for _ in range(reps):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        flush.zero_()
        start.record()
        mlp(x).backward(g)
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop))
    return statistics.median(times)


GRIDS = (2, 4, 8)  # buckets per octave compared with exact-M choices (0), refine off: the rule alone
REFINED = "refined"  # the default grid with refine on (the package's default): counts measured at their M


def mode_settings(mode):
    """tuning.configure arguments of a mode: 0 (exact-M keys), a grid of GRIDS (refine off) or REFINED."""
    if mode == REFINED:
        return dict(buckets=4, refine=True)
    return dict(buckets=mode, refine=False)


RETIME_ROUNDS = 5  # a count whose loss passes the max-loss target under any mode is timed again


def time_modes(mlp, x, g, modes, rounds, reps, offset):
    """{mode: [ms per round]}: the step under each mode's choices, the modes interleaved, their order
    rotated by round (starting at `offset`)."""
    from fused_dense import tuning
    ms = {b: [] for b in modes}
    for r in range(rounds):
        k = (r + offset) % len(modes)
        for b in modes[k:] + modes[:k]:
            tuning.configure(**mode_settings(b))
            time_step(mlp, x, g, 2)  # warm: the first call at this M under these choices
            ms[b].append(time_step(mlp, x, g, reps))
    return ms


def bucket_under(mode, m):
    """The tuner's bucket of token count m under a mode's settings."""
    from fused_dense import tuning
    tuning.configure(**mode_settings(mode))
    return tuning.m_bucket(m)


def count_row(m, ms, retime, bucket_of=bucket_under):
    """One token count's row from its rounds {mode: [ms]} (mode 0: exact-M choices): per mode its
    bucket, median ms and loss against exact-M. Where modes lose more than the max-loss target,
    retime((0, *those modes)) times them again and their figures become the re-timing's."""
    exact = statistics.median(ms[0])
    row = {"tokens": m, "exact_ms": exact}
    for b in GRIDS + (REFINED,):
        t = statistics.median(ms[b])
        row[str(b)] = {"bucket": bucket_of(b, m), "ms": t, "loss": t / exact - 1}
    outliers = tuple(b for b in GRIDS + (REFINED,) if row[str(b)]["loss"] > TARGETS["buckets_max_loss"])
    if outliers:
        again = retime((0,) + outliers)
        exact_again = statistics.median(again[0])
        row["retimed_exact_ms"] = exact_again
        for b in outliers:
            t = statistics.median(again[b])
            row[str(b)].update(first_loss=row[str(b)]["loss"], ms=t, loss=t / exact_again - 1, retimed=True)
    return row


def worker_buckets(args):
    """Prints one JSON line: per token count, the step time under exact-M choices and under each
    grid's bucketed choices. A count where some mode loses more than the max-loss target is an
    outlier: exact-M and those modes are timed in RETIME_ROUNDS more interleaved rounds, and their
    losses become the re-timing's own (the first rounds' kept as first_loss)."""
    from fused_dense import tuning
    device, dtype = torch.device("cuda"), torch.bfloat16
    torch.manual_seed(0)
    counts = json.loads(args.counts_json)
    mlp = make_mlp("fused", args.d, device, dtype)
    data = {m: (torch.randn(m, args.d, device=device, dtype=dtype).requires_grad_(),
                torch.randn(m, args.d, device=device, dtype=dtype)) for m in counts}
    tuning.configure(enabled=True, budget_s=1e6, pace=1.0, table="", cache="")
    modes = (0,) + GRIDS + (REFINED,)
    for b in modes:  # measure every set of choices before timing anything
        tuning.configure(**mode_settings(b))
        for m in counts:
            mlp(data[m][0]).backward(data[m][1])
    sync(device)
    rows = []
    for i, m in enumerate(counts):
        x, g = data[m]
        row = count_row(m, time_modes(mlp, x, g, modes, args.rounds, args.reps, i),
                        lambda again: time_modes(mlp, x, g, again, RETIME_ROUNDS, args.reps, i))
        rows.append(row)
        log(f"  d={args.d} M={m}: exact {row['exact_ms']:.3f} ms; " + ", ".join(
            f"{b}{'/octave' if b != REFINED else ''} {100 * row[str(b)]['loss']:+.2f}%" for b in GRIDS + (REFINED,)))
    print("RESULT " + json.dumps(rows), flush=True)


# ---- the supervisor


def run_worker(kind, extra, env_extra=None, timeout=900):
    env = dict(os.environ)
    env.pop("FUSED_DENSE_TUNING_CACHE", None)
    env.update(env_extra or {})
    cmd = [sys.executable, "-m", "bench.dynamic", "--worker", kind, *extra]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    sys.stderr.write(proc.stderr[-4000:] if proc.returncode else "")
    for line in proc.stdout.splitlines():
        if line.startswith("  d="):
            print(line, flush=True)
    lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"worker {kind} {extra} failed ({proc.returncode}): {proc.stdout[-1500:]}{proc.stderr[-1500:]}")
    return json.loads(lines[-1][len("RESULT "):])


def part_passes(args):
    lo, hi = (1024, 16384) if args.device == "cuda" else (16, 256)
    counts = token_counts(args.counts, lo, hi, seed=23)
    configs = [(f"{table}_{protocol}", protocol, d, env)
               for protocol in ("warm", "cold")
               for table, d, env in (("tabled", 1024 if args.device == "cuda" else 64, {}),
                                     ("untabled", 1280 if args.device == "cuda" else 80,
                                      {"FUSED_DENSE_TUNING_TABLE": "0"}))]
    out = {}
    for name, protocol, d, env in configs:
        runs = {"fused": [], "linear": []}
        for r in range(args.rounds):
            for model in (("fused", "linear") if r % 2 == 0 else ("linear", "fused")):
                res = run_worker("passes", ["--model", model, "--d", str(d), "--device", args.device,
                                            "--protocol", protocol, "--counts-json", json.dumps(counts)], env)
                runs[model].append(res)
                log(f"passes {name} d={d} {model}: first {res['first_s']:.3f} s, second {res['second_s']:.3f} s")
        med = {m: {p: statistics.median(r[p] for r in runs[m]) for p in ("first_s", "second_s")} for m in runs}
        out[name] = {"d": d, "hidden": 4 * d, "table": not env, "protocol": protocol, "token_range": [lo, hi],
                     "token_counts": counts,
                     "runs": runs, "median": med,
                     "first_ratio": med["fused"]["first_s"] / med["linear"]["first_s"],
                     "second_ratio": med["fused"]["second_s"] / med["linear"]["second_s"]}
        log(f"passes {name}: FusedMLP / nn.Linear first pass {out[name]['first_ratio']:.2f}x, "
            f"second pass {out[name]['second_ratio']:.2f}x")
    return out


def part_buckets(args):
    from fused_dense import tuning
    reps = set(tuning.representatives(1024, 16384))  # the default grid's
    default = tuning.settings()["buckets"]
    counts = token_counts(args.bucket_counts, 1024, 16384, seed=29, exclude=reps)
    out = {}
    for d in (1024, 4096):
        rows = run_worker("buckets", ["--d", str(d), "--counts-json", json.dumps(counts), "--rounds", str(args.bucket_rounds),
                                      "--reps", str(args.reps)])
        out[str(d)] = {"rows": rows, "default": default}
        for b in GRIDS + (REFINED,):
            if str(b) not in rows[0]:
                continue
            losses = [r[str(b)]["loss"] for r in rows]
            out[str(d)][str(b)] = {"median_loss": statistics.median(losses), "max_loss": max(losses),
                                   "retimed": sum(bool(r[str(b)].get("retimed")) for r in rows)}
            log(f"buckets d={d}, {b}{' per octave' if b != REFINED else ''}: median loss {100 * statistics.median(losses):+.2f}%, "
                f"max {100 * max(losses):+.2f}%")
    return out


def part_training(args):
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, os.path.join(ROOT, "examples", "train_gpt.py"), "--variable-length", "--out", tmp,
               "--device", args.device] + (["--steps", "40"] if args.quick else [])
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1800)
        print(proc.stdout[-3000:], flush=True)
        if proc.returncode not in (0, 1):
            raise RuntimeError(f"train_gpt.py --variable-length failed: {proc.stderr[-2000:]}")
        with open(os.path.join(tmp, "train_gpt.json")) as f:
            rep = json.load(f)
    runs = rep["runs"]
    out = {"config": rep["config"], "agreement": rep["agreement"],
           "tokens_per_s": {k: v["tokens_per_s"] for k, v in runs.items()},
           "cumulative_tokens_per_s": {k: v["cumulative_tokens_per_s"] for k, v in runs.items()}}
    return out


def markdown(res):
    env = res["environment"]
    lines = [f"# Dynamic token counts: heuristic='auto' without stalls ({env.get('date_utc', '')[:10]})", "",
             f"{report.environment_line(env)}. bf16, gelu_approx, hidden 4d, forward + backward. "
             "Produced by `python -m bench.dynamic` (bench/dynamic.py says what each part measures).", ""]
    if "passes" in res:
        first = next(iter(res["passes"].values()))
        lo, hi = first["token_range"]
        lines += [f"## Passes over {len(first['token_counts'])} new token counts ([{lo}, {hi}))", "",
                  "| protocol | width | table | FusedMLP first pass | nn.Linear first pass | ratio (target) | "
                  "FusedMLP second | nn.Linear second | ratio (target) |", "|---|---|---|---|---|---|---|---|---|"]
        for name, p in res["passes"].items():
            table = "tabled" if p["table"] else "untabled"
            t1, t2 = TARGETS[f"passes_{table}_first"], TARGETS[f"passes_{table}_second"]
            m = p["median"]
            lines.append(f"| {p['protocol']} | {p['d']} → {p['hidden']} | {'shipped' if p['table'] else 'off'} | "
                         f"{m['fused']['first_s'] * 1e3:.1f} ms | {m['linear']['first_s'] * 1e3:.1f} ms | "
                         f"{p['first_ratio']:.2f}× (≤ {t1}) | {m['fused']['second_s'] * 1e3:.1f} ms | "
                         f"{m['linear']['second_s'] * 1e3:.1f} ms | {p['second_ratio']:.2f}× (≤ {t2}) |")
        lines.append("")
    if "buckets" in res:
        lines += ["## Bucketed against exact-M choices (token counts that are no representative of the default grid)",
                  "", "Each count in its own bucket's choice: the rule alone (refine off) on grids of 2, 4 and 8 "
                  "representatives per octave, and the package's default (4 per octave, refine on: the count "
                  "measured at its own M once measuring is allowed; here it always is).", "",
                  "| width | choices | median loss (≤ 1%) | max loss (≤ 3%) | counts re-timed |",
                  "|---|---|---|---|---|"]
        for d, per_d in res["buckets"].items():
            for b in GRIDS + (REFINED,):
                if str(b) not in per_d:
                    continue
                g = per_d[str(b)]
                name = ("default: 4 per octave, refined at the exact M" if b == REFINED else
                        f"{b} per octave, rule alone{' (the default grid)' if b == per_d.get('default', 2) else ''}")
                lines.append(f"| {d} → {4 * int(d)} | {name} | "
                             f"{100 * g['median_loss']:+.2f}% | {100 * g['max_loss']:+.2f}% | "
                             f"{g.get('retimed', '–')} |")
        lines.append("")
    if "training" in res:
        t = res["training"]
        lines += ["## Training with variable sequence lengths (examples/train_gpt.py --variable-length)", "",
                  "| run | tokens/s |", "|---|---|"]
        lines += [f"| {k} | {v:,.0f} |" for k, v in t["tokens_per_s"].items()]
        for mode, a in t["agreement"].items():
            ratios = ", ".join(f"step {k}: {v:.3f}×" for k, v in a.get("cumulative_ratio_after_step", {}).items())
            behind = a.get("steps_where_fused_cumulative_is_behind", [])
            lines += ["", f"{mode}: cumulative tokens/s FusedMLP / nn.Linear after {ratios}; FusedMLP behind at "
                      f"{len(behind)} steps{(' (first: ' + ', '.join(map(str, behind[:5])) + ')') if behind else ''}."]
        lines.append("")
    return "\n".join(lines)


def make_png(res, path):
    plt = report.pyplot()
    if plt is None:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    if "passes" in res:
        ax = axes[0]
        names = [n for n in res["passes"] if n.endswith("_warm")] or list(res["passes"])
        for j, which in enumerate(("first_ratio", "second_ratio")):
            ax.bar([i + 0.38 * j for i in range(len(names))], [res["passes"][n][which] for n in names], 0.36,
                   label=which.replace("_ratio", " pass"))
        ax.set_xticks([i + 0.19 for i in range(len(names))],
                      [f"d={res['passes'][n]['d']} ({'table' if res['passes'][n]['table'] else 'no table'}, "
                       f"{res['passes'][n]['protocol']})"
                       for n in names])
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set(ylabel="FusedMLP time / nn.Linear MLP time", title="40 new token counts")
        ax.legend()
    if "training" in res:
        ax = axes[1]
        cum = res["training"]["cumulative_tokens_per_s"]
        for k, v in cum.items():
            if v:
                ax.plot(range(1, len(v) + 1), v, "--" if "nn.Linear" in k else "-", label=k)
        ax.set(xlabel="step", ylabel="cumulative tokens/s", title="GPT, variable sequence lengths")
        ax.legend()
    return report.save_figure(plt, fig, path)


def parse_args(argv):
    p = report.record_parser(__doc__)
    p.add_argument("--parts", default="passes,buckets,training", help="comma list of passes, buckets, training")
    p.add_argument("--rounds", type=int, default=2, help="processes per MLP and protocol (passes)")
    p.add_argument("--bucket-rounds", type=int, default=3, help="timing rounds (buckets)")
    p.add_argument("--reps", type=int, default=10, help="steps per timing (buckets)")
    p.add_argument("--counts", type=int, default=40, help="token counts per pass")
    p.add_argument("--bucket-counts", type=int, default=20)
    p.add_argument("--quick", action="store_true", help="fewer counts, rounds and training steps")
    p.add_argument("--worker", choices=["passes", "buckets"], help=argparse.SUPPRESS)
    p.add_argument("--model", choices=["fused", "linear"], help=argparse.SUPPRESS)
    p.add_argument("--d", type=int, help=argparse.SUPPRESS)
    p.add_argument("--protocol", choices=["warm", "cold"], default="cold", help=argparse.SUPPRESS)
    p.add_argument("--counts-json", dest="counts_json", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker or args.report:
        return args
    if not args.out:
        p.error("--out is required")
    parts = args.parts.split(",")
    unknown = [x for x in parts if x not in ("passes", "buckets", "training")]
    if unknown:
        p.error(f"--parts: unknown {', '.join(unknown)}")
    if args.device == "cpu" and "buckets" in parts:
        p.error("--parts buckets needs --device cuda (it compares tuned choices)")
    if args.quick:
        args.rounds, args.bucket_rounds, args.reps, args.counts, args.bucket_counts = 1, 1, 3, 8, 4
    if min(args.rounds, args.bucket_rounds, args.reps, args.counts, args.bucket_counts) < 1:
        p.error("--rounds, --reps, --counts and --bucket-counts must be >= 1")
    args.parts = parts
    return args


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.worker == "passes":
        return worker_passes(args)
    if args.worker == "buckets":
        return worker_buckets(args)
    if args.report:
        report.rewrite_dated_record(args.report, markdown, make_png)
        return None
    from bench import environment
    device = torch.device(args.device)
    res = {"environment": environment.environment(device, sys.argv if argv is None else argv), "targets": TARGETS}
    for part, fn in (("passes", part_passes), ("buckets", part_buckets), ("training", part_training)):
        if part in args.parts:
            log(f"part {part}")
            res[part] = fn(args)
    log("wrote " + ", ".join(report.write_dated_record(args.out, "dynamic", res, markdown, make_png)))


if __name__ == "__main__":
    main()
