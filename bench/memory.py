#!/usr/bin/env python
"""The memory benchmark: what an FP8 training step holds against bf16's and torchao's (issue #41).

    python -m bench.memory --out docs/results              # the run of record (H200)
    python -m bench.memory --out DIR --device cpu --quick  # a functional check of the script

Parts (--parts):
  mlp    the MLPs of the FP8 run of record, bf16 master weights, forward + backward of out.backward(dy):
         GELU (tanh) MLP d -> 4d -> d at M x d = 8192 x 4096 and 16384 x 8192, SwiGLU gated MLP
         M x d -> h = 16384 x 4096 -> 14336 (on the CPU: 64 x 64 -> 256 and 64 x 64 -> 176). Variants:
           eager               the nn.Linear MLP (bench.sections.EagerMLP / bench.gated.EagerGatedMLP), bf16
           fused_bf16          FusedMLP / FusedGatedMLP, heuristic='auto'
           fused_fp8_current,
           fused_fp8_delayed   the same with fp8=Float8Recipe(scaling=..., min_features=0), called with
                               is_first_microbatch=True (the weights cast every step), as bench.fp8 does
           torchao_tensorwise  torchao convert_to_float8_training of the nn.Linear MLP (tensorwise), then
                               torch.compile (where torchao imports; else recorded unavailable)
         FP8_PATHS names how the FP8 modules save for backward (default: the pre-activation in the
         model's dtype; pre_fp8: Float8Recipe(save_pre_fp8=True), in e4m3); every fused_fp8 variant
         is measured once per path picked (--fp8-paths), both in one run.
  llama  transformers' LlamaForCausalLM as bench.model builds its llama-4096 config (d 4096, h 14336,
         2 layers, 2 x 4096 tokens; on the CPU its llama-tiny), one training step as bench.model's
         Runner takes it (forward with labels, backward, gradient clipping, fused AdamW). Variants:
         hf_eager (bf16 as built), fd_fp8_current_eager and fd_fp8_current_compile (convert_model with
         Float8Recipe(scaling='current') and q / k / v apart, eager and torch.compile'd: the step of
         the issue's figure, the old path the others are timed against), fd_fp8_current_qkv_compile
         (convert_model's FP8 default, q / k / v as one GEMM), fd_fp8_current_qkv_pre_nowc_compile (the
         same with save_pre_fp8=True and save_weight_fp8=False: gu in e4m3, no weight's FP8 copy held
         into backward; the light recipe), fd_fp8_current_qkv_lce_compile and
         fd_fp8_current_qkv_pre_nowc_lce_compile (those two with convert_model's fused LM head and loss,
         linear_cross_entropy=True: no logits in training), torchao_compile (torchao float8 tensorwise
         of every linear but the LM head, compiled). On request (--llama-variants), q / k / v apart:
         fd_fp8_current_pre_compile (save_pre_fp8=True), fd_fp8_current_lce_compile and
         fd_fp8_current_pre_lce_compile (with the fused LM head).

Each variant is built fresh (its own module, the shape's weights), makes WARMUP_STEPS steps (compile,
tuning, delayed scaling's history, the optimizer's state), and is measured alone before the next
variant is built: bench.timing.step_memory over one step, that is torch.cuda.reset_peak_memory_stats,
then
  peak   max_memory_allocated during the step minus memory_allocated before it (the gradients the
         step allocates are counted; for llama "step memory over resident": over the model and the
         optimizer state; the variant's own resident bytes are reported beside it);
  saved  the bytes of the distinct storages saved for backward, counted with saved_tensors_hooks by
         their untyped storage's data_ptr (a tensor saved twice counts once, two copies of it twice),
         the parameters left out, the input x counted; not for compiled variants (hooks at call time
         make Dynamo recompile, so what was counted would not be what ran).
Time per step is the secondary figure: all variants of a shape (or of the llama config) kept, then
timed in --rounds interleaved rounds (mlp: bench.timing's Bench, median and p20-p80 over all
repetitions; llama: bench.model's interleaved_ms, the median of the rounds' medians, and tokens/s).

Targets (#41, the H200, in one run): FP8 MLPs at the three shapes: saved for backward <= 0.5x the
fused bf16 MLP's, peak <= the fused bf16 MLP's and <= torchao's, time <= 1.02x the old FP8 path's
(each path other than OLD_FP8_PATH, with both picked); the converted LlamaForCausalLM: step memory
over resident <= 0.85x torchao's, tokens/s >= the old FP8 path's (n/a: the llama part runs
convert_model's default recipe only). The loss-curve
target (500 steps within the main job's FP8 limit) is the main job's FP8 check, not measured here.
Writes DIR/memory-<YYYY-MM-DD>.json, .md and .png and removes the other memory-<date> files there.
"""
import dataclasses
import gc
import os
import statistics
import sys
import time
import types

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402

from bench import environment, fp8, model, report  # noqa: E402
from bench.gated import EagerGatedMLP  # noqa: E402
from bench.model import log  # noqa: E402
from bench.sections import EagerMLP, Unavailable, errstr, first  # noqa: E402
from bench.timing import MIB, Bench, step_memory  # noqa: E402

# (label, activation, M, d, h): the GELU MLP d -> h = 4d -> d and the SwiGLU gated MLP d -> h -> d
SHAPES = [("gelu", "gelu_approx", 8192, 4096, 16384), ("gelu", "gelu_approx", 16384, 8192, 32768),
          ("swiglu", "swiglu", 16384, 4096, 14336)]
CPU_SHAPES = [("gelu", "gelu_approx", 64, 64, 256), ("swiglu", "swiglu", 64, 64, 176)]
# How the FP8 modules save for backward (#41 item 1): name -> (variant key suffix, Float8Recipe
# keyword arguments that select the path). Every fused_fp8 variant is measured once per path picked,
# in one run, and the time target compares each path with OLD_FP8_PATH's: "default" keeps the
# pre-activation in the model's dtype, "pre_fp8" in e4m3 (Float8Recipe(save_pre_fp8=True)).
FP8_PATHS = {"default": ("", {}), "pre_fp8": ("_pre_fp8", {"save_pre_fp8": True})}
OLD_FP8_PATH = "default"
FP8_SCALINGS = ("current", "delayed")
LLAMA_CONFIG, CPU_LLAMA_CONFIG = "llama-4096", "llama-tiny"
# the default Llama variants; LLAMA_VARIANTS adds those run on request (--llama-variants)
LLAMA_DEFAULT_VARIANTS = ["hf_eager", "fd_fp8_current_eager", "fd_fp8_current_compile", "fd_fp8_current_qkv_compile",
                          "fd_fp8_current_qkv_pre_nowc_compile", "fd_fp8_current_qkv_lce_compile",
                          "fd_fp8_current_qkv_pre_nowc_lce_compile", "torchao_compile"]
LLAMA_VARIANTS = LLAMA_DEFAULT_VARIANTS + ["fd_fp8_current_pre_compile", "fd_fp8_current_lce_compile",
                                           "fd_fp8_current_pre_lce_compile"]
# the step of the figure (q / k / v apart, compiled): the compiled FP8 variants are timed against it
LLAMA_OLD = "fd_fp8_current_compile"
LLAMA_FP8 = (LLAMA_OLD,) + tuple(k for k in LLAMA_VARIANTS if k.startswith("fd_fp8_") and k != LLAMA_OLD)
LLAMA_OLD_PATH = {k: LLAMA_OLD for k in LLAMA_FP8 if k.endswith("_compile") and k != LLAMA_OLD}
PARTS = ("mlp", "llama")
WARMUP_STEPS = 3
LLAMA_REPS = 10  # steps per variant and round (--quick: 2)
TARGETS = {"saved_vs_fused_bf16": 0.5, "peak_vs_fused_bf16": 1.0, "peak_vs_torchao": 1.0, "time_vs_old_fp8_path": 1.02,
           "llama_step_memory_vs_torchao": 0.85, "llama_tokens_per_s_vs_old_fp8_path": 1.0}
TARGET_NAMES = {"saved_vs_fused_bf16": "saved ≤ 0.5× fused_bf16's", "peak_vs_fused_bf16": "peak ≤ fused_bf16's",
                "peak_vs_torchao": "peak ≤ torchao_tensorwise's",
                "time_vs_old_fp8_path": "time ≤ 1.02× the old FP8 path's",
                "llama_step_memory_vs_torchao": "step memory over resident ≤ 0.85× torchao_compile's",
                "llama_tokens_per_s_vs_old_fp8_path": "tokens/s ≥ the old FP8 path's"}


def fp8_key(scaling, path):
    return f"fused_fp8_{scaling}{FP8_PATHS[path][0]}"


def mlp_variants(paths):
    """The MLP variant keys, in the tables' order, with the fused FP8 ones once per FP8 path."""
    return (["eager", "fused_bf16"] + [fp8_key(s, p) for p in paths for s in FP8_SCALINGS]
            + ["torchao_tensorwise"])


def path_of(key):
    """The FP8 path name of a fused_fp8 variant key."""
    return next(p for p, (sfx, _) in sorted(FP8_PATHS.items(), key=lambda kv: -len(kv[1][0]))
                if key.endswith(sfx))


def not_run(key, device):
    """{status, error} where the variant cannot run here (bench.fp8's rules), or None."""
    return fp8.not_run(types.SimpleNamespace(cuda=device.type == "cuda", args=types.SimpleNamespace(no_compile=False)),
                       key)


def build_mlp(key, label, activation, d, h, eager, x, dy, device, dtype):
    """A fresh module of an MLP variant: bench.fp8's build, with the FP8 path's arguments."""
    extra = FP8_PATHS[path_of(key)][1] if key.startswith("fused_fp8") else {}

    def make(**kw):
        if extra and kw.get("fp8") is not None:
            kw["fp8"] = dataclasses.replace(kw["fp8"], **extra)
        if label == "gelu":
            return fp8.FusedMLP(d, h, d, activation=activation, heuristic="auto", device=device, dtype=dtype, **kw)
        if fp8.FusedGatedMLP is None:
            raise Unavailable("fused_dense has no FusedGatedMLP")
        return fp8.FusedGatedMLP(d, h, activation=activation, heuristic="auto", device=device, dtype=dtype, **kw)
    return fp8.build(key, eager, make, x, dy)


def measure_variant(device, step, params, compiled, inputs=()):
    """A variant's first calls (kept out of every figure), then its memory over one step, alone: the
    parameters' storages left out of saved, the inputs' counted; their gradients dropped after each."""
    leaves = [*params, *inputs]
    t0 = time.perf_counter()
    for _ in range(WARMUP_STEPS):
        step()
        for t in leaves:
            t.grad = None
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    first_s = round(time.perf_counter() - t0, 3)
    mem = step_memory(device, step, exclude=params, count_saved=not compiled)
    for t in leaves:
        t.grad = None
    return dict(mem, first_calls_s=first_s)


def free(device):
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def run_mlp_shape(shape, variants, args, device, dtype=torch.bfloat16):
    """One MLP shape: each variant built, warmed and measured alone, then all timed interleaved."""
    label, activation, M, d, h = shape
    rec = {"label": label, "activation": activation, "M": M, "d": d, "h": h, "variants": {}}
    tag = f"{label} M={M} d={d} h={h}"
    torch.manual_seed(0)
    eager = (EagerMLP if label == "gelu" else EagerGatedMLP)(d, h, activation, device, dtype)
    x = torch.randn(M, d, device=device, dtype=dtype).requires_grad_(True)
    dy = torch.randn(M, d, device=device, dtype=dtype)
    steps = {}
    for key in variants:
        pre = not_run(key, device)
        if pre is not None:
            rec["variants"][key] = pre
            log(f"{tag} {key}: {pre['status']} ({pre['error']})")
            continue
        try:
            mod = build_mlp(key, label, activation, d, h, eager, x, dy, device, dtype)
            params = list(mod.parameters())

            def step(mod=mod):
                first(mod(x)).backward(dy)
            v = dict(measure_variant(device, step, params, fp8.compiled(key), inputs=[x]), status="ok",
                     **fp8.settings(key))
        except Exception as exc:  # noqa: BLE001 - recorded for this variant; the others go on
            rec["variants"][key] = {"status": "unavailable" if isinstance(exc, Unavailable) else "error",
                                    "error": errstr(exc)}
            log(f"{tag} {key}: {rec['variants'][key]['status']} ({rec['variants'][key]['error']})")
            free(device)
            continue
        rec["variants"][key] = v
        steps[key] = (step, params + [x])
        log(f"{tag} {key}: peak {_mib(v.get('peak_bytes'))} MiB, saved {_mib(v.get('saved_bytes'))} MiB "
            f"({v.get('saved_storages')} storages), first calls {v['first_calls_s']} s")
        mod = step = None  # noqa: F841 - the step in steps keeps the module
        free(device)
    bench = Bench(device) if device.type == "cuda" else Bench(device, warmup_ms=5.0, rep_ms=20.0)
    if steps:
        log(f"{tag}: timing {len(steps)} variants in {args.rounds} interleaved rounds")
        timed = bench.interleaved(steps, args.rounds)
        for key, t in timed.items():
            if "error" in t:
                rec["variants"][key].update(status="error", error=errstr(t["error"]))
                continue
            rec["variants"][key].update(t)
            log(f"{tag} {key}: {t['ms']:.3f} ms ({t['p20']:.3f}-{t['p80']:.3f})")
    rec["method"] = bench.method
    steps = eager = x = dy = None
    torch._dynamo.reset()
    free(device)
    return rec


def run_llama(args, device):
    """The converted LlamaForCausalLM step: each variant built from the same initial weights, warmed
    and measured alone over its resident model and optimizer state, then all timed interleaved."""
    name = LLAMA_CONFIG if device.type == "cuda" else CPU_LLAMA_CONFIG
    cfg = (model.CONFIGS if device.type == "cuda" else model.CPU_CONFIGS)[name]
    rec = {"config_name": name, "config": cfg, "variants": {}}
    log(f"llama {name}: {cfg}")
    base = model.build_hf(cfg, device, torch.bfloat16)
    (ids,) = model.batches(model.text_tokens(), cfg, 1, device)
    runners = {}
    for key in args.llama_variants:
        if device.type != "cuda" and key.endswith("_compile"):
            rec["variants"][key] = {"status": "unavailable",
                                    "error": "CPU run: torch.compile is measured on a GPU only"}
            log(f"llama {key}: unavailable (CPU run)")
            continue
        free(device)
        held = torch.cuda.memory_allocated(device) if device.type == "cuda" else None
        try:
            r = model.Runner(key, base, device)
            v = dict(measure_variant(device, lambda r=r: r.step(ids), r.params, key.endswith("_compile")),
                     status="ok", note=r.note)
        except (model.Unavailable, Unavailable) as exc:
            rec["variants"][key] = {"status": "unavailable", "error": str(exc)}
            log(f"llama {key}: unavailable ({exc})")
            continue
        except Exception as exc:  # noqa: BLE001
            rec["variants"][key] = {"status": "error", "error": errstr(exc)}
            log(f"llama {key}: error ({rec['variants'][key]['error']})")
            r = None
            free(device)
            continue
        v["resident_bytes"] = None if held is None else v["before_bytes"] - held
        rec["variants"][key] = v
        runners[key] = r
        log(f"llama {key}: step memory over resident {_mib(v['peak_bytes'])} MiB, resident "
            f"{_mib(v['resident_bytes'])} MiB, saved {_mib(v['saved_bytes'])} MiB, first calls {v['first_calls_s']} s")
    if runners:
        reps = 2 if args.quick else LLAMA_REPS
        log(f"llama: timing {len(runners)} variants in {args.rounds} interleaved rounds of {reps} steps")
        times = model.interleaved_ms({k: (lambda r=r: r.step(ids)) for k, r in runners.items()}, device,
                                     args.rounds, reps)
        tokens = cfg["batch"] * cfg["seq"]
        for key, ms in times.items():
            med = statistics.median(ms)
            rec["variants"][key].update(ms=med, round_ms=ms, tokens_per_s=tokens / med * 1e3)
            log(f"llama {key}: {med:.2f} ms a step, {tokens / med * 1e3:,.0f} tokens/s")
    runners = base = None
    torch._dynamo.reset()
    free(device)
    return rec


def _mib(b):
    return "–" if b is None else f"{b / MIB:,.0f}"


def shape_label(s):
    if s["label"] == "gelu":
        return f"GELU MLP {s['M']} × {s['d']}"
    return f"SwiGLU {s['M']} × {s['d']} → {s['h']}"


def _target(rec, num, den, field, limit):
    """{ratio: num's field / den's, verdict} of one target (n/a where either figure is missing). A
    time (field "ms") also gives the per-round ratios' range, `rounds` [least, greatest], and its
    verdict is "tie" where the medians' ratio is over the limit but some round's is not: the run
    cannot tell the two apart at that limit."""
    a = report.ok_value(rec, num, field)
    b = report.ok_value(rec, den, field) if den is not None else None
    out = {"ratio": a / b if a is not None and b else None, "verdict": report.verdict(a, b, limit)}
    if field == "ms" and out["ratio"] is not None:
        q = report.round_ratios(rec["variants"][num], rec["variants"][den])
        out["rounds"] = [min(q), max(q)] if q else None
        if q and out["verdict"] == "not met" and min(q) <= limit:
            out["verdict"] = "tie"
    return out


def targets(res):
    """{where: {target: {ratio, verdict}}}: each fused FP8 variant of a path other than the old one
    at each MLP shape, and the converted Llama's FP8 variants."""
    out = {}
    old = res.get("old_fp8_path") if res.get("old_fp8_path") in res["fp8_paths"] else None
    for s in res["shapes"]:
        for path in res["fp8_paths"]:
            if path == old:
                continue
            for scaling in FP8_SCALINGS:
                key = fp8_key(scaling, path)
                rows = {"saved_vs_fused_bf16": ("fused_bf16", "saved_bytes"),
                        "peak_vs_fused_bf16": ("fused_bf16", "peak_bytes"),
                        "peak_vs_torchao": ("torchao_tensorwise", "peak_bytes"),
                        "time_vs_old_fp8_path": (old and fp8_key(scaling, old), "ms")}
                out[f"{shape_label(s)}: {key}"] = {t: _target(s, key, den, field, TARGETS[t])
                                                   for t, (den, field) in rows.items()}
    llama = res.get("llama")
    for key in (k for k in LLAMA_FP8 if k in llama["variants"]) if llama else ():
        # the old path itself and the uncompiled step have no old path to be timed against
        out[f"LlamaForCausalLM {llama['config_name']}: {key}"] = {
            "llama_step_memory_vs_torchao": _target(llama, key, "torchao_compile", "peak_bytes",
                                                    TARGETS["llama_step_memory_vs_torchao"]),
            "llama_tokens_per_s_vs_old_fp8_path": _target(llama, key, LLAMA_OLD_PATH.get(key), "ms",
                                                          TARGETS["llama_tokens_per_s_vs_old_fp8_path"])}
    return out


def _saved(v):
    if v.get("status") != "ok" or v.get("saved_bytes") is None:
        return "–"
    return f"{_mib(v['saved_bytes'])} ({v['saved_storages']})"


def _ok(v, key):
    return v.get(key) if v.get("status") == "ok" else None


def markdown(res):
    env = res["environment"]
    paths = ", ".join(f"`{p}`" for p in res["fp8_paths"])
    old = res.get("old_fp8_path")
    L = [f"# Memory of a training step: FP8 against bf16 and torchao ({env.get('date_utc', '')[:10]})", "",
         f"{report.environment_line(env)}. bf16 master weights. Each variant built fresh and measured alone after "
         f"{res['warmup_steps']} warm-up steps: peak = max_memory_allocated during one step minus memory_allocated "
         "before it; saved = the distinct non-parameter storages saved for backward (x counted; not for compiled "
         f"variants); time per step the median over {res['rounds']} interleaved rounds. FP8 save-for-backward paths: "
         f"{paths}" + (f" (old: `{old}`)" if old else " (the old path is not selectable yet: no old-path figures)")
         + ". Produced by `python -m bench.memory` (bench/memory.py says what each figure is).", "",
         "## Targets (#41)", "", "| where | target | figure | verdict |", "|---|---|---|---|"]
    for where, verdicts in res["targets_met"].items():
        for key, t in verdicts.items():
            fig = "–" if t["ratio"] is None else f"{t['ratio']:.3f}"
            if t["ratio"] is not None and t["verdict"] == "not met" and fig == f"{res['targets'][key]:.3f}":
                fig = f"{t['ratio']:.10g}"  # over its limit only beyond three places: say by how much
            if t.get("rounds"):
                fig += f" (rounds {t['rounds'][0]:.3f}–{t['rounds'][1]:.3f})"
            L.append(f"| {where} | {TARGET_NAMES[key]} | {fig} | {t['verdict']} |")
    L += ["", "Figures: the FP8 variant's over the comparator's (bytes; ms for the time; for tokens/s the ms "
          "ratio, so ≤ 1 meets it; a time's verdict is \"tie\" where the medians' ratio is over its limit and some "
          "interleaved round's is not). A figure over its limit only beyond three places is shown to ten digits: for the "
          "saved bytes, the FP8 copies are exactly half of bf16's and their 4-byte scales are the excess. The "
          "loss-curve target (500 steps within the main job's FP8 limit) is the main job's FP8 check, not measured "
          "here.", ""]
    notes = res.get("part_notes", {})  # a record merged from runs: what each part measured
    if res["shapes"]:
        L += ["## MLPs, forward + backward (MiB; ms)", ""] + ([notes["mlp"], ""] if "mlp" in notes else []) + [
              "| shape | variant | peak MiB | saved MiB (storages) | ms (p20–p80) | first calls s |",
              "|---|---|---|---|---|---|"]
        for s in res["shapes"]:
            for key, v in s["variants"].items():
                if v.get("status") != "ok":
                    L.append(f"| {shape_label(s)} | {key} | {v.get('status')}: {v.get('error', '')} | | | |")
                    continue
                L.append(f"| {shape_label(s)} | {key} | {_mib(v.get('peak_bytes'))} | {_saved(v)} | "
                         f"{report.ms_cell(v) if 'ms' in v else '–'} | {v.get('first_calls_s', '–')} |")
        L.append("")
    llama = res.get("llama")
    if llama:
        cfg = llama["config"]
        L += [f"## LlamaForCausalLM training step ({llama['config_name']}: d {cfg['d']}, h {cfg['h']}, "
              f"{cfg['layers']} layers, {cfg['batch']} × {cfg['seq']} tokens; fused AdamW)", ""]
        L += ([notes["llama"], ""] if "llama" in notes else []) + [
              "| variant | step memory over resident MiB | resident MiB | saved MiB (storages) | ms a step | tokens/s "
              "| what |", "|---|---|---|---|---|---|---|"]
        for key, v in llama["variants"].items():
            if v.get("status") != "ok":
                L.append(f"| {key} | {v.get('status')}: {v.get('error', '')} | | | | | |")
                continue
            ms, tps = v.get("ms"), v.get("tokens_per_s")
            L.append(f"| {key} | {_mib(v.get('peak_bytes'))} | {_mib(v.get('resident_bytes'))} | {_saved(v)} | "
                     f"{'–' if ms is None else f'{ms:.2f}'} | {'–' if tps is None else f'{tps:,.0f}'} | "
                     f"{v.get('note', '')} |")
        L.append("")
    return "\n".join(L)


def make_png(res, path):
    panels = [(s["variants"], shape_label(s)) for s in res["shapes"]]
    if res.get("llama"):
        panels.append((res["llama"]["variants"], f"LlamaForCausalLM {res['llama']['config_name']} step "
                       "(peak: over resident)"))
    plt = report.pyplot() if panels else None
    if plt is None:
        return None
    fig, axes = plt.subplots(1, len(panels), figsize=(4.5 * len(panels), 4.5), squeeze=False)
    for ax, (vs, title) in zip(axes[0], panels):
        keys = [k for k, v in vs.items() if v.get("status") == "ok"]
        at = range(len(keys))
        ax.bar([i - 0.2 for i in at], [(_ok(vs[k], "peak_bytes") or 0) / MIB for k in keys], 0.4, label="peak")
        ax.bar([i + 0.2 for i in at], [(_ok(vs[k], "saved_bytes") or 0) / MIB for k in keys], 0.4, label="saved")
        ax.set_xticks(list(at), keys, rotation=35, ha="right", fontsize=8)
        ax.set(title=title, ylabel="MiB")
        ax.legend(fontsize=8)
    return report.save_figure(plt, fig, path, dpi=100)


def parse_args(argv):
    p = report.record_parser(__doc__)
    p.add_argument("--parts", default=",".join(PARTS), help=f"comma list of {', '.join(PARTS)}")
    p.add_argument("--fp8-paths", default=",".join(FP8_PATHS),
                   help=f"comma list of the FP8 save-for-backward paths to measure ({', '.join(FP8_PATHS)})")
    p.add_argument("--variants", default=None, help="comma list of MLP variants (default: all, "
                   f"{', '.join(mlp_variants(FP8_PATHS))})")
    p.add_argument("--llama-variants", default=",".join(LLAMA_DEFAULT_VARIANTS),
                   help=f"comma list of {LLAMA_VARIANTS} (default: the first {len(LLAMA_DEFAULT_VARIANTS)})")
    p.add_argument("--rounds", type=int, default=5, help="interleaved timing rounds (at least 5 for the record)")
    p.add_argument("--quick", action="store_true", help="one GELU shape and the SwiGLU one (the CPU: tiny shapes), "
                   "at most 2 rounds")
    args = report.parse_record_args(p, argv)
    if args.report:
        return args
    args.parts = report.comma_list(p, "--parts", args.parts, PARTS)
    args.fp8_paths = report.comma_list(p, "--fp8-paths", args.fp8_paths, list(FP8_PATHS))
    args.llama_variants = report.comma_list(p, "--llama-variants", args.llama_variants, LLAMA_VARIANTS)
    known = mlp_variants(args.fp8_paths)  # with the FP8 paths picked
    args.variants = report.comma_list(p, "--variants", args.variants, known) if args.variants else known
    if args.quick:
        args.rounds = min(args.rounds, 2)
    return report.checked_record_args(p, args)


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if report.rewrote_record(args, markdown, make_png):
        return None
    device = torch.device(args.device)
    if device.type == "cuda":
        shapes = [SHAPES[0], SHAPES[2]] if args.quick else SHAPES
    else:
        shapes = CPU_SHAPES
    res = {"environment": environment.environment(device, sys.argv if argv is None else argv), "targets": TARGETS,
           "rounds": args.rounds, "warmup_steps": WARMUP_STEPS, "parts": args.parts, "fp8_paths": args.fp8_paths,
           "old_fp8_path": OLD_FP8_PATH, "shapes": [], "llama": None}
    paths = []

    def save():
        res["targets_met"] = targets(res)
        paths[:] = report.write_dated_record(args.out, "memory", res, markdown, make_png)
    if "mlp" in args.parts:
        fp8.note()
        for shape in shapes:
            res["shapes"].append(run_mlp_shape(shape, args.variants, args, device))
            save()  # after each shape, so a run cut short keeps what it measured
    if "llama" in args.parts:
        res["llama"] = run_llama(args, device)
    save()
    log("wrote " + ", ".join(paths))
    return res


if __name__ == "__main__":
    main()
