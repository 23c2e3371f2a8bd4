#!/usr/bin/env python
"""Markdown report, console summary and chart of a benchmark JSON (no torch needed).

    python bench/report.py docs/results/mlp-2026-11-30.json     # rewrites mlp-2026-11-30.md and .png

The chart needs matplotlib; without it only the markdown is written.
"""
import argparse
import json
import os
import sys

MIB = 1024 * 1024
LABELS = {"floor": "six GEMMs (floor)", "eager": "eager PyTorch", "compile": "torch.compile",
          "auto_l0": "FusedMLP auto", "auto_exact_l0": "FusedMLP auto, exact-M tuning", "auto_l1": "FusedMLP auto, ckpt 1", "auto_l2": "FusedMLP auto, ckpt 2",
          "h-1_l0": "FusedMLP h=-1 (unfused)", "h0_l0": "FusedMLP h=0", "h1_l0": "FusedMLP h=1",
          "h2_l0": "FusedMLP h=2", "flash_attn": "flash-attn FusedMLP",
          "liger": "Liger (Triton)", "fused_l0": "FusedGatedMLP", "fused_l1": "FusedGatedMLP, ckpt 1",
          "fused_l2": "FusedGatedMLP, ckpt 2", "fused_eager": "FusedGatedMLP MLPs", "fused_compile":
          "FusedGatedMLP MLPs, torch.compile"}
COLORS = {"floor": "#9e9e9e", "eager": "#ef6c00", "compile": "#c62828", "auto_l0": "#1565c0", "auto_exact_l0": "#0d47a1",
          "auto_l1": "#42a5f5",
          "auto_l2": "#90caf9", "h-1_l0": "#2e7d32", "h0_l0": "#66bb6a", "h1_l0": "#a5d6a7", "h2_l0": "#c8e6c9",
          "flash_attn": "#6a1b9a", "liger": "#6a1b9a", "fused_l0": "#1565c0", "fused_l1": "#42a5f5",
          "fused_l2": "#90caf9", "fused_eager": "#1565c0", "fused_compile": "#42a5f5"}
ORDER = list(LABELS)
# the fp8 section's variants, in its tables' and chart's order ("fused": FusedMLP, or FusedDense in the Linear block)
FP8_LABELS = {"fp8_floor": "FP8 GEMMs (floor)", "bf16_floor": "bf16 GEMMs", "eager": "eager PyTorch",
              "fused_bf16": "fused bf16", "fused_fp8_current": "fused FP8 current",
              "fused_fp8_delayed": "fused FP8 delayed", "fused_fp8_current_cached": "fused FP8 current, cached",
              "fused_fp8_delayed_cached": "fused FP8 delayed, cached", "torchao_tensorwise": "torchao tensorwise",
              "torchao_rowwise": "torchao rowwise", "compile_bf16": "torch.compile bf16",
              "fused_fp8_eager": "fused FP8, eager", "fused_fp8_compile": "fused FP8, torch.compile",
              "fused_fp8_delayed_compile": "fused FP8 delayed, torch.compile"}
FP8_ORDER = list(FP8_LABELS)
LABELS.update(FP8_LABELS)
COLORS.update({"fp8_floor": "#616161", "bf16_floor": "#bdbdbd", "fused_bf16": "#1565c0",
               "fused_fp8_current": "#2e7d32", "fused_fp8_delayed": "#00838f", "fused_fp8_current_cached": "#81c784",
               "fused_fp8_delayed_cached": "#4dd0e1", "torchao_tensorwise": "#6a1b9a", "torchao_rowwise": "#ba68c8",
               "compile_bf16": "#c62828", "fused_fp8_eager": "#2e7d32", "fused_fp8_compile": "#81c784",
               "fused_fp8_delayed_compile": "#4dd0e1"})
# the fp8 targets: torchao tensorwise's time / the fused FP8 variant's at least this
FP8_TARGETS = {(8192, 4096): {"fused_fp8_current": 1.15, "fused_fp8_delayed": 1.20},
               (16384, 8192): {"fused_fp8_current": 1.10, "fused_fp8_delayed": 1.15}}
FP8_DENSE_TARGETS = {(16384, 8192, 8192): 1.05}
# the FP8 gated MLP's, per (M, d, h): torchao tensorwise's time / FusedGatedMLP FP8's at least this
FP8_GATED_TARGETS = {(16384, 4096, 14336): {"fused_fp8_current": 1.15, "fused_fp8_delayed": 1.15}}
# the FP8 stack's, per (blocks, batch, seq, d, h): torchao tensorwise (every nn.Linear, compiled)'s time /
# fused_dense FP8's, eager (the target) and compiled (shown against the same figure where it was measured)
FP8_STACK_TARGETS = {(2, 2, 2048, 4096, 11008): 1.10}
FLOOR_KEYS = ("fp8_floor", "bf16_floor")
FP8_SECTIONS = ("fp8", "fp8_dense", "fp8_gated", "fp8_stack")  # the result lists of the fp8 section
TOLERANCE = {"bf16": 1e-2, "fp16": 2e-3, "fp32": 1e-4}  # relative error, docs/contract.md
ACT = {"gelu_approx": "gelu", "relu": "relu", "sqrelu": "sqrelu", "swiglu": "swiglu", "geglu": "geglu"}
# the gated MLP's targets: FusedGatedMLP's time / the floor's at most this, per (M, d, h)
GATED_FLOOR_TARGET = {(8192, 2048, 5632): 1.05, (8192, 4096, 11008): 1.03, (16384, 4096, 14336): 1.03}
GATED_CKPT2_TARGET = 1.30
SUSTAINED_KEYS = ("floor", "eager", "compile", "auto_l0")


def label(key):
    return LABELS.get(key, key)


def _f(x, fmt="{:.3f}", none="–"):
    return none if x is None else fmt.format(x)


def _ok(v):
    return isinstance(v, dict) and v.get("status") == "ok" and v.get("ms") is not None


def _cell(v):
    return "–" if v is None else ("?" if v.get("status") == "ok" else v.get("status", "?"))


def _cfg(r):
    return f"{r['dtype']} {ACT.get(r['activation'], r['activation'])}"


def _keys(records, order=ORDER):
    keys = list(dict.fromkeys(k for r in records for k in r["variants"]))
    return sorted(keys, key=lambda k: order.index(k) if k in order else 99)


def _same_shape(records, r):
    key = (r["dtype"], r["activation"], r["M"], r["d"])
    return next((o for o in records or [] if (o["dtype"], o["activation"], o["M"], o["d"]) == key), None)


def _warmup(res):
    w = (res.get("method") or {}).get("sustained_warmup_ms")
    return "a long warm-up" if w is None else f"{w:.0f} ms"


def round_ratios(num, den):
    """num / den per interleaved round ([] without rounds)."""
    a, b = (num or {}).get("round_ms"), (den or {}).get("round_ms")
    return [x / y for x, y in zip(a, b) if y] if a and b and len(a) == len(b) else []


def round_range(num, den):
    """' (rounds a–b)': least and greatest num / den over the interleaved rounds (blocks timed close
    together), to read a verdict on the medians against the run's own spread; '' without rounds."""
    a, b = (num or {}).get("round_ms"), (den or {}).get("round_ms")
    if not a or not b or len(a) != len(b):
        return ""
    q = [x / y for x, y in zip(a, b) if y]
    return f" (rounds {min(q):.3f}–{max(q):.3f})" if q else ""


def targets(res):
    """[(target, figure, met: True / False / None)] computed from the run."""
    rows, mlp = [], res.get("mlp", [])
    for r in mlp:
        if (r["dtype"], r["activation"]) != ("bf16", "gelu_approx"):
            continue
        vs, d, shape = r["variants"], r["d"], f"{r['M']}×{r['d']}"
        a, e, floor = vs.get("auto_l0"), vs.get("eager"), vs.get("floor")
        if not _ok(a):
            rows.append((f"bf16 gelu {shape}: FusedMLP auto measured", _cell(a), False))
            continue
        lim, xf = (1.11 if d <= 1024 else 1.03), a.get("x_floor")
        # the sustained figure beside the standard one, whose verdict it does not change
        sv = (_same_shape(res.get("sustained"), r) or {}).get("variants", {})
        s_auto, s_eager, s_floor = (sv.get(k) if _ok(sv.get(k)) else None for k in ("auto_l0", "eager", "floor"))
        sus_floor = sus_eager = ""
        if s_auto and s_auto.get("x_floor") is not None:
            sus_floor = (f"; sustained {s_auto['x_floor']:.3f}{round_range(s_auto, s_floor)} "
                         f"(eager {_f((s_eager or {}).get('x_floor'))})")
        if s_auto and s_auto.get("speedup_vs_eager") is not None:
            sus_eager = f"; sustained {s_auto['speedup_vs_eager']:.3f}{round_range(s_eager, s_auto)}"
        rows.append((f"bf16 gelu {shape}: auto / six GEMMs ≤ {lim:.2f}",
                     f"{_f(xf)}{round_range(a, floor)} (eager {_f(e.get('x_floor') if _ok(e) else None)}){sus_floor}",
                     None if xf is None else xf <= lim))
        need, se = {1024: 1.20, 2048: 1.08}.get(d), a.get("speedup_vs_eager")
        if need:
            rows.append((f"bf16 gelu {shape}: eager / auto ≥ {need:.2f}", _f(se) + round_range(e, a) + sus_eager,
                         None if se is None else se >= need))
        x = vs.get("auto_exact_l0")  # 'auto' as shipped against exact-M tuning in the same process
        if _ok(x):
            q = a["ms"] / x["ms"]
            rows.append((f"bf16 gelu {shape}: auto / exact-M auto ≤ 1.01", f"{q:.3f}{round_range(a, x)}", q <= 1.01))
        for base in ("eager", "compile"):  # ahead by more than the spread: in every round
            q = round_ratios(vs.get(base), a)
            if q:
                rows.append((f"bf16 gelu {shape}: {base} / auto > 1 in every round",
                             f"{min(q):.3f}–{max(q):.3f}", min(q) > 1.0))
        for lvl, lim2 in ((1, 1.05), (2, 1.25)):
            v, t = vs.get(f"auto_l{lvl}"), f"bf16 gelu {shape}: ckpt {lvl} / ckpt 0 ≤ {lim2:.2f}"
            if _ok(v):
                rows.append((t, f"{v['ms'] / a['ms']:.3f}{round_range(v, a)}", v["ms"] / a["ms"] <= lim2))
            elif v is not None:
                rows.append((t, _cell(v), False))
    for r in mlp:
        a = r["variants"].get("auto_l0")
        for base, k in (("eager", "speedup_vs_eager"), ("compile", "speedup_vs_compile")):
            if _ok(a) and a.get(k) is not None:
                rows.append((f"{_cfg(r)} {r['M']}×{r['d']}: auto not slower than {base} ({base} / auto ≥ 1)",
                             f"{a[k]:.3f}{round_range(r['variants'].get(base), a)}", a[k] >= 1.0))
    for r in mlp:  # ReLU keeps a 1-bit mask instead of the pre-activation
        if r["activation"] != "relu":
            continue
        for key in ("auto_l0", "auto_l1"):
            a = r["variants"].get(key)
            if not _ok(a) or "saved_bytes" not in a.get("memory", {}):
                continue
            lvl, (M, d, h) = int(key[-1]), (r["M"], r["d"], r["h"])
            expect = M * d * 2 + M * h // 8 + (M * h * 2 if lvl == 0 else 0)
            saved = a["memory"]["saved_bytes"]
            rows.append((f"{r['dtype']} relu {M}×{d} {label(key)}: saved ≤ x{' + act_out' if lvl == 0 else ''} + "
                         f"1-bit mask = {expect / MIB:.1f} MiB", f"{saved / MIB:.1f} MiB", saved <= expect * 1.01))
    bad, n = [], 0
    for r in mlp:
        tol = TOLERANCE.get(r["dtype"])
        for k, v in r["variants"].items():
            if _ok(v) and v.get("rel_err") and tol is not None:
                n += 1
                worst = max(v["rel_err"].values())
                if not worst <= tol:  # NaN fails too
                    bad.append(f"{_cfg(r)} {r['M']}×{r['d']} {label(k)}: {worst:.1e}")
    if n:
        rows.append((f"every measured variant within the accuracy tolerance (bf16 {TOLERANCE['bf16']:g}, fp16 "
                     f"{TOLERANCE['fp16']:g}; worst of out, dx, dW1, dW2 vs float32)",
                     f"{n - len(bad)} of {n}" + (": fails " + "; ".join(bad) if bad else ""), not bad))
    host = res.get("host") or {}
    hv, inter = host.get("variants", {}), host.get("interleaved") or {}
    if inter.get("status") == "ok":
        q = inter["x_eager"]["auto_l0"]
        rows.append((f"host CPU time M={host['M']} d={host['d']}: auto / eager ≤ 1 (interleaved rounds, median ratio)",
                     f"{inter['cpu_us']['auto_l0']:.0f} / {inter['cpu_us']['eager']:.0f} µs, ratio {q:.3f}", q <= 1.0))
    elif hv:
        rows.append(("host CPU time: auto / eager ≤ 1", _cell(hv.get("auto_l0")), None))
    for r in (res.get("host_layers") or {}).get("layers", []):
        t = f"host CPU time {r.get('layer', '')} d={r['d']}: fused / unfused ≤ 1 (median of per-round ratios)"
        if "x_unfused" in r:
            lo, hi = r["x_unfused_range"]
            rows.append((t, f"{r['cpu_us']['fused']:.1f} / {r['cpu_us']['unfused']:.1f} µs, ratio {r['x_unfused']:.3f} "
                            f"(rounds {lo:.3f}–{hi:.3f})", r["x_unfused"] <= 1.0))
        else:
            rows.append((t, f"{r.get('status')}: {str(r.get('error'))[:120]}", False))
    return rows


def _sustained(res):
    recs = res.get("sustained") or []
    if not recs:
        return []
    method = (res.get("method") or {}).get("sustained")
    L = [f"## Sustained load (each block after {_warmup(res)} of its own steps)\n",
         (method[:1].upper() + method[1:] + ". " if method else "")
         + "ms, lower is better; ÷: ratio of the two medians; 'standard' is auto ÷ floor in the MLP table "
           "above (the usual warm-up per block), the run of record.\n"]
    clocks = any("clocks" in v for r in recs for v in r["variants"].values())
    head = ["M × d"] + [f"{label(k)} ms" for k in SUSTAINED_KEYS] + [
        "eager ÷ auto", "compile ÷ auto", "auto ÷ floor", "auto ÷ floor, standard"]
    head += ["SM MHz floor / eager / compile / auto", "W floor / eager / compile / auto"] if clocks else []
    L += ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    for r in recs:
        vs = r["variants"]
        a = vs["auto_l0"] if _ok(vs.get("auto_l0")) else {}
        std = ((_same_shape(res.get("mlp"), r) or {}).get("variants") or {}).get("auto_l0")
        cells = [f"{r['M']} × {r['d']}"] + [f"{vs[k]['ms']:.3f}" if _ok(vs.get(k)) else _cell(vs.get(k))
                                          for k in SUSTAINED_KEYS]
        cells += [_f(a.get("speedup_vs_eager")), _f(a.get("speedup_vs_compile")), _f(a.get("x_floor")),
                  _f(std.get("x_floor") if _ok(std) else None)]
        if clocks:
            cells += [" / ".join(_f((vs.get(k) or {}).get("clocks", {}).get(f), "{:.0f}") for k in SUSTAINED_KEYS)
                      for f in ("sm_mhz", "power_w")]
        L.append("| " + " | ".join(cells) + " |")
    L.append("")
    sampling = next((r.get("clock_sampling") for r in recs if r.get("clock_sampling")), None)
    if clocks and isinstance(sampling, dict):
        counts = "; ".join(f"{r['M']} × {r['d']} " + " / ".join(
            str((r["variants"].get(k) or {}).get("clocks", {}).get("samples", 0)) for k in SUSTAINED_KEYS)
            for r in recs)
        L.append(f"SM clock and power: medians of the {sampling.get('tool', '')} samples (every "
                 f"{sampling.get('interval_ms', '–')} ms) taken inside each variant's timed blocks and the end of "
                 f"their warm-ups (at most 300 ms); samples per variant: {counts}.\n")
    elif isinstance(sampling, str):
        L.append(f"SM clock and power: {sampling}.\n")
    return L


def _detail_cells(v, ratios):
    """'ms | p20–p80 | TF/s | <ratios> | saved MiB | peak Δ MiB | err out | err dx' of a measured variant."""
    mem, re = v.get("memory", {}), v.get("rel_err", {})

    def mib(key):
        return _f(mem.get(key) and mem[key] / MIB, "{:.1f}")
    return " | ".join([f"{v['ms']:.3f}", f"{_f(v.get('p20'))}–{_f(v.get('p80'))}", f"{v['tflops']:.0f}",
                       *(_f(v.get(k)) for k in ratios), mib("saved_bytes"), mib("peak_delta_bytes"),
                       _f(re.get("out"), "{:.1e}"), _f(re.get("dx"), "{:.1e}")])


def gated_targets(res):
    """(target, figure, met) rows of the gated section: FusedGatedMLP ahead of torch.compile and
    Liger, within its floor target, and checkpoint level 2 at most 1.30x level 0, keeping only x."""
    rows = []
    for r in res.get("gated", []):
        vs, shape = r["variants"], f"{r['activation']} {r['M']} × {r['d']} → {r['h']}"
        f = vs.get("fused_l0")
        if not _ok(f):
            continue
        for k in ("compile", "liger"):
            o = vs.get(k)
            if _ok(o):
                rows.append((f"{shape}: FusedGatedMLP ahead of {label(k)}",
                             f"{f['ms']:.3f} vs {o['ms']:.3f} ms{round_range(f, o)}", f["ms"] < o["ms"]))
            else:
                rows.append((f"{shape}: FusedGatedMLP ahead of {label(k)}", _cell(o), None))
        goal = GATED_FLOOR_TARGET.get((r["M"], r["d"], r["h"]))
        fl = vs.get("floor")
        if goal and _ok(fl):
            rows.append((f"{shape}: ≤ {goal:.2f}× floor", f"{f['ms'] / fl['ms']:.3f}×{round_range(f, fl)}",
                         f["ms"] / fl["ms"] <= goal))
        l2 = vs.get("fused_l2")
        if _ok(l2):
            x_bytes = r["M"] * r["d"] * (2 if r["dtype"] in ("bf16", "fp16") else 4)
            saved = (l2.get("memory") or {}).get("saved_bytes")
            rows.append((f"{shape}: ckpt 2 ≤ {GATED_CKPT2_TARGET:.2f}× ckpt 0, keeps at most x",
                         f"{l2['ms'] / f['ms']:.3f}×{round_range(l2, f)}, saved {_f(saved and saved / MIB, '{:.1f}')} "
                         f"MiB (x: {x_bytes / MIB:.1f} MiB)",
                         l2["ms"] / f["ms"] <= GATED_CKPT2_TARGET and saved is not None and saved <= x_bytes))
    return rows


def _gated(res):
    gated, stack, L = res.get("gated", []), res.get("gated_stack", []), []
    if gated:
        L += ["## Gated MLP forward + backward: ms (× floor)\n",
              "down(act(gate(x)) · up(x)), no biases, M tokens; floor = six plain GEMMs with gate and up as one "
              "GEMM of width 2h; TF/s = 18·M·d·h / time.\n"]
        for cfg in dict.fromkeys((r["dtype"], r["activation"]) for r in gated):
            recs = [r for r in gated if (r["dtype"], r["activation"]) == cfg]
            keys = _keys(recs)
            L += [f"### {cfg[0]}, {cfg[1]}\n", "| M × d → h | " + " | ".join(map(label, keys)) + " |",
                  "|---" * (len(keys) + 1) + "|"]
            for r in recs:
                cells = [f"{v['ms']:.3f} ({_f(v.get('x_floor'))}×)" if _ok(v) else _cell(v)
                         for v in map(r["variants"].get, keys)]
                L.append(f"| {r['M']} × {r['d']} → {r['h']} | " + " | ".join(cells) + " |")
            L.append("")
        L += ["### Gated detail: memory kept for backward, accuracy, checkpoint levels\n",
              "| dtype act | M × d → h | variant | ms | p20–p80 | TF/s | vs compile | saved MiB | peak Δ MiB | "
              "err out | err dx | note |", "|---" * 12 + "|"]
        for r in gated:
            for k in _keys([r]):
                v, head = r["variants"][k], f"| {_cfg(r)} | {r['M']} × {r['d']} → {r['h']} | {label(k)} |"
                if not _ok(v):
                    err = str(v.get("error", ""))[:160].replace("|", "/")
                    L.append(f"{head} {v.get('status')} |" + " |" * 7 + f" {err} |")
                    continue
                L.append(f"{head} {_detail_cells(v, ['speedup_vs_compile'])} | |")
        L.append("")
    for r in stack:
        L += [f"## Llama-style stack forward + backward ({r['blocks']} blocks, B {r['batch']}, T {r['seq']}, d {r['d']}, "
              f"h {r['h']}, {r['heads']} heads, {r['dtype']} {r['activation']})\n",
              "| variant | ms | p20–p80 | × eager | × compile |", "|---|---|---|---|---|"]
        e, c = r["variants"].get("eager"), r["variants"].get("compile")
        for k, v in r["variants"].items():
            if not _ok(v):
                L.append(f"| {label(k)} | {v.get('status')}: {str(v.get('error', ''))[:120]} | | | |")
                continue
            L.append(f"| {label(k)} | {v['ms']:.3f} | {_f(v.get('p20'))}–{_f(v.get('p80'))} | "
                     f"{_f(e['ms'] / v['ms'] if _ok(e) else None)} | {_f(c['ms'] / v['ms'] if _ok(c) else None)} |")
        L.append("")
    return L


def _vs_torchao(title, vs, key, need):
    """(target, figure, met): torchao tensorwise's time / key's at least need."""
    f, t = vs.get(key), vs.get("torchao_tensorwise")
    if not _ok(f):
        return title, _cell(f), False
    if not _ok(t):
        return title, f"torchao tensorwise {_cell(t)}", None
    q = t["ms"] / f["ms"]
    return title, f"{q:.3f}{round_range(t, f)}: {t['ms']:.3f} vs {f['ms']:.3f} ms", q >= need


def fp8_targets(res):
    """(target, figure, met) rows of the fp8 section: FusedMLP FP8 (weights cast every step) and
    FusedDense FP8 against torchao tensorwise at the target shapes."""
    rows = []
    for r in res.get("fp8", []):
        for key, need in FP8_TARGETS.get((r["M"], r["d"]), {}).items():
            rows.append(_vs_torchao(f"FP8 MLP {r['M']} × {r['d']}: FusedMLP {label(key)[6:]} ≥ {need:.2f}× torchao "
                                    "tensorwise (torchao / fused)", r["variants"], key, need))
    for r in res.get("fp8_dense", []):
        need = FP8_DENSE_TARGETS.get((r["M"], r["K"], r["N"]))
        if need:
            rows.append(_vs_torchao(f"FP8 Linear {_fp8_shape(r)}: FusedDense FP8 current ≥ {need:.2f}× torchao "
                                    "Float8Linear tensorwise (torchao / fused)", r["variants"], "fused_fp8_current",
                                    need))
    for r in res.get("fp8_gated", []):
        for key, need in FP8_GATED_TARGETS.get((r["M"], r["d"], r["h"]), {}).items():
            rows.append(_vs_torchao(f"FP8 gated MLP {r['activation']} {_fp8_shape(r)}: FusedGatedMLP {label(key)[6:]} "
                                    f"≥ {need:.2f}× torchao tensorwise (torchao / fused)", r["variants"], key, need))
    for r in res.get("fp8_stack", []):
        need = FP8_STACK_TARGETS.get(tuple(r.get(k) for k in ("blocks", "batch", "seq", "d", "h")))
        if not need:
            continue
        what = (f"FP8 Llama-style stack ({r['blocks']} blocks, B {r['batch']}, T {r['seq']}, d {r['d']}, h {r['h']}): "
                "fused_dense FP8")
        rows.append(_vs_torchao(f"{what} eager ≥ {need:.2f}× torchao tensorwise + torch.compile of the "
                                "whole stack (torchao / fused)", r["variants"], "fused_fp8_eager", need))
        for key, how in (("fused_fp8_compile", "torch.compile'd"), ("fused_fp8_delayed_compile",
                                                                    "delayed scaling, torch.compile'd")):
            title, fig, met = _vs_torchao(f"{what} {how} ≥ {need:.2f}× torchao tensorwise + torch.compile "
                                          "(torchao / fused)", r["variants"], key, need)
            if _ok(r["variants"].get(key)):  # compiled where it works: no verdict where it did not run
                rows.append((title, fig, met))
            elif key in r["variants"]:
                rows.append((title, _cell(r["variants"][key]), None))
    return rows


def _fp8_kind(r):
    """The row label of an fp8 record: MLP, Linear, gated or stack."""
    if "K" in r:
        return "Linear"
    return {"fp8_gated": "gated", "fp8_stack": "stack"}.get(str(r.get("id", "")).split(":")[0], "MLP")


def _fp8_shape(r):
    kind = _fp8_kind(r)
    if kind == "Linear":
        return f"{r['M']} × {r['K']} → {r['N']}"
    if kind == "gated":
        return f"{r['M']} × {r['d']} → {r['h']}"
    if kind == "stack":
        return f"B {r['batch']} × T {r['seq']}, d {r['d']} → h {r['h']}"
    return f"{r['M']} × {r['d']}"


def _rounds(r):
    return next((v["rounds"] for v in r["variants"].values() if _ok(v) and v.get("rounds")), None)


def _error(v):
    return str(v.get("error", ""))[:160].replace("|", "/")


def _fp8_table(recs, head):
    """ms (× FP8 floor) per shape, a column per variant, an unmeasured variant's status only."""
    keys = _keys(recs, FP8_ORDER)
    L = [f"| {head} | rounds | " + " | ".join(map(label, keys)) + " |", "|---" * (len(keys) + 2) + "|"]
    for r in recs:
        cells = [f"{v['ms']:.3f} ({_f(v.get('x_fp8_floor'))}×)" if _ok(v) else _cell(v)
                 for v in map(r["variants"].get, keys)]
        L.append(f"| {_fp8_shape(r)} | {_f(_rounds(r), '{}')} | " + " | ".join(cells) + " |")
    return L + [""]


def _fp8_parts(recs, names, head):
    """Each floor's GEMMs one by one (ms), their sum and the floor's own figure."""
    L = []
    for r in recs:
        for k in FLOOR_KEYS:
            v = r["variants"].get(k)
            if _ok(v) and v.get("parts_ms"):
                pm = v["parts_ms"]
                L.append(f"| {_fp8_shape(r)} | {label(k)} | " + " | ".join(f"{pm[n]:.3f}" for n in names)
                         + f" | {sum(pm.values()):.3f} | {v['ms']:.3f} |")
    if not L:
        return []
    return [f"| {head} | floor | " + " | ".join(names) + " | sum | together |", "|---" * (len(names) + 4) + "|"] \
        + L + [""]


def _fp8(res):
    mlp, dense, L = res.get("fp8", []), res.get("fp8_dense", []), []
    gated, stack = res.get("fp8_gated", []), res.get("fp8_stack", [])
    if mlp:
        L += ["## FP8 MLP forward + backward: ms (× FP8 floor)\n",
              "Linear(d, 4d) → GELU (tanh) → Linear(4d, d), bf16 master weights, M tokens. FP8 floor = the six GEMMs "
              "of the step as torch._scaled_mm e4m3 × e4m3 → bf16 with per-tensor scales (operands quantized "
              "beforehand); bf16 GEMMs = the same six as torch.mm; fused = FusedMLP (heuristic 'auto'), FP8: "
              "Float8Recipe(scaling, min_features=0) called with is_first_microbatch=True (weights cast every step), "
              "cached: False after one step with True; torchao = convert_to_float8_training of the nn.Linear MLP, "
              "torch.compile'd. TF/s = 12·M·d·h / time.\n"]
        L += _fp8_table(mlp, "M × d")
    if dense:
        L += ["## FP8 Linear forward + backward: ms (× FP8 floor)\n",
              "One Linear with bias, x[M, K] → [M, N], bf16 master weights: nn.Linear (eager), FusedDense bf16 and "
              "FP8 (Float8Recipe(scaling='current', min_features=0), called as dense(x)), torchao Float8Linear "
              "(tensorwise) torch.compile'd; floors: the three GEMMs (x@Wᵀ, dY@W, dYᵀ@x). TF/s = 6·M·K·N / time.\n"]
        L += _fp8_table(dense, "M × K → N")
    if gated:
        L += ["## FP8 gated MLP forward + backward: ms (× FP8 floor)\n",
              "down(act(gate(x)) · up(x)), no biases, bf16 master weights, M tokens. Floors: the six GEMMs of the "
              "step with gate and up as one GEMM of width 2h (FP8: torch._scaled_mm e4m3 × e4m3 → bf16, per-tensor "
              "scales, as the MLP's); eager = nn.Linear gate / up / down (LlamaMLP's names); fused = FusedGatedMLP "
              "(heuristic 'auto'), FP8 and cached as the MLP's; torchao = convert_to_float8_training (tensorwise) of "
              "the eager module, torch.compile'd. TF/s = 18·M·d·h / time.\n"]
        L += _fp8_table(gated, "M × d → h")
    for r in stack:
        vs = r["variants"]
        e, c, t = (vs.get(k) if _ok(vs.get(k)) else None for k in ("eager", "compile_bf16", "torchao_tensorwise"))
        L += [f"## FP8 Llama-style stack forward + backward ({r['blocks']} blocks, B {r['batch']}, T {r['seq']}, d "
              f"{r['d']}, h {r['h']}, {r['heads']} heads, bf16 {r['activation']})\n",
              "bench/gated.py's stack (RMSNorm, causal scaled_dot_product_attention, gated MLP). torchao = "
              "convert_to_float8_training (tensorwise) of every nn.Linear, torch.compile'd; fused FP8 = the MLPs "
              "swapped by replace_llama_mlps(fp8=recipe), qkv and o_proj by FusedDense(fp8=recipe), recipe "
              "Float8Recipe(scaling='current', min_features=0) (the delayed variant: scaling='delayed'), called as "
              "model(x). ÷ = that variant's time / "
              "this one's. TF/s counts the projections' GEMMs only.\n",
              "| variant | ms | p20–p80 | TF/s | eager bf16 ÷ | torch.compile bf16 ÷ | torchao ÷ |", "|---" * 7 + "|"]
        for k in _keys([r], FP8_ORDER):
            v = vs[k]
            if not _ok(v):
                err = _error(v)
                L.append(f"| {label(k)} | {v.get('status')}{': ' + err if err else ''} |" + " |" * 5)
                continue
            L.append(f"| {label(k)} | {v['ms']:.3f} | {_f(v.get('p20'))}–{_f(v.get('p80'))} | {v['tflops']:.0f} | "
                     + " | ".join(_f(b["ms"] / v["ms"] if b else None) for b in (e, c, t)) + " |")
        L.append("")
    if not mlp and not dense and not gated and not stack:
        return L
    L += ["### FP8 detail: ratios, memory kept for backward, accuracy\n",
          "× FP8 floor, × bf16 floor = time / the floor's; vs eager, vs torchao = eager bf16's, torchao tensorwise's "
          "time / time (> 1: faster). saved = unique non-parameter storages saved for backward (not for compiled "
          "variants); peak Δ = max_memory_allocated over forward + backward − before. err = ‖v − ref‖/‖ref‖ against "
          "float32 eager, for out and dx. first = first call (compile / tuning), excluded from the timing.\n",
          "| shape | variant | ms | p20–p80 | TF/s | × FP8 floor | × bf16 floor | vs eager | vs torchao | saved MiB | "
          "peak Δ MiB | err out | err dx | first s |", "|---" * 14 + "|"]
    for r in mlp + dense + gated + stack:
        for k in _keys([r], FP8_ORDER):
            v, head = r["variants"][k], f"| {_fp8_kind(r)} {_fp8_shape(r)} | {label(k)} |"
            if not _ok(v):
                err = _error(v)
                L.append(f"{head} {v.get('status')}{': ' + err if err else ''} |" + " |" * 11)
                continue
            cells = _detail_cells(v, ["x_fp8_floor", "x_bf16_floor", "speedup_vs_eager", "speedup_vs_torchao"])
            L.append(f"{head} {cells} | {_f(v.get('first_call_s'), '{:.2f}')} |")
    L.append("")
    six = ["fwd1", "fwd2", "dgrad2", "wgrad2", "dgrad1", "wgrad1"]
    parts = _fp8_parts(mlp, six, "M × d") + _fp8_parts(dense, ["fwd", "dgrad", "wgrad"], "M × K → N")
    gated_parts = _fp8_parts(gated, six, "gated M × d → h")
    if parts or gated_parts:
        L += ["### The floors' GEMMs one by one (ms)\n",
              "MLP: fwd1 x@W1ᵀ, fwd2 h@W2ᵀ, dgrad2 dY@W2, wgrad2 dYᵀ@h, dgrad1 dH@W1, wgrad1 dHᵀ@x; Linear: fwd, "
              "dgrad, wgrad. FP8 GEMMs use_fast_accum: fwd yes, dgrad and wgrad no (as torchao)."
              + (" Gated: W1 = gate and up packed (width 2h), h = the gated product, dH [M, 2h]." if gated_parts
                 else "") + "\n"] + parts + gated_parts
    return L


def _has_fp8(res):
    return any(res.get(k) for k in FP8_SECTIONS)


def _header(res):
    env, m = res.get("env", {}), res.get("method", {})
    gpu = env.get("gpu") or f"CPU ({env.get('cpu_threads')} threads) — smoke test, not a performance figure"
    L = ["# fused_dense benchmark\n",
         f"{gpu}; driver {env.get('driver', '–')}; torch {env.get('torch')}; CUDA {env.get('torch_cuda')}; "
         f"cuBLASLt {env.get('cublasLt_version_str', '–')}; triton {env.get('triton', '–')}"
         + (f"; flash-attn {env['flash_attn']}" if env.get("flash_attn") else "")
         + (f"; torchao {env['torchao']}" if env.get("torchao") and _has_fp8(res) else "")
         + f"; {env.get('date_utc')}; fused_dense commit {str(env.get('git_commit') or 'unknown')[:12]}"
         + (" (dirty)" if env.get("git_dirty") else "")
         + (f"; source tree {env['git_tree'][:12]}" if env.get("git_tree") else "") + ".\n"]
    if env.get("clock_sm_mhz") is not None:
        L.append(f"At the start: SM clock {env['clock_sm_mhz']} MHz (max {env.get('clock_max_sm_mhz')}), memory "
                 f"{env.get('clock_mem_mhz')} MHz; power limit {_f(env.get('power_limit_w'), '{:.0f}')} W; "
                 f"{env.get('temp_c')} °C; {env.get('pstate')}.\n")
    elif env.get("nvml"):
        L.append(f"GPU clocks and power: {env['nvml']}.\n")
    if env.get("fused_dense_import_error"):
        L.append(f"**fused_dense not available:** {env['fused_dense_import_error']}\n")
    L.append("Method: " + "; ".join(filter(None, [
        m.get("timer"), m.get("timer") and f"warm-up ≥ {m.get('warmup_ms')} ms, ≥ {m.get('rep_ms')} ms and ≥ "
                                          f"{m.get('min_reps')} reps of measurement per figure",
        m.get("mlp_timer"), "fresh random data (normal), never zeros", res.get("mlp") and m.get("mlp"),
        res.get("mlp") and m.get("floor") and "floor = " + m["floor"],
        (res.get("gated") or res.get("gated_stack")) and m.get("gated"),
        _has_fp8(res) and m.get("fp8")])) + ". Full method: bench/README.md.\n")
    if m.get("budget_s") is not None:
        L.append(f"Time budget {m['budget_s']:.0f} s; run time {_f(res.get('elapsed_s'), '{:.0f}')} s.\n")
    c, ce = res.get("ceiling") or {}, res.get("ceiling_end") or {}
    if c.get("tflops"):
        L.append(f"**Ceiling:** {c['n']}³ {c['dtype']} torch.mm at the start {c['ms']:.3f} ms = **{c['tflops']:.0f} "
                 "TF/s**" + (f"; at the end {ce['ms']:.3f} ms = {ce['tflops']:.0f} TF/s" if ce.get("tflops") else "")
                 + ".\n")
    return L


def _mlp(res):
    mlp, L = res.get("mlp", []), []
    if not mlp:
        return L
    L += ["## MLP forward + backward: ms (TF/s)\n", "Linear(d, 4d) → act → Linear(4d, d), M tokens; "
          "TF/s = 12·M·d·h / time.\n"]
    for cfg in dict.fromkeys((r["dtype"], r["activation"]) for r in mlp):
        recs = [r for r in mlp if (r["dtype"], r["activation"]) == cfg]
        keys = _keys(recs)
        L += [f"### {cfg[0]}, {cfg[1]}\n", "| M × d | " + " | ".join(map(label, keys)) + " |",
              "|---" * (len(keys) + 1) + "|"]
        for r in recs:
            cells = [f"{v['ms']:.3f} ({v['tflops']:.0f})" if _ok(v) else _cell(v) for v in map(r["variants"].get, keys)]
            L.append(f"| {r['M']} × {r['d']} | " + " | ".join(cells) + " |")
        L.append("")
    L += _sustained(res)
    L += ["## MLP detail: ratios, memory kept for backward, accuracy\n",
          "× floor = time / six-GEMM time; vs eager = eager time / time; vs compile = compile time / time (> 1: "
          "faster). saved = unique non-parameter storages saved for backward (saved_tensors_hooks, x included); kept "
          "= memory_allocated after forward − before, output excluded; peak Δ = max_memory_allocated over forward + "
          "backward − before. err = ‖v − ref‖/‖ref‖ against float32, for out and dx. first = first call (compile / "
          "tuning), excluded from the timing.\n",
          "| dtype act | M × d | variant | ms | p20–p80 | TF/s | × floor | vs eager | vs compile | saved MiB | "
          "kept MiB | peak Δ MiB | err out | err dx | first s |", "|---" * 15 + "|"]
    for r in mlp:
        for k in _keys([r]):
            v, head = r["variants"][k], f"| {_cfg(r)} | {r['M']} × {r['d']} | {label(k)} |"
            if not _ok(v):
                err = str(v.get("error", ""))[:160].replace("|", "/")
                err = f": {err}" if err and v.get("status") in ("unavailable", "error") else ""
                L.append(f"{head} {v.get('status')}{err} |" + " |" * 11)
                continue
            mem, re = v.get("memory", {}), v.get("rel_err", {})

            def mib(key):
                return _f(mem.get(key) / MIB if mem.get(key) is not None else None, "{:.1f}")
            L.append(f"{head} {v['ms']:.3f} | {_f(v.get('p20'))}–{_f(v.get('p80'))} | {v['tflops']:.0f} | "
                     f"{_f(v.get('x_floor'))} | {_f(v.get('speedup_vs_eager'))} | {_f(v.get('speedup_vs_compile'))} | "
                     f"{mib('saved_bytes')} | {mib('alloc_kept_bytes')} | {mib('peak_delta_bytes')} | "
                     f"{_f(re.get('out'), '{:.1e}')} | {_f(re.get('dx'), '{:.1e}')} | "
                     f"{_f(v.get('first_call_s'), '{:.2f}')} |")
    L.append("")
    if any("allocator_calls" in v for r in mlp for v in r["variants"].values()):  # CUDA runs count them
        stalled = [f"{_cfg(r)} {r['M']} × {r['d']} {label(k)} ({v['allocator_calls']})"
                   for r in mlp for k, v in r["variants"].items() if _ok(v) and v.get("allocator_calls")]
        L.append("cudaMalloc / cudaFree calls of PyTorch's caching allocator during a figure's warm-up and timing "
                 "(each stalls the GPU until the host catches up, so such a figure includes the allocator): "
                 + ("; ".join(stalled) or "none") + ".\n")
    parts = [r for r in mlp if _ok(r["variants"].get("floor")) and r["variants"]["floor"].get("parts_ms")]
    if parts:
        names = ["fwd1", "fwd2", "dgrad2", "wgrad2", "dgrad1", "wgrad1"]
        L += ["### The six GEMMs one by one (ms)\n",
              "| dtype act | M × d | x@W1ᵀ | h@W2ᵀ | dY@W2 | dYᵀ@h | dH@W1 | dHᵀ@x | sum | six together |",
              "|---" * 10 + "|"]
        for r in parts:
            pm = r["variants"]["floor"]["parts_ms"]
            L.append(f"| {_cfg(r)} | {r['M']} × {r['d']} | " + " | ".join(f"{pm[n]:.3f}" for n in names)
                     + f" | {sum(pm.values()):.3f} | {r['variants']['floor']['ms']:.3f} |")
        L.append("")
    return L


def _ops_and_host(res):
    L, ops, host = [], res.get("ops", []), res.get("host")
    if ops:
        L += ["## Single ops against torch.mm: ms (× torch.mm)\n",
              "x[M,K] @ W[N,K]ᵀ, GELU (tanh). fwd: linear_act with bias, pre-activation saved. dgrad: act_linear_dgrad "
              "= (dY[M,N] @ W) ⊙ gelu'(pre[M,K]) with bias grad. wgrad: linear_bias_wgrad = dYᵀ @ x with bias grad. "
              "h = heuristic (auto: measured choice; -1: unfused; k ≥ 0: cuBLASLt heuristic entry k).\n"]
        for g in ("fwd", "dgrad", "wgrad"):
            keys = list(dict.fromkeys(k for r in ops for k in r[g]))
            L += [f"### {g} ({ops[0]['dtype']})\n", "| M, K, N | " + " | ".join(keys) + " |",
                  "|---" * (len(keys) + 1) + "|"]
            for r in ops:
                cells = [f"{v['ms']:.3f} (×{v.get('x_mm', float('nan')):.2f})" if _ok(v) else
                         _cell(v) + (f": {str(v['error'])[:80]}" if v and v.get("status") in ("unavailable", "error")
                                     else "") for v in map(r[g].get, keys)]
                L.append(f"| {r['M']}, {r['K']}, {r['N']} | " + " | ".join(c.replace("|", "/") for c in cells) + " |")
            L.append("")
    if host:
        L += [f"## Host CPU time per forward + backward (M={host['M']}, d={host['d']}, {host['dtype']})\n",
              host.get("method", "") + ".\n",
              "| variant | CPU µs / iter | × eager | issue wall µs / iter | wall incl. sync µs / iter |",
              "|---|---|---|---|---|"]
        for k, v in host["variants"].items():
            L.append(f"| {label(k)} | {v['cpu_us']:.1f} | {_f(v.get('x_eager'))} | {v['issue_wall_us']:.1f} | "
                     f"{v['wall_us']:.1f} |" if v.get("status") == "ok" else
                     f"| {label(k)} | {v.get('status')}: {str(v.get('error'))[:120]} | | | |")
        L.append("")
        inter = host.get("interleaved") or {}
        if inter.get("status") == "ok":
            L += [f"Interleaved: {inter['method']} ({inter['rounds']} rounds of {inter['iters']} steps).\n",
                  "| variant | CPU µs / iter (median of rounds) | × eager (median of per-round ratios) |",
                  "|---|---|---|"]
            L += [f"| {k} | {us:.1f} | {inter['x_eager'][k]:.3f} |" for k, us in inter["cpu_us"].items()]
            L.append("")
        elif inter:
            L.append(f"Interleaved comparison: {inter.get('status')}: {str(inter.get('error'))[:200]}\n")
    hl = res.get("host_layers")
    if hl and hl.get("layers"):
        L += [f"## Host CPU time per forward + backward of each layer (M={hl['M']}, {hl['dtype']})\n",
              f"{hl['method']}; {hl['rounds']} rounds of {hl['iters']} steps. Unfused: nn.Linear; the nn.Linear "
              "GELU MLP (hidden 4d); the LlamaMLP-shaped SwiGLU MLP (hidden 8/3·d rounded down to 64); "
              "three q / k / v nn.Linear (k, v d/4 wide) against one FusedQKV.\n",
              "| layer | d | unfused µs | fused µs | fused / unfused (rounds) | allocations a step unfused / fused |",
              "|---|---|---|---|---|---|"]
        for r in hl["layers"]:
            if "x_unfused" not in r:
                L.append(f"| {r.get('layer', '–')} | {r['d']} | {r.get('status')}: {str(r.get('error'))[:120]} | | | |")
                continue
            a = r.get("allocations") or {}
            lo, hi = r["x_unfused_range"]
            L.append(f"| {r['layer']} | {r['d']} | {r['cpu_us']['unfused']:.1f} | {r['cpu_us']['fused']:.1f} | "
                     f"{r['x_unfused']:.3f} ({lo:.3f}–{hi:.3f}) | {_f(a.get('unfused'), '{:.0f}')} / "
                     f"{_f(a.get('fused'), '{:.0f}')} |")
        L.append("")
    return L


def markdown(res):
    L = _header(res)
    trg = targets(res) + gated_targets(res) + fp8_targets(res)
    if trg:
        L += ["## Targets, from this run\n", "| target | figure | met |", "|---|---|---|"]
        L += [f"| {t} | {fig} | {'yes' if met else ('no' if met is False else '–')} |" for t, fig, met in trg]
        L.append("")
    L += _mlp(res) + _gated(res) + _fp8(res) + _ops_and_host(res)
    skipped, errors, crashed = res.get("skipped") or [], res.get("errors") or [], res.get("crashed") or []
    if skipped or errors or crashed or not res.get("complete"):
        L.append("## Not measured\n")
        L += ["- **the run did not finish**: these results are partial"] if not res.get("complete") else []
        L += [f"- skipped (time budget): {s}" for s in skipped]
        L += [f"- crashed the process (exit {c.get('rc')}): {c.get('item')} / {c.get('variant')}; the bench "
              "restarted and went on" for c in crashed]
        L += [f"- error: {e}" for e in errors]
        L.append("")
    return "\n".join(L) + "\n"


def summary(res):
    """A short plain-text table for the end of the console output."""
    def ms(v):
        return f"{v['ms']:.3f}" if _ok(v) else (v or {}).get("status", "-")[:7]

    def ratios(a):
        return "".join(f" {_f(a.get(k), '{:.3f}', '-'):>7}"
                       for k in ("x_floor", "speedup_vs_eager", "speedup_vs_compile"))
    L, c = ["", "=== summary ==="], res.get("ceiling") or {}
    if c.get("tflops"):
        L.append(f"ceiling {c['n']}^3 {c['dtype']}: {c['tflops']:.0f} TF/s")
    cols = ("floor", "eager", "compile", "auto_l0", "auto_l1", "auto_l2")
    L.append(f"{'cfg':<11}{'M x d':>12}" + "".join(f"{k:>9}" for k in cols) + f"{'best h':>9} {'xfloor':>7} "
             f"{'vs eag':>7} {'vs cmp':>7}")
    for r in res.get("mlp", []):
        vs = r["variants"]
        hs = [vs[k]["ms"] for k in ("h-1_l0", "h0_l0", "h1_l0", "h2_l0") if _ok(vs.get(k))]
        L.append(f"{_cfg(r):<11}{str(r['M']) + 'x' + str(r['d']):>12}" + "".join(f"{ms(vs.get(k)):>9}" for k in cols)
                 + f"{_f(min(hs) if hs else None, '{:.3f}', '-'):>9}" + ratios(vs.get("auto_l0") or {}))
    if res.get("sustained"):
        L.append(f"sustained (each block after {_warmup(res)} of its own steps):")
        for r in res["sustained"]:
            vs = r["variants"]
            a = vs["auto_l0"] if _ok(vs.get("auto_l0")) else {}
            L.append(f"{_cfg(r):<11}{str(r['M']) + 'x' + str(r['d']):>12}"
                     + "".join(f"{ms(vs.get(k)):>9}" for k in SUSTAINED_KEYS) + ratios(a)
                     + (f"  auto at {a['clocks'].get('sm_mhz', 0):.0f} MHz" if "clocks" in a else ""))
    for r in res.get("gated", []) + res.get("gated_stack", []) + [r for k in FP8_SECTIONS for r in res.get(k, [])]:
        L.append(f"{r['id']}: " + ", ".join(f"{k} {ms(v)}" for k, v in r["variants"].items()))
    L += ["targets:"] + [f"  [{'ok' if met else ('NO' if met is False else '--')}] {t}: {fig}"
                         for t, fig, met in targets(res) + gated_targets(res) + fp8_targets(res)]
    if res.get("skipped"):
        L.append(f"skipped (budget): {', '.join(res['skipped'])}")
    L += [f"CRASHED (exit {c.get('rc')}): {c.get('item')} / {c.get('variant')}" for c in res.get("crashed") or []]
    if not res.get("complete"):
        L.append("INCOMPLETE: the run did not finish")
    return "\n".join(L)


def _bars(ax, recs, keys, ticks, ylabel, title, ceiling=None):
    """One panel: a bar group per record (ticks: their labels), a bar per variant of keys measured
    in any of them, its TF/s."""
    keys = [k for k in keys if any(_ok(r["variants"].get(k)) for r in recs)]
    width = 0.8 / max(1, len(keys))
    for i, k in enumerate(keys):
        pts = [(j - 0.4 + width * (i + 0.5), r["variants"][k]["tflops"]) for j, r in enumerate(recs)
               if _ok(r["variants"].get(k))]
        bars = ax.bar([p[0] for p in pts], [p[1] for p in pts], width * 0.95, label=label(k), color=COLORS.get(k))
        if len(keys) * len(recs) <= 48:
            ax.bar_label(bars, fmt="%.0f", fontsize=6, padding=1, rotation=90)
    ax.set_xticks(range(len(recs)))
    ax.set_xticklabels(ticks)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    top = max([ceiling or 0] + [v["tflops"] for r in recs for v in r["variants"].values() if _ok(v)])
    ax.set_ylim(0, top * 1.18 or 1)
    ax.legend(fontsize=7, ncol=6, loc="lower center", bbox_to_anchor=(0.5, 1.07), frameon=False)
    ax.grid(axis="y", alpha=0.3)


def make_png(res, path):
    """TF/s per shape per variant, one panel per dtype × activation (the ceiling dashed) and two for
    the fp8 section (MLP and Linear; gated MLP and stack; a bar group per shape); raises ImportError
    without matplotlib."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mlp, env = res.get("mlp", []) + res.get("gated", []), res.get("env", {})
    configs = list(dict.fromkeys((r["dtype"], r["activation"]) for r in mlp))
    fp8 = res.get("fp8", []) + res.get("fp8_dense", [])
    fp8_gated = res.get("fp8_gated", []) + res.get("fp8_stack", [])
    panels = len(configs) + bool(fp8) + bool(fp8_gated)
    if not panels:
        raise ValueError("no MLP results to plot")
    ceiling = (res.get("ceiling") or {}).get("tflops")
    fig, axes = plt.subplots(panels, 1, figsize=(13, 3.6 * panels + 0.8), squeeze=False)
    for ax, cfg in zip(axes[:, 0], configs):
        recs = [r for r in mlp if (r["dtype"], r["activation"]) == cfg]
        if ceiling:
            ax.axhline(ceiling, color="k", ls="--", lw=0.8)
            ax.text(0.995, ceiling, f"ceiling: {res['ceiling']['n']}³ {res['ceiling'].get('dtype', '')} mm "
                    f"{ceiling:.0f} TF/s", transform=ax.get_yaxis_transform(), va="bottom", ha="right", fontsize=7)
        gated = cfg[1] in ("swiglu", "geglu")
        _bars(ax, recs, _keys(recs), [f"M={r['M']}, d={r['d']}" + (f", h={r['h']}" if gated else "") for r in recs],
              "TF/s (18·M·d·h / time)" if gated else "TF/s (12·M·d·h / time)",
              f"{'gated MLP' if gated else 'MLP'} forward + backward, {cfg[0]}, {cfg[1]}", ceiling)
    if fp8:
        _bars(axes[len(configs), 0], fp8, _keys(fp8, FP8_ORDER),
              [f"Linear M={r['M']}, {r['K']} → {r['N']}" if "K" in r else f"MLP M={r['M']}, d={r['d']}" for r in fp8],
              "TF/s (12·M·d·h or 6·M·K·N / time)",
              "FP8: MLP d → 4d → d (GELU) and one Linear, bf16 master weights, forward + backward")
    if fp8_gated:
        _bars(axes[-1, 0], fp8_gated, _keys(fp8_gated, FP8_ORDER),
              [f"stack B={r['batch']}, T={r['seq']}, d={r['d']}, h={r['h']}" if _fp8_kind(r) == "stack" else
               f"gated M={r['M']}, d={r['d']}, h={r['h']}" for r in fp8_gated],
              "TF/s (18·M·d·h; stack: projections)",
              "FP8: gated MLP (SwiGLU) and the Llama-style stack, bf16 master weights, forward + backward")
    fig.suptitle(f"fused_dense — {env.get('gpu') or 'CPU (smoke test)'}, torch {env.get('torch')}, CUDA "
                 f"{env.get('torch_cuda')}, cuBLASLt {env.get('cublasLt_version_str', '–')}, "
                 f"{str(env.get('date_utc', ''))[:10]}", fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.3 / fig.get_figheight()))  # room for the title
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def pyplot():
    """matplotlib.pyplot on the Agg backend, or None where matplotlib is not installed."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def save_figure(plt, fig, path, dpi=110):
    """Lays out, writes and closes a chart; returns its path."""
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return path


def ok_value(rec, name, key):
    """A standalone record's figure: rec['variants'][name][key] where that variant ran, else None."""
    v = rec["variants"].get(name, {})
    return v.get(key) if v.get("status") == "ok" else None


def verdict(num, den, limit, slack=0.0):
    """'met' where num <= limit * den + slack, 'not met' where not, 'n/a' where either is missing."""
    if num is None or den is None:
        return "n/a"
    return "met" if num <= limit * den + slack else "not met"


def ms_cell(v):
    """A variant's time as a table cell: median (p20–p80), or its status."""
    return f"{v['ms']:.3f} ({v['p20']:.3f}–{v['p80']:.3f})" if v.get("status") == "ok" else v.get("status", "–")


def environment_line(env):
    """What a standalone record ran on, for its markdown: GPU, driver, torch, CUDA, cuBLASLt,
    transformers, torchao and the commit."""
    return (f"{env.get('gpu', env.get('device'))}, driver {env.get('driver', '–')}, torch {env.get('torch')}, "
            f"CUDA {env.get('torch_cuda')}, cuBLASLt {env.get('cublasLt_version_str') or env.get('cublasLt_version')}, "
            f"transformers {env.get('transformers', '–')}, torchao {env.get('torchao', '–')}, commit "
            f"{str(env.get('git_commit'))[:12]}{' (dirty)' if env.get('git_dirty') else ''}")


def record_parser(description):
    """The command line of a standalone benchmark, with the options they share: --out, --report and
    --device."""
    import argparse
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", help="output directory (docs/results for the run of record)")
    p.add_argument("--report", metavar="FILE.json", help="rewrite the markdown and chart of a result")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    return p


def parse_record_args(p, argv):
    """A standalone benchmark's arguments (p from record_parser); --out required unless --report."""
    args = p.parse_args(argv)
    if not args.report and not args.out:
        p.error("--out is required")
    return args


def rewrote_record(args, markdown_of, png_of):
    """With --report: that record's markdown and chart rewritten from its JSON, and True."""
    if args.report:
        rewrite_dated_record(args.report, markdown_of, png_of)
    return bool(args.report)


def comma_list(p, option, value, known):
    """The names of a comma-list option, each one of known (else p.error naming the option)."""
    picked = value.split(",")
    unknown = [v for v in picked if v not in known]
    if unknown:
        p.error(f"{option}: unknown {', '.join(unknown)} (known: {', '.join(known)})")
    return picked


def checked_record_args(p, args):
    """The checks a standalone benchmark's arguments share, after its own: --rounds at least 1, and a
    CUDA device for --device cuda. Returns args."""
    import torch
    if args.rounds < 1:
        p.error(f"--rounds must be >= 1, got {args.rounds}")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device (--device cpu checks the script)")
    return args


def write_dated_record(out_dir, prefix, res, markdown_of, png_of):
    """A standalone benchmark's run: out_dir/<prefix>-<UTC date>.json, .md (markdown_of(res)) and
    .png (png_of(res, path), which returns None where it cannot draw), after removing the other
    <prefix>-<date> files there (a run of record replaces the last). Returns the paths written."""
    import datetime
    import re
    os.makedirs(out_dir, exist_ok=True)
    day = datetime.datetime.now(datetime.timezone.utc).date().isoformat()
    record = re.compile(rf"^{re.escape(prefix)}-\d{{4}}-\d{{2}}-\d{{2}}\.(json|md|png)$")
    for name in os.listdir(out_dir):
        if record.match(name) and not name.startswith(f"{prefix}-{day}."):
            os.remove(os.path.join(out_dir, name))
    base = os.path.join(out_dir, f"{prefix}-{day}")
    with open(base + ".json", "w") as f:
        json.dump(res, f, indent=1)
    return [base + ".json"] + rewrite_dated_record(base + ".json", markdown_of, png_of, res)


def rewrite_dated_record(json_path, markdown_of, png_of, res=None):
    """The markdown and chart of a standalone benchmark's JSON, beside it; returns the paths written."""
    if res is None:
        with open(json_path) as f:
            res = json.load(f)
    base = json_path[:-len(".json")]
    with open(base + ".md", "w") as f:
        f.write(markdown_of(res))
    return [base + ".md"] + ([base + ".png"] if png_of(res, base + ".png") else [])


def write(res, json_path, png=True):
    """The markdown (and the chart) beside json_path; returns the paths written."""
    stem = os.path.splitext(json_path)[0]
    with open(stem + ".md", "w") as f:
        f.write(markdown(res))
    written = [stem + ".md"]
    if png:
        try:
            written.append(make_png(res, stem + ".png"))
        except ImportError as exc:
            print(f"WARNING: no chart ({exc}); install matplotlib and run: python bench/report.py {json_path}")
    return written


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("json")
    ap.add_argument("--no-png", action="store_true", help="markdown only")
    a = ap.parse_args(argv)
    with open(a.json) as f:
        res = json.load(f)
    paths = write(res, a.json, png=not a.no_png)
    print(summary(res))
    print("wrote " + ", ".join(paths))
    return 0


if __name__ == "__main__":
    sys.exit(main())
