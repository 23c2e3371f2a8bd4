"""The mainloop search's run of record (#40): renders the native harness's JSON
(bench/native/mainloop_search.cu) and ptxas's resources (bench/native/build_mainloop.sh) as
docs/results/mainloop-DATE.{json,md,png}.

    bash bench/native/build_mainloop.sh build/mainloop          # here or on the GPU machine
    build/mainloop/mainloop_search --out mainloop.json          # on the GPU machine
    python -m bench.mainloop mainloop.json --resources build/mainloop/resources.json \\
        --commit COMMIT --out docs/results [--ncu NCU.csv ...]

(--ncu: the CSV of `ncu --csv --page details ... mainloop_search --profile P NAME ...`,
bench/native/README.md; its counters are added to the record.)

What each figure is: per role and shape, the kernel time (CUDA events around one launch after a
512 MiB L2 flush; the median of 10 launches per round, the median of the rounds) of cuBLASLt's
first heuristic algorithm, of its fastest among those its heuristic offers, and of the best three
(configuration, scheduler order) pairs of the screening, all interleaved; once at full clock and
once after a sustained load. The target (#40): ours <= 1.02x cuBLASLt's GEMM at the same shape
and D, both measurements.
"""
import argparse
import datetime
import json
import os
import sys

TARGET = 1.02


def ratio_rows(res):
    rows = []
    for p in res["problems"]:
        fin = {f["name"]: f for f in p["final"]}
        lt_first, lt_best = fin["cublaslt_first"], fin["cublaslt_fastest"]
        ours = [f for f in p["final"] if f["config"] >= 0]
        best_full = min(ours, key=lambda f: f["full_ms"]) if ours else None
        best_sus = min(ours, key=lambda f: f["sustained_ms"]) if ours else None
        base_full = min(lt_first["full_ms"], lt_best["full_ms"])
        base_sus = min(lt_first["sustained_ms"], lt_best["sustained_ms"])
        rows.append(dict(role=p["role"], m=p["m"], n=p["n"], k=p["k"], lt_first=lt_first, lt_best=lt_best,
                         best_full=best_full, best_sus=best_sus,
                         ratio_full=best_full["full_ms"] / base_full if best_full else None,
                         ratio_sus=best_sus["sustained_ms"] / base_sus if best_sus else None,
                         tflops=2.0 * p["m"] * p["n"] * p["k"] / (best_full["full_ms"] * 1e9) if best_full else None))
    return rows


def screening_matrix(res):
    """config name -> per problem: its best screening time over the orders / cuBLASLt's fastest screening time."""
    names = [c["name"] for c in res["configs"]]
    out = {n: [] for n in names}
    for p in res["problems"]:
        lt = min(s["ms"] for s in p["screen"] if s["name"].startswith("cublaslt"))
        for ci, n in enumerate(names):
            times = [s["ms"] for s in p["screen"] if s.get("config") == ci and s["ok"]]
            out[n].append(min(times) / lt if times else None)
    return out


# The counters shown from an Nsight Compute run of the harness's --profile mode (where present).
NCU_METRICS = ["Duration", "SM Frequency", "Elapsed Cycles", "Compute (SM) Throughput", "Memory Throughput",
               "DRAM Throughput", "L2 Cache Throughput", "L2 Hit Rate", "Issue Slots Busy",
               "Warp Cycles Per Issued Instruction", "Registers Per Thread", "Achieved Occupancy"]


def parse_ncu(path):
    """One `ncu --csv --page details ... mainloop_search --profile P NAME ...` output (the program's own
    lines mixed in) -> {role, m, n, k, kernels: [{label, kernel, metrics: {name: "value unit"}}]}: the
    last of each candidate's 3 launches, cuBLASLt's first (launched first), then the named
    configurations in the order the harness reports them launched."""
    import csv
    shape, names, rows = None, [], []
    with open(path) as f:
        for line in f:
            if line.startswith('"'):
                rows.append(line)
            elif " M " in line and "cuBLASLt's first algorithm launched" in line:
                role, rest = line.split(" M ", 1)
                m, _, n, _, k = rest.split(":")[0].split()
                shape = dict(role=role.strip(), m=int(m), n=int(n), k=int(k))
            elif ": launched 3 times" in line:
                names.append(line.split(": launched 3 times")[0].strip())
    by_id = {}
    for r in csv.DictReader(rows):
        if not r.get("ID", "").strip().isdigit():
            continue
        k = by_id.setdefault(int(r["ID"]), {"kernel": r.get("Kernel Name", ""), "metrics": {}})
        unit = (r.get("Metric Unit") or "").strip()
        k["metrics"][r.get("Metric Name", "")] = (r.get("Metric Value", "").strip() + (" " + unit if unit else ""))
    ids = sorted(by_id)
    theirs = [i for i in ids if "device_kernel" not in by_id[i]["kernel"]]
    ours = [i for i in ids if "device_kernel" in by_id[i]["kernel"]]
    kernels = []
    if theirs:
        kernels.append(dict(label="cuBLASLt first", **by_id[theirs[min(2, len(theirs) - 1)]]))
    for j, name in enumerate(names):
        group = ours[3 * j:3 * j + 3]
        if group:
            kernels.append(dict(label=name, **by_id[group[-1]]))
    return dict(**(shape or dict(role="?", m=0, n=0, k=0)), kernels=kernels)


def counter_lines(res):
    if not res.get("counters"):
        return []
    lines = ["", "## Counters (Nsight Compute, `--clock-control none`, the last of 3 launches)", ""]
    for c in res["counters"]:
        shown = [m for m in NCU_METRICS if any(m in k["metrics"] for k in c["kernels"])]
        lines += [f"{c['role']} {c['m']} × {c['n']} × {c['k']}:", "",
                  "| kernel | " + " | ".join(shown) + " |", "|---|" + "---|" * len(shown)]
        for k in c["kernels"]:
            lines.append(f"| {k['label']} | " + " | ".join(k["metrics"].get(m, "–") for m in shown) + " |")
        lines.append("")
    return lines[:-1]


def shortlist_lines(res):
    """Per shape, the shortlist (our best 12 of the screening, re-timed in 3 interleaved rounds, which
    ranks the finalists): screened and re-timed ms side by side; [] for records without it."""
    listed = [(p, sorted((s for s in p["screen"] if s.get("shortlist_ms", 0) > 0), key=lambda s: s["shortlist_ms"]))
              for p in res["problems"]]
    if not any(sl for _, sl in listed):
        return []
    lines = ["", "## The shortlist: the screening's best 12, re-timed in 3 interleaved rounds of 5 launches", "",
             "| role | M × N × K | first five by the rounds (ms, screened → rounds) |", "|---|---|---|"]
    for p, sl in listed:
        lines.append(f"| {p['role']} | {p['m']} × {p['n']} × {p['k']} | "
                     + "; ".join(f"{s['name']} {s['ms']:.3f} → {s['shortlist_ms']:.3f}" for s in sl[:5]) + " |")
    return lines


def energy_lines(res):
    """The energy phase (the harness's --energy-s): per shape, cuBLASLt's fastest and our finalists back to
    back and hot, with NVML's energy counter and SM clock; [] when the run has none."""
    if not res.get("energy_s"):
        return []
    lines = ["", f"## Energy and clock cycles under the power cap ({res['energy_s']:g} s of each finalist back to "
             "back, hot, no L2 flushes)", "",
             "Per GEMM: its time back to back, the energy NVML's counter moved, the mean power, the median SM clock "
             "of the samples and the cycles at that clock. A kernel that takes fewer cycles than cuBLASLt's but more "
             "time runs at a lower clock: the power cap's doing, so energy per GEMM is what to lower.", "",
             "| role | M × N × K | finalist | ms | mJ | W | SM MHz | Mcycles | mJ ÷ cuBLASLt | Mcycles ÷ cuBLASLt |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for p in res["problems"]:
        fin = [f for f in p["final"] if "energy" in f]
        base = next((f["energy"] for f in fin if f["name"] == "cublaslt_fastest"), None)
        for f in fin:
            e = f["energy"]
            rel = (f"{e['mj'] / base['mj']:.3f} | {e['mcycles'] / base['mcycles']:.3f}"
                   if base and base["mj"] > 0 and base["mcycles"] > 0 else "– | –")
            lines.append(f"| {p['role']} | {p['m']} × {p['n']} × {p['k']} | {f['name']} | {e['ms']:.4f} | "
                         f"{e['mj']:.2f} | {e['watts']:.0f} | {e['sm_mhz']:.0f} | {e['mcycles']:.3f} | {rel} |")
    return lines


def split_n_legend(res):
    """The names' legend for the split-N configurations and their control, where the run has them."""
    names = [c["name"] for c in res["configs"]]
    if not any(n.endswith(("_sn", "_ns")) or "_sn_" in n for n in names):
        return ""
    return ("`_sn` the two consumer warp groups side by side along N (each tile M × N/2), with the "
            "register-store epilogue; `_ns` that epilogue without the split; ")


def markdown(res, resources, commit, date):
    """The record's markdown from the harness's JSON (a record's own JSON holds its commit and resources)."""
    rows = ratio_rows(res)
    lines = [f"# The mainloop search: the library's CUTLASS sm90 configurations against cuBLASLt ({date})", "",
             f"{res['gpu']} ({res['sm_count']} SMs), driver {res['driver']}, CUDA runtime {res['cuda_runtime']}, "
             f"cuBLASLt {res['cublaslt']}, commit {commit}. bf16 in, fp32 accumulation, a plain bf16 epilogue "
             "(D = the accumulator, TMA store), row-major D[M, N] = A[M, K] B[K, N] with M the tokens. Kernel time of "
             "one launch after a 512 MiB L2 flush (CUDA events), the median of 10 launches per round and of "
             f"{res['rounds']} interleaved rounds; full clock after 2 s idle, sustained after {res['sustain_s']:g} s "
             "of back-to-back GEMMs. cuBLASLt: its heuristic's first algorithm and the fastest of those it offers "
             "(up to 16), the ratio against the faster of the two. Produced by `bench/native/mainloop_search.cu` "
             "and `python -m bench.mainloop` (bench/mainloop.py says what each figure is).", "",
             f"## Each role's best configuration against cuBLASLt (target ≤ {TARGET}×)", "",
             "| role | M × N × K | cuBLASLt first ms | cuBLASLt fastest ms | ours, best | ms | TFLOP/s | ÷ cuBLASLt, full clock | ÷ cuBLASLt, sustained | verdict |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["best_full"] is None:
            lines.append(f"| {r['role']} | {r['m']} × {r['n']} × {r['k']} | – | – | none ran | – | – | – | – | – |")
            continue
        met = r["ratio_full"] <= TARGET and r["ratio_sus"] <= TARGET
        sus_name = "" if r["best_sus"]["name"] == r["best_full"]["name"] else f" ({r['best_sus']['name']})"
        lines.append(f"| {r['role']} | {r['m']} × {r['n']} × {r['k']} | {r['lt_first']['full_ms']:.3f} | "
                     f"{r['lt_best']['full_ms']:.3f} | {r['best_full']['name']} | {r['best_full']['full_ms']:.3f} | "
                     f"{r['tflops']:.0f} | {r['ratio_full']:.3f} | {r['ratio_sus']:.3f}{sus_name} | "
                     f"{'met' if met else 'not met'} |")
    lines += energy_lines(res)
    lines += counter_lines(res)
    lines += ["", "Names: `pp` ping-pong, `co` cooperative; tile M × N (K 64 unless `_k128`); cluster M × N (TMA "
              "multicast across it); `sk` stream-K, else the persistent data-parallel scheduler; `_s3` a mainloop of "
              "3 stages, else as many as fit beside the epilogue's shared memory; `_e64` an epilogue sub-tile of 64 "
              "columns, else CUTLASS's 32; " + split_n_legend(res)
              + "then the scheduler's raster order (heuristic, M, N) / swizzle.", "",
              "## The configurations", "",
              "Registers: ptxas's figure per kernel, the launch bound of a warp-specialized kernel (its warp groups "
              "then set their own with setmaxnreg); spills are what tells a configuration short of registers.", "",
              "| configuration | schedule | scheduler | tile M × N × K | stages | epilogue sub-tile | shared memory KiB | registers (B K-major, N-major) | spill stores / loads bytes |",
              "|---|---|---|---|---|---|---|---|---|"]
    for c in res["configs"]:
        k = resources.get(c["name"], [])
        regs = ", ".join(str(x["registers"]) for x in k) or "–"
        spills = ", ".join(f"{x['spill_stores']} / {x['spill_loads']}" for x in k) or "–"
        tile = " × ".join(str(x) for x in c["tile"])
        stages = c.get("stages", "–")  # records before the stage count was written leave it out
        epi = " × ".join(str(x) for x in c["epilogue_tile"]) if "epilogue_tile" in c else "–"
        if epi == "0 × 0":  # the register-store epilogue: no shared-memory sub-tile
            epi = "none (register stores)"
        lines.append(f"| {c['name']} | {c['schedule']} | {c['scheduler']} | {tile} | {stages} | {epi} | "
                     f"{c['smem_bytes'] / 1024:.1f} | {regs} | {spills} |")
    mat = screening_matrix(res)
    heads = [f"{p['role']} {p['m']}×{p['n']}×{p['k']}" for p in res["problems"]]
    lines += ["", "## Screening: each configuration's best order ÷ cuBLASLt's fastest (median of 5 launches, one pass)",
              "", "| configuration | " + " | ".join(heads) + " |", "|---|" + "---|" * len(heads)]
    for n, vals in mat.items():
        lines.append(f"| {n} | " + " | ".join("–" if v is None else f"{v:.3f}" for v in vals) + " |")
    lines += shortlist_lines(res)
    wrong = [(p["role"], s["name"], s["error"]) for p in res["problems"] for s in p["screen"]
             if s.get("config") is not None and not s["ok"] and s["error"] > 0]
    lines += ["", "Every configuration's output was checked against cuBLASLt's at each shape (relative Frobenius "
              "error ≤ 1e-2; a wrong layout gives about 1): "
              + ("all agreed." if not wrong else "WRONG: " + "; ".join(f"{a} {b} {c:.2e}" for a, b, c in wrong))]
    return "\n".join(lines) + "\n"


def render(res, resources, commit, out_dir, date):
    rows = ratio_rows(res)
    os.makedirs(out_dir, exist_ok=True)
    base = os.path.join(out_dir, f"mainloop-{date}")
    with open(base + ".md", "w") as f:
        f.write(markdown(res, resources, commit, date))
    with open(base + ".json", "w") as f:
        json.dump({**res, "commit": commit, "resources": resources, "summary": [
            {k: v for k, v in r.items() if k not in ("lt_first", "lt_best", "best_full", "best_sus")}
            | {"best_full": r["best_full"]["name"] if r["best_full"] else None,
               "best_sustained": r["best_sus"]["name"] if r["best_sus"] else None}
            for r in rows]}, f, indent=1)
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no chart", file=sys.stderr)
        return base
    fig, ax = plt.subplots(figsize=(11, 4.5))
    xs = range(len(rows))
    ax.bar([x - 0.2 for x in xs], [r["ratio_full"] or 0 for r in rows], 0.4, label="full clock")
    ax.bar([x + 0.2 for x in xs], [r["ratio_sus"] or 0 for r in rows], 0.4, label="sustained")
    ax.axhline(1.0, color="k", lw=0.8)
    ax.axhline(TARGET, color="r", ls=":", label=f"target {TARGET}×")
    ax.set_xticks(list(xs), [f"{r['role']} {r['m']}×{r['n']}×{r['k']}" for r in rows], fontsize=7, rotation=25,
                  ha="right")
    ax.set_ylabel("best configuration ÷ cuBLASLt")
    ax.set_ylim(0.8, max(1.2, max((r["ratio_full"] or 0) for r in rows) + 0.05))
    ax.legend()
    ax.set_title(f"Mainloop search, {res['gpu']}, commit {commit}")
    fig.savefig(base + ".png", dpi=110, bbox_inches="tight")
    plt.close(fig)
    return base


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("json", help="the harness's --out file")
    p.add_argument("--resources", default=None, help="build_mainloop.sh's resources.json")
    p.add_argument("--commit", required=True, help="the commit whose harness ran")
    p.add_argument("--out", default="docs/results")
    p.add_argument("--date", default=datetime.date.today().isoformat())
    p.add_argument("--ncu", action="append", default=[],
                   help="an ncu --csv --page details output of mainloop_search --profile (repeatable)")
    args = p.parse_args(argv)
    with open(args.json) as f:
        res = json.load(f)
    if args.ncu:
        res["counters"] = [parse_ncu(path) for path in args.ncu]
    resources = {}
    if args.resources:
        with open(args.resources) as f:
            resources = json.load(f)
    base = render(res, resources, args.commit, args.out, args.date)
    print(f"wrote {base}.md, .json, .png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
