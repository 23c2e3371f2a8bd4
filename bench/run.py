#!/usr/bin/env python
"""fused_dense MLP benchmark: every variant side by side, in one run, on one GPU.

    python bench/run.py --out docs/results            # the run of record (replaces the one there)
    python bench/run.py --out DIR --quick             # one shape, a smoke subset
    python bench/run.py --out DIR --device cpu --quick   # without a GPU: plumbing only
    python bench/run.py --out docs/results --sections gated   # the gated MLP's run of record
    python bench/run.py --out docs/results --sections fp8     # the FP8 run of record
    python bench/run.py --out DIR --sections fp8 --fp8-items gated,stack   # its gated MLP and stack only

Writes DIR/mlp-<YYYY-MM-DD>.json (every figure and the environment, rewritten after each
measurement), .md (tables, targets) and .png (chart; needs matplotlib). A complete run removes
the other mlp-<date>.* files in DIR, so DIR holds one run of record. Sections and method:
bench/sections.py, bench/timing.py and bench/README.md. A supervisor process runs the
measurements in a worker; when the worker dies (a segfault in a kernel under test, a broken CUDA
context) the measurement it was in is recorded 'crashed' and a new worker resumes after it.
"""
import argparse
import datetime
import faulthandler
import glob
import json
import os
import re
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402

from bench import environment, fp8, gated, report, sections  # noqa: E402
from bench.power import INTERVAL_MS  # noqa: E402
from bench.sections import FULL_VARIANTS, REDUCED_VARIANTS, log  # noqa: E402

SECTIONS = ("ceiling", "mlp", "ops", "host", "reduced", "sustained", "gated", "fp8")
DEFAULT_SECTIONS = ("ceiling", "mlp", "ops", "host", "reduced", "sustained")  # gated, fp8: asked for by name
OWN_RECORD = ("gated", "fp8")  # sections that, run alone, are a run of record of their own


def record_prefix(args):
    """The run of record's file stem: gated-<date> or fp8-<date> for a run of that section alone
    (its own record beside the MLP one), else mlp-<date>."""
    want = args.sections.split(",")
    return want[0] if len(want) == 1 and want[0] in OWN_RECORD else "mlp"


def record_pattern(prefix):
    return re.compile(rf"^{prefix}-\d{{4}}-\d{{2}}-\d{{2}}\.(json|md|png)$")


def parse_shape(s):
    try:
        m, d = s.lower().split("x")
        return int(m), int(d)
    except ValueError:
        raise argparse.ArgumentTypeError(f"shape must be MxD, e.g. 8192x1024; got {s!r}") from None


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="output directory (docs/results for the run of record)")
    ap.add_argument("--quick", action="store_true", help="one shape (8192x1024 on a GPU), fp16 relu reduced, one op")
    ap.add_argument("--shapes", nargs="+", type=parse_shape, metavar="MxD",
                    help="MLP shapes (M tokens x d), default 8192x{1024,2048,4096} and 16384x8192")
    ap.add_argument("--device", default="cuda", help="cuda (default) or cpu (tiny sizes, figures meaningless)")
    ap.add_argument("--sections", default=",".join(DEFAULT_SECTIONS),
                    help=f"comma list out of {','.join(SECTIONS)} (default: all but gated and fp8)")
    ap.add_argument("--fp8-items", default=",".join(fp8.ITEMS),
                    help=f"fp8 section: comma list out of {','.join(fp8.ITEMS)} (default: all): the GELU MLP "
                         "shapes, the Linear block, the gated MLP shapes, the Llama-style stack")
    ap.add_argument("--budget", type=float, default=420.0,
                    help="seconds after which measurements not yet started are recorded as skipped (420)")
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile variant")
    ap.add_argument("--no-accuracy", action="store_true", help="skip the float32 reference and error figures")
    ap.add_argument("--warmup-ms", type=float, default=50.0, help="warm-up per figure / block (ms, >= 2 calls)")
    ap.add_argument("--rep-ms", type=float, default=200.0, help="measuring time per figure (ms, >= 8 calls)")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds per MLP shape (5)")
    ap.add_argument("--sustained-warmup-ms", type=float, default=1000.0,
                    help="sustained section: each block's warm-up of its own steps (ms, 1000)")
    ap.add_argument("--timer", choices=["auto", "events"], default="auto",
                    help="auto: triton do_bench when importable, else CUDA events")
    ap.add_argument("--commit", default=os.environ.get("FUSED_DENSE_COMMIT"),
                    help="commit to record where the tree has no .git (default $FUSED_DENSE_COMMIT or HEAD)")
    ap.add_argument("--max-restarts", type=int, default=10, help="worker restarts after crashes (10)")
    ap.add_argument("--max-fused-crashes", type=int, default=6, help="after this many, skip all fused variants (6)")
    ap.add_argument("--no-supervise", action="store_true", help="measure in this process (no crash recovery)")
    ap.add_argument("--resume", action="store_true",
                    help="continue the newest run in --out (mlp-*.json, or gated- / fp8- run alone)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--t0-epoch", type=float, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.rounds < 1 or args.sustained_warmup_ms < 0:
        ap.error("--rounds must be at least 1 and --sustained-warmup-ms not negative")
    unknown = [s for s in args.sections.split(",") if s not in SECTIONS]
    if unknown:
        ap.error(f"--sections: unknown {', '.join(unknown)}; known: {','.join(SECTIONS)}")
    args.fp8_items = args.fp8_items.split(",")
    unknown = [s for s in args.fp8_items if s not in fp8.ITEMS]
    if unknown:
        ap.error(f"--fp8-items: unknown {', '.join(unknown)}; known: {','.join(fp8.ITEMS)}")
    if args.t0_epoch is not None:
        sections.T0 = args.t0_epoch
    return ap, args


def output_paths(args):
    """{json, md, png} paths in --out: the newest existing run with --resume, else the start's date."""
    prefix = record_prefix(args)
    record = record_pattern(prefix)
    old = sorted(p for p in glob.glob(os.path.join(args.out, f"{prefix}-*.json")) if record.match(os.path.basename(p)))
    if args.resume and old:
        stem = old[-1][:-5]
    else:
        day = datetime.datetime.fromtimestamp(sections.T0, datetime.timezone.utc).date().isoformat()
        stem = os.path.join(args.out, f"{prefix}-{day}")
    return {ext: f"{stem}.{ext}" for ext in ("json", "md", "png")}


def build_plan(args):
    """[(item_id, section, payload)] in run order: the most important first, so a budget cut
    loses the least."""
    if args.shapes:
        shapes, big = args.shapes, []
    elif args.device == "cpu":
        shapes, big = [(256, 64)], []
    elif args.quick:
        shapes, big = [(8192, 1024)], []
    else:
        shapes, big = [(8192, 1024), (8192, 2048), (8192, 4096)], [(16384, 8192)]
    want = set(args.sections.split(","))
    reduced = [("fp16", "relu")] if args.quick else [("fp16", "gelu_approx"), ("bf16", "relu"), ("fp16", "relu")]
    mkns = list(dict.fromkeys(mkn for M, d in shapes + big for mkn in ((M, d, 4 * d), (M, 4 * d, d))))
    plan = [("ceiling", "ceiling", ())] if "ceiling" in want else []
    if "mlp" in want:
        plan += [(f"mlp:bf16:gelu_approx:{M}x{d}", "mlp", ("bf16", "gelu_approx", M, d, FULL_VARIANTS))
                 for M, d in shapes + big]
    if "ops" in want:
        plan += [(f"ops:bf16:{M},{K},{N}", "ops", (M, K, N)) for M, K, N in (mkns[:1] if args.quick else mkns)]
    if "host" in want:
        plan += [("host", "host", ()), ("host:layers", "host_layers", ())]
    if "reduced" in want:  # not at d = 8192, where bf16 gelu covers the shape
        plan += [(f"mlp:{dt}:{act}:{M}x{d}", "mlp", (dt, act, M, d, REDUCED_VARIANTS))
                 for dt, act in reduced for M, d in shapes if d < 8192]
    if "sustained" in want:
        plan += [(f"sustained:bf16:gelu_approx:{M}x{d}", "sustained", ("bf16", "gelu_approx", M, d, REDUCED_VARIANTS))
                 for M, d in shapes + big]
    if "gated" in want:
        plan += gated.plan_items(args)
    if "fp8" in want:
        plan += fp8.plan_items(args)
    if "ceiling" in want:
        plan.append(("ceiling_end", "ceiling", ("ceiling_end",)))
    return plan


def method(args, bench):
    cuda = args.device != "cpu"
    return {
        "timer": bench.method, "warmup_ms": args.warmup_ms, "rep_ms": args.rep_ms, "min_reps": bench.min_reps,
        "budget_s": args.budget, "rounds": args.rounds, "sustained_warmup_ms": args.sustained_warmup_ms,
        "mlp_timer": f"MLP variants of a shape timed in {args.rounds} interleaved rounds (order rotated per round), "
                     + ("CUDA events around each rep, L2 flushed before each" if cuda else
                        "perf_counter around each rep")
                     + "; a block whose reps held a tuner measurement timed again; median over all reps",
        "mlp": "fwd + bwd of Linear(d,4d) -> act -> Linear(4d,d) on x[M,d] (requires grad) with a random dY; param "
               "and input grads reset to None before every rep; TF/s = 12*M*d*h/time",
        "floor": "the six plain torch.mm of the step (x@W1^T, h@W2^T, dY@W2, dY^T@h, dH@W1, dH^T@x) on pre-made "
                 "tensors, no bias, no activation",
        "memory": "saved_bytes: unique non-parameter storages packed by saved_tensors_hooks in one forward (x "
                  "included; not for torch.compile); alloc_kept_bytes: memory_allocated after forward minus before, "
                  "output excluded; peak_delta_bytes: max_memory_allocated over fwd+bwd minus before",
        "accuracy": "rel. error ||v - ref|| / ||ref|| against a float32 (no tf32) eager reference",
        "gated": "fwd + bwd of down(act(gate(x)) * up(x)) on x[M,d] (requires grad), no biases, act SiLU (swiglu) "
                 "or tanh GELU (geglu); variants in interleaved rounds as in the mlp section; floor = the six "
                 "plain torch.mm of the step with gate and up as one GEMM of width 2h; accuracy of out and dx "
                 "against float32 eager; TF/s = 18*M*d*h/time. gated_stack: 2 pre-norm blocks (RMSNorm, causal "
                 "F.scaled_dot_product_attention, gated MLP) fwd + bwd, nn.Linear MLPs or FusedGatedMLP "
                 "(replace_llama_mlps), eager and torch.compile; TF/s counts the projections' GEMMs only",
        "fp8": "fwd + bwd of Linear(d,4d) -> tanh GELU -> Linear(4d,d) (bf16 master weights) and of one Linear "
               "M x K -> N with bias, variants in interleaved rounds as in the mlp section (at most "
               f"{fp8.BIG_ROUNDS} rounds from M*d = 16384*8192); fp8_floor = the step's GEMMs as torch._scaled_mm "
               "e4m3 x e4m3 -> bf16, per-tensor scales, operands quantized outside the timing, a row-major, b "
               "column-major, use_fast_accum " + ", ".join(f"{k} {v}" for k, v in fp8.FAST_ACCUM.items())
               + "; bf16_floor = the same GEMMs as plain torch.mm; FusedMLP FP8 called with is_first_microbatch="
               "True (weights cast every step) or, _cached, False after one step with True; FusedDense FP8 "
               "called as dense(x); torchao = convert_to_float8_training(Float8LinearConfig.from_recipe_name("
               "recipe)) of the nn.Linear model, torch.compile'd; accuracy against float32 eager; TF/s = "
               "12*M*d*h/time (MLP), 6*M*K*N/time (Linear). Gated MLP (swiglu, no biases): the same variants "
               "(torchao tensorwise only) with FusedGatedMLP as the fused module, floors of six GEMMs with gate and "
               "up as one GEMM of width 2h, accuracy of out and dx, TF/s = 18*M*d*h/time. Llama-style stack "
               "(bench/gated.py's, swiglu): bf16 eager and torch.compile, torchao tensorwise of every nn.Linear "
               "torch.compile'd, and fused_dense FP8 (Float8Recipe(scaling='current', min_features=0): MLPs by "
               "replace_llama_mlps(fp8=recipe), qkv and o_proj as FusedDense(fp8=recipe), called as model(x)) "
               "eager and torch.compile'd, and with scaling='delayed' torch.compile'd; accuracy of out and dx; TF/s "
               "counts the projections' GEMMs only",
        "sustained": f"floor, eager, compile and FusedMLP auto at the bf16 gelu_approx shapes in {args.rounds} "
                     f"interleaved rounds as in the mlp section, but each block after {args.sustained_warmup_ms:.0f} "
                     "ms of that variant's own steps, so it is timed at the steady state of sustained load (the "
                     "power cap); no accuracy check or memory pass; where NVML answers, SM clock and power are "
                     f"sampled every {INTERVAL_MS} ms and each variant records their medians over its timed blocks "
                     "and the last third (at most 300 ms) of their warm-ups",
    }


def finalize(results, paths, prune=False):
    """The markdown, the chart and the console summary from whatever results there are; with
    prune, the other runs of record in the same directory are removed."""
    sections.save_results(results, paths)
    try:
        report.make_png(results, paths["png"])
    except ImportError as exc:
        log(f"WARNING: no chart ({exc}); make it with: python bench/report.py {paths['json']}")
    except Exception as exc:  # noqa: BLE001
        log(f"WARNING: chart failed: {sections.errstr(exc)}")
    if prune:
        out = os.path.dirname(paths["json"])
        mine = {os.path.basename(p) for p in paths.values()}
        record = record_pattern(os.path.basename(paths["json"]).split("-")[0])
        for name in sorted(os.listdir(out)):
            if record.match(name) and name not in mine:
                os.remove(os.path.join(out, name))
                log(f"removed the older run of record {os.path.join(out, name)}")
    print(report.summary(results), flush=True)
    log(f"done: {paths['json']}, {os.path.basename(paths['md'])}")


def supervise(args, argv):
    paths = output_paths(args)
    if not args.resume and os.path.exists(paths["json"]):
        os.remove(paths["json"])
    resume, restarts = args.resume, 0
    while True:
        cmd = [sys.executable, os.path.abspath(__file__), *argv, "--worker", "--t0-epoch", repr(sections.T0)]
        rc = subprocess.call(cmd + (["--resume"] if resume and "--resume" not in argv else []))
        if rc == 0:
            return 0
        try:
            with open(paths["json"]) as f:
                res = json.load(f)
        except (OSError, ValueError):
            res = None
        ip = res.get("in_progress") if res else None
        if res is None or (ip is None and rc != sections.EXIT_CUDA_BROKEN):
            log(f"worker failed (exit {rc}) outside any measurement; not restarting")
            if res:
                finalize(res, paths)
            return rc if rc > 0 else 1
        if ip:
            res.setdefault("crashed", []).append({**ip, "rc": rc, "at_s": round(time.time() - sections.T0, 1)})
            res["in_progress"] = None
            sections.save_results(res, paths, markdown=False)
        if restarts >= args.max_restarts:
            log(f"worker died (exit {rc}) during {ip}; {restarts} restarts already, giving up")
            finalize(res, paths)
            return 1
        restarts, resume = restarts + 1, True
        log(f"worker died (exit {rc}) during {ip}; restart {restarts}/{args.max_restarts}, resuming")


RUNNERS = {"ceiling": sections.run_ceiling, "mlp": sections.run_mlp, "ops": sections.run_ops,
           "host": sections.run_host, "host_layers": sections.run_host_layers, "gated": gated.run_gated, "gated_stack": gated.run_stack,
           "fp8": fp8.run_fp8, "fp8_dense": fp8.run_fp8_dense, "fp8_gated": fp8.run_fp8_gated,
           "fp8_stack": fp8.run_fp8_stack}


def worker(ap, args, argv):
    faulthandler.enable()  # a segfault in a kernel under test prints the Python stack that led there
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("CUDA is not available; use --device cpu --quick for a smoke test")
    device = torch.device(args.device)
    if device.type == "cuda":
        device = torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device())
        torch.cuda.set_device(device)
        # the context and the cuBLAS handle on this thread before autograd's device thread makes them
        torch.mm(torch.ones(8, 8, device=device), torch.ones(8, 8, device=device)).sum().item()
        args.ceiling_n, args.host_m, args.host_d, args.host_iters = 8192, 512, 512, 200
        args.host_layers_m = 256
    else:
        args.ceiling_n, args.host_m, args.host_d, args.host_iters = 256, 64, 64, 20
        args.host_layers_m = 16
    paths = output_paths(args)
    prev = None
    if args.resume and os.path.exists(paths["json"]):
        with open(paths["json"]) as f:
            prev = json.load(f)
    ctx = sections.Ctx(args, device, paths, prev)
    if sections.FD_IMPORT_ERROR:
        log(f"WARNING: {sections.FD_IMPORT_ERROR}")
    if prev is None:
        user_argv = argv[:argv.index("--worker")] if "--worker" in argv else argv  # the supervisor appends it
        ctx.results["env"] = env = environment.environment(device, ["bench/run.py", *user_argv], args.commit,
                                                           sections.FD_IMPORT_ERROR)
        ctx.results["method"] = method(args, ctx.bench)
        log(f"env: {env.get('gpu', 'cpu')}, driver {env.get('driver')}, torch {torch.__version__}, "
            f"CUDA {torch.version.cuda}, cuBLASLt {env.get('cublasLt_version_str')}")
    else:
        ctx.results["restarts"] = ctx.results.get("restarts", 0) + 1
        log(f"resuming: {len(ctx.results.get('done', []))} items done, crashed: "
            f"{[(c['item'], c['variant']) for c in ctx.results.get('crashed', [])]}")
    plan = build_plan(args)
    ctx.results["plan"] = [item_id for item_id, _, _ in plan]
    if any(section == "gated" for _, section, _ in plan):
        gated.note_liger()
    if any(section.startswith("fp8") for _, section, _ in plan):
        fp8.note()
    log(f"plan: {len(plan)} items, budget {args.budget:.0f} s ({ctx.time_left():.0f} s left)")
    ctx.save()
    for i, (item_id, section, payload) in enumerate(plan, 1):
        if item_id in ctx.results["done"]:
            continue
        if ctx.time_left() < 0:
            if item_id not in ctx.results["skipped"]:
                ctx.results["skipped"].append(item_id)
            log(f"[{i}/{len(plan)}] skipped (time budget): {item_id}")
            continue
        log(f"[{i}/{len(plan)}] {item_id} ({ctx.time_left():.0f} s of the budget left)")
        try:
            if section == "sustained":
                sections.run_mlp(ctx, item_id, *payload, section="sustained")
            else:
                RUNNERS[section](ctx, item_id, *payload)
        except Exception as exc:  # noqa: BLE001
            log(f"{item_id}: ERROR {sections.errstr(exc)}")
            ctx.results.setdefault("errors", []).append([item_id, sections.errstr(exc)])
            ctx.end()
            ctx.check_cuda(exc)
            ctx.free()
        ctx.results["done"].append(item_id)
        ctx.save()
    ctx.results["complete"] = True
    finalize(ctx.results, paths, prune=True)
    return 0


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    ap, args = parse_args(argv)
    if args.worker or args.no_supervise:
        return worker(ap, args, argv)
    return supervise(args, argv)


if __name__ == "__main__":
    sys.exit(main())
