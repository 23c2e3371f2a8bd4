#!/usr/bin/env python
"""Markdown report and console summary from bench.json (no torch needed).

    python bench/report.py DIR/bench.json [-o DIR/bench.md]
"""
import argparse
import json
import os
import sys

MIB = 1024 * 1024

LABELS = {
    "floor": "six GEMMs (floor)",
    "eager": "eager PyTorch",
    "compile": "torch.compile",
    "auto_l0": "FusedMLP auto",
    "auto_l1": "FusedMLP auto, ckpt 1",
    "auto_l2": "FusedMLP auto, ckpt 2",
    "h-1_l0": "FusedMLP h=-1 (unfused)",
    "h0_l0": "FusedMLP h=0",
    "h1_l0": "FusedMLP h=1",
    "h2_l0": "FusedMLP h=2",
    "auto_l0_again": "FusedMLP auto, again (last)",
}
ORDER = list(LABELS)
TOLERANCE = {"bf16": 1e-2, "fp16": 2e-3, "fp32": 1e-4}  # DESIGN.md: relative error against the reference
ACT_SHORT = {"gelu_approx": "gelu", "relu": "relu", "sqrelu": "sqrelu"}


def label(key):
    return LABELS.get(key, key)


def _f(x, fmt="{:.3f}", none="–"):
    return none if x is None else fmt.format(x)


def _ok(v):
    return isinstance(v, dict) and v.get("status") == "ok" and v.get("ms") is not None


def _configs(res):
    """[(dtype, act)] in first-seen order."""
    seen = []
    for r in res.get("mlp", []):
        c = (r["dtype"], r["activation"])
        if c not in seen:
            seen.append(c)
    return seen


def _variant_keys(records):
    keys = []
    for r in records:
        for k in r["variants"]:
            if k not in keys:
                keys.append(k)
    return sorted(keys, key=lambda k: ORDER.index(k) if k in ORDER else 99)


def _status_cell(v):
    if v is None:
        return "–"
    st = v.get("status", "?")
    return st if st != "ok" else "?"


def _same_shape(records, r):
    """The record of records with r's dtype, activation and shape, or None."""
    for o in records or []:
        if (o["dtype"], o["activation"], o["M"], o["d"]) == (r["dtype"], r["activation"], r["M"], r["d"]):
            return o
    return None


def _sustained_warmup_label(res):
    """'1000 ms': the sustained section's warm-up per block, as this run recorded it."""
    w = (res.get("method") or {}).get("sustained_warmup_ms")
    return "a long warm-up" if w is None else f"{w:.0f} ms"


# ----------------------------------------------------------------------------------------------
# targets of issue 5


def round_range(num, den):
    """' (rounds a–b)': the least and greatest of num / den per interleaved round, each a ratio of two
    blocks timed close together, so a verdict on the medians can be read against the run's own
    spread; '' when either lacks per-round figures (older runs, sequential timing)."""
    a, b = (num or {}).get("round_ms"), (den or {}).get("round_ms")
    if not a or not b or len(a) != len(b):
        return ""
    q = [x / y for x, y in zip(a, b) if y]
    return f" (rounds {min(q):.3f}–{max(q):.3f})" if q else ""


def targets(res):
    """[(target, figure, met: True/False/None)] computed from the run."""
    rows = []
    mlp = res.get("mlp", [])

    def get(dtype, act, d, key):
        for r in mlp:
            if r["dtype"] == dtype and r["activation"] == act and r["d"] == d:
                v = r["variants"].get(key)
                return v if _ok(v) else None
        return None

    for r in mlp:
        if (r["dtype"], r["activation"]) != ("bf16", "gelu_approx"):
            continue
        a, d, M = r["variants"].get("auto_l0"), r["d"], r["M"]
        shape = f"{M}×{d}"
        if not _ok(a):
            rows.append((f"bf16 gelu {shape}: FusedMLP auto measured", _status_cell(a), False))
            continue
        lim = 1.11 if d <= 1024 else 1.03
        xf = a.get("x_floor")
        e = r["variants"].get("eager")
        ef = e.get("x_floor") if _ok(e) else None
        floor = r["variants"].get("floor")
        # the sustained section's figure for the same shape, beside the standard one, which stays the
        # verdict's figure (the run of record)
        sv = (_same_shape(res.get("sustained"), r) or {}).get("variants", {})
        s_auto, s_eager, s_floor = (sv.get(k) if _ok(sv.get(k)) else None for k in ("auto_l0", "eager", "floor"))
        sus_floor = sus_eager = ""
        if s_auto is not None:
            if s_auto.get("x_floor") is not None:
                s_ef = s_eager.get("x_floor") if s_eager else None
                sus_floor = (f"; sustained {s_auto['x_floor']:.3f}{round_range(s_auto, s_floor)} "
                             f"(eager {_f(s_ef, '{:.3f}')})")
            if s_auto.get("speedup_vs_eager") is not None:
                sus_eager = f"; sustained {s_auto['speedup_vs_eager']:.3f}{round_range(s_eager, s_auto)}"
        rows.append((f"bf16 gelu {shape}: auto / six GEMMs ≤ {lim:.2f}",
                     f"{_f(xf, '{:.3f}')}{round_range(a, floor)} (eager {_f(ef, '{:.3f}')}){sus_floor}",
                     None if xf is None else xf <= lim))
        need = {1024: 1.20, 2048: 1.08}.get(d)
        se = a.get("speedup_vs_eager")
        if need:
            rows.append((f"bf16 gelu {shape}: eager / auto ≥ {need:.2f}",
                         _f(se, "{:.3f}") + round_range(e, a) + sus_eager,
                         None if se is None else se >= need))
        for lvl, lim2 in ((1, 1.05), (2, 1.25)):
            v = r["variants"].get(f"auto_l{lvl}")
            if _ok(v):
                q = v["ms"] / a["ms"]
                rows.append((f"bf16 gelu {shape}: ckpt {lvl} / ckpt 0 ≤ {lim2:.2f}", f"{q:.3f}{round_range(v, a)}",
                             q <= lim2))
            elif v is not None:
                rows.append((f"bf16 gelu {shape}: ckpt {lvl} / ckpt 0 ≤ {lim2:.2f}", _status_cell(v), False))
    # not slower than eager / compile anywhere
    for r in mlp:
        a = r["variants"].get("auto_l0")
        if not _ok(a):
            continue
        tag = f"{r['dtype']} {ACT_SHORT.get(r['activation'], r['activation'])} {r['M']}×{r['d']}"
        for base, k in (("eager", "speedup_vs_eager"), ("compile", "speedup_vs_compile")):
            s = a.get(k)
            if s is not None:
                rows.append((f"{tag}: auto not slower than {base} ({base} / auto ≥ 1)",
                             f"{s:.3f}{round_range(r['variants'].get(base), a)}", s >= 1.0))
    # ReLU keeps a 1-bit mask: saved bytes at level 0 vs x + act_out + mask(1 bit)
    for r in mlp:
        if r["activation"] != "relu":
            continue
        for key in ("auto_l0", "auto_l1"):
            a = r["variants"].get(key)
            if not _ok(a) or "memory" not in a:
                continue
            es = 2  # fp16 / bf16 bytes
            M, d, h = r["M"], r["d"], r["h"]
            lvl = int(key[-1])
            expect = M * d * es + M * h // 8 + (M * h * es if lvl == 0 else 0)
            saved = a["memory"]["saved_bytes"]
            rows.append((f"{r['dtype']} relu {M}×{d} {label(key)}: saved ≤ x{' + act_out' if lvl == 0 else ''} + "
                         f"1-bit mask = {expect / MIB:.1f} MiB", f"{saved / MIB:.1f} MiB", saved <= expect * 1.01))
    # accuracy against the float32 reference, DESIGN.md tolerances
    bad, n = [], 0
    for r in mlp:
        tol = TOLERANCE.get(r["dtype"])
        for k, v in r["variants"].items():
            if not _ok(v) or not v.get("rel_err") or tol is None:
                continue
            n += 1
            worst = max(v["rel_err"].values())
            if not worst <= tol:  # NaN fails too
                bad.append(f"{r['dtype']} {ACT_SHORT.get(r['activation'])} {r['M']}×{r['d']} {label(k)}: {worst:.1e}")
    if n:
        rows.append((f"every measured variant within the accuracy tolerance (bf16 {TOLERANCE['bf16']:g}, fp16 "
                     f"{TOLERANCE['fp16']:g}; worst of out, dx, dW1, dW2 vs float32)",
                     f"{n - len(bad)} of {n}" + (": fails " + "; ".join(bad) if bad else ""), not bad))
    host = res.get("host") or {}
    hv = host.get("variants", {})
    inter = host.get("interleaved") or {}
    if inter.get("status") == "ok":
        q = inter["x_eager"]["auto_l0"]
        rows.append((f"host CPU time M={host['M']} d={host['d']}: auto / eager ≤ 1 (interleaved rounds, median ratio)",
                     f"{inter['cpu_us']['auto_l0']:.0f} / {inter['cpu_us']['eager']:.0f} µs, ratio {q:.3f}", q <= 1.0))
    elif hv.get("eager", {}).get("cpu_us") and hv.get("auto_l0", {}).get("cpu_us"):
        q = hv["auto_l0"]["cpu_us"] / hv["eager"]["cpu_us"]
        rows.append((f"host CPU time M={host['M']} d={host['d']}: auto / eager ≤ 1",
                     f"{hv['auto_l0']['cpu_us']:.0f} / {hv['eager']['cpu_us']:.0f} µs = {q:.3f}", q <= 1.0))
    elif hv:
        rows.append(("host CPU time: auto / eager ≤ 1", _status_cell(hv.get("auto_l0")), None))
    return rows


# ----------------------------------------------------------------------------------------------
# markdown


SUSTAINED_KEYS = ("floor", "eager", "compile", "auto_l0")


def sustained_table(res):
    """Markdown lines of the sustained section's table (none when the run has no such records)."""
    recs = res.get("sustained") or []
    if not recs:
        return []
    L = [f"## Sustained load (each block after {_sustained_warmup_label(res)} of its own steps)\n"]
    method = (res.get("method") or {}).get("sustained")
    configs = ", ".join(dict.fromkeys(f"{r['dtype']} {r['activation']}" for r in recs))
    L.append((method[:1].upper() + method[1:] + ". " if method else f"{configs}. ")
             + "ms, lower is better; ÷: ratio of the two medians; 'standard' is auto ÷ floor in the MLP table "
             "above (the usual warm-up per block), the run of record.\n")
    clocks = any("clocks" in v for r in recs for v in r["variants"].values())
    head = ["M × d"] + [f"{label(k)} ms" for k in SUSTAINED_KEYS] + [
        "eager ÷ auto", "compile ÷ auto", "auto ÷ floor", "auto ÷ floor, standard"]
    if clocks:
        head += ["SM MHz floor / eager / compile / auto", "W floor / eager / compile / auto"]
    L.append("| " + " | ".join(head) + " |")
    L.append("|---" * len(head) + "|")
    for r in recs:
        vs = r["variants"]
        cells = [f"{r['M']} × {r['d']}"]
        cells += [f"{vs[k]['ms']:.3f}" if _ok(vs.get(k)) else _status_cell(vs.get(k)) for k in SUSTAINED_KEYS]
        a = vs.get("auto_l0") if _ok(vs.get("auto_l0")) else {}
        std = ((_same_shape(res.get("mlp"), r) or {}).get("variants") or {}).get("auto_l0")
        cells += [_f(a.get("speedup_vs_eager")), _f(a.get("speedup_vs_compile")), _f(a.get("x_floor")),
                  _f(std.get("x_floor") if _ok(std) else None)]
        if clocks:
            for field in ("sm_mhz", "power_w"):
                cells.append(" / ".join(_f((vs.get(k) or {}).get("clocks", {}).get(field), "{:.0f}")
                                        for k in SUSTAINED_KEYS))
        L.append("| " + " | ".join(cells) + " |")
    L.append("")
    if clocks:
        L.append("SM clock and power: medians of the nvidia-smi samples (every "
                 f"{next((r['clock_sampling'].get('interval_ms') for r in recs if r.get('clock_sampling')), '–')} ms) "
                 "taken inside each variant's timed blocks and the end of their warm-ups (at most 300 ms); samples per variant: "
                 + "; ".join(f"{r['M']} × {r['d']} " + " / ".join(
                     str((r["variants"].get(k) or {}).get("clocks", {}).get("samples", 0)) for k in SUSTAINED_KEYS)
                     for r in recs) + ".\n")
    return L


def markdown(res):
    env = res.get("env", {})
    L = []
    L.append("# fused_dense benchmark\n")
    gpu = env.get("gpu") or f"CPU ({env.get('cpu_threads')} threads) — smoke test, not a performance figure"
    L.append(f"{gpu}; driver {env.get('driver', '–')}; torch {env.get('torch')}; CUDA {env.get('torch_cuda')}; "
             f"cuBLASLt {env.get('cublasLt_version_str', '–')}; triton {env.get('triton', '–')}; "
             f"{env.get('date_utc')}; fused_dense commit {str(env.get('git_commit') or 'unknown')[:12]}"
             f"{' (dirty)' if env.get('git_dirty') else ''}"
             f"{'; source tree ' + env['git_tree'][:12] if env.get('git_tree') else ''}.\n")
    if env.get("clock_sm_mhz"):
        L.append(f"Clocks at start: SM {env.get('clock_sm_mhz')} (max {env.get('clock_max_sm_mhz')}), "
                 f"memory {env.get('clock_mem_mhz')}; power limit {env.get('power_limit')}; "
                 f"{env.get('temp_c')} °C; {env.get('pstate')}.\n")
    if env.get("fused_dense_import_error"):
        L.append(f"**fused_dense not fully available:** {env['fused_dense_import_error']}\n")
    m = res.get("method", {})
    L.append("Method: " + "; ".join(filter(None, [
        m.get("timer"), f"warm-up ≥ {m.get('warmup_ms')} ms, ≥ {m.get('rep_ms')} ms and ≥ {m.get('min_reps')} reps "
        "of measurement per figure" if m.get("timer") else None,
        m.get("mlp_timer"), "fresh random data (normal), never zeros", m.get("mlp"), "floor = " + m.get("floor", ""),
    ])) + ". Full method: bench/README.md.\n")
    if res.get("elapsed_s") is not None:
        L.append(f"Run time {res['elapsed_s']:.0f} s.\n")

    c = res.get("ceiling")
    if c and c.get("tflops"):
        ce = res.get("ceiling_end") or {}
        end = (f"; at the end of the run {ce['ms']:.3f} ms = {ce['tflops']:.0f} TF/s" if ce.get("tflops") else "")
        L.append(f"**Ceiling:** {c['n']}³ {c['dtype']} torch.mm at the start {c['ms']:.3f} ms = "
                 f"**{c['tflops']:.0f} TF/s**{end}.\n")

    trg = targets(res)
    if trg:
        L.append("## Targets (issue 5), from this run\n")
        L.append("| target | figure | met |\n|---|---|---|")
        for t, fig, met in trg:
            L.append(f"| {t} | {fig} | {'yes' if met else ('no' if met is False else '–')} |")
        L.append("")

    mlp = res.get("mlp", [])
    if mlp:
        L.append("## MLP forward + backward: ms (TF/s)\n")
        L.append("Linear(d, 4d) → act → Linear(4d, d), M tokens; TF/s = 12·M·d·h / time.\n")
        for dtype, act in _configs(res):
            recs = [r for r in mlp if r["dtype"] == dtype and r["activation"] == act]
            keys = _variant_keys(recs)
            L.append(f"### {dtype}, {act}\n")
            L.append("| M × d | " + " | ".join(label(k) for k in keys) + " |")
            L.append("|---" * (len(keys) + 1) + "|")
            for r in recs:
                cells = []
                for k in keys:
                    v = r["variants"].get(k)
                    cells.append(f"{v['ms']:.3f} ({v['tflops']:.0f})" if _ok(v) else _status_cell(v))
                L.append(f"| {r['M']} × {r['d']} | " + " | ".join(cells) + " |")
            L.append("")
    L += sustained_table(res)
    if mlp:
        L.append("## MLP detail: ratios, memory kept for backward, accuracy\n")
        L.append("× floor = time / six-GEMM time; vs eager = eager time / time; vs compile = compile time / time "
                 "(> 1: faster). saved = unique non-parameter storages saved for backward (saved_tensors_hooks, "
                 "x included); kept = memory_allocated after forward − before, output excluded; peak Δ = "
                 "max_memory_allocated over forward + backward − before. err = ‖v − ref‖/‖ref‖ against float32, "
                 "for out and dx. first = first call (compile / tuning), excluded from the timing.\n")
        L.append("| dtype act | M × d | variant | ms | p20–p80 | TF/s | × floor | vs eager | vs compile | "
                 "saved MiB | kept MiB | peak Δ MiB | err out | err dx | first s |")
        L.append("|---" * 15 + "|")
        for r in mlp:
            for k in _variant_keys([r]):
                v = r["variants"][k]
                head = f"| {r['dtype']} {ACT_SHORT.get(r['activation'], r['activation'])} | {r['M']} × {r['d']} | {label(k)} |"
                if not _ok(v):
                    err = str(v.get("error", ""))[:160].replace("|", "/")
                    st = v.get("status")
                    L.append(f"{head} {st}{': ' + err if st in ('unavailable', 'error') and err else ''} |" + " |" * 11)
                    continue
                mem = v.get("memory", {})
                re = v.get("rel_err", {})
                p = f"{_f(v.get('p20'))}–{_f(v.get('p80'))}" if v.get("p20") is not None else "–"
                L.append(f"{head} {v['ms']:.3f} | {p} | {v['tflops']:.0f} | {_f(v.get('x_floor'))} | "
                         f"{_f(v.get('speedup_vs_eager'))} | {_f(v.get('speedup_vs_compile'))} | "
                         f"{_f(mem.get('saved_bytes') and mem['saved_bytes'] / MIB, '{:.1f}')} | "
                         f"{_f(mem.get('alloc_kept_bytes') and mem['alloc_kept_bytes'] / MIB, '{:.1f}')} | "
                         f"{_f(mem.get('peak_delta_bytes') and mem['peak_delta_bytes'] / MIB, '{:.1f}')} | "
                         f"{_f(re.get('out'), '{:.1e}')} | {_f(re.get('dx'), '{:.1e}')} | "
                         f"{_f(v.get('first_call_s'), '{:.2f}')} |")
        L.append("")
        stalled = [f"{r['dtype']} {ACT_SHORT.get(r['activation'], r['activation'])} {r['M']} × {r['d']} "
                   f"{label(k)} ({v['allocator_calls']})"
                   for r in mlp for k, v in r["variants"].items() if _ok(v) and v.get("allocator_calls")]
        if any("allocator_calls" in v for r in mlp for v in r["variants"].values()):  # CUDA runs count them
            L.append("cudaMalloc / cudaFree calls of PyTorch's caching allocator during a figure's warm-up and "
                     "timing (each stalls the GPU until the host catches up, so such a figure includes the "
                     "allocator): " + ("; ".join(stalled) if stalled else "none") + ".\n")
        parts = [(r, r["variants"]["floor"].get("parts_ms")) for r in mlp
                 if _ok(r["variants"].get("floor")) and r["variants"]["floor"].get("parts_ms")]
        if parts:
            L.append("### The six GEMMs one by one (ms)\n")
            names = ["fwd1", "fwd2", "dgrad2", "wgrad2", "dgrad1", "wgrad1"]
            L.append("| dtype act | M × d | x@W1ᵀ | h@W2ᵀ | dY@W2 | dYᵀ@h | dH@W1 | dHᵀ@x | sum | six together |")
            L.append("|---" * 10 + "|")
            for r, pm in parts:
                L.append(f"| {r['dtype']} {ACT_SHORT.get(r['activation'])} | {r['M']} × {r['d']} | "
                         + " | ".join(f"{pm[n]:.3f}" for n in names)
                         + f" | {sum(pm.values()):.3f} | {r['variants']['floor']['ms']:.3f} |")
            L.append("")

    ops = res.get("ops", [])
    if ops:
        L.append("## Single ops against torch.mm: ms (× torch.mm)\n")
        L.append("x[M,K] @ W[N,K]ᵀ, GELU (tanh). fwd: linear_act with bias, pre-activation saved. dgrad: "
                 "act_linear_dgrad = (dY[M,N] @ W) ⊙ gelu'(pre[M,K]) with bias grad. wgrad: linear_bias_wgrad "
                 "= dYᵀ @ x with bias grad. h = heuristic (auto: measured choice; -1: unfused; k ≥ 0: cuBLASLt "
                 "heuristic entry k).\n")
        for g in ("fwd", "dgrad", "wgrad"):
            keys = []
            for r in ops:
                for k in r[g]:
                    if k not in keys:
                        keys.append(k)
            L.append(f"### {g} ({ops[0]['dtype']})\n")
            L.append("| M, K, N | " + " | ".join(keys) + " |")
            L.append("|---" * (len(keys) + 1) + "|")
            for r in ops:
                cells = []
                for k in keys:
                    v = r[g].get(k)
                    if _ok(v):
                        cells.append(f"{v['ms']:.3f} (×{v.get('x_mm', float('nan')):.2f})")
                    else:
                        detail = v and v.get("status") in ("unavailable", "error") and v.get("error")
                        cells.append(_status_cell(v) + (f": {str(v['error'])[:80]}" if detail else ""))
                L.append(f"| {r['M']}, {r['K']}, {r['N']} | " + " | ".join(c.replace("|", "/") for c in cells) + " |")
            L.append("")

    host = res.get("host")
    if host:
        L.append(f"## Host CPU time per forward + backward (M={host['M']}, d={host['d']}, {host['dtype']})\n")
        L.append(host.get("method", "") + ".\n")
        L.append("| variant | CPU µs / iter | × eager | issue wall µs / iter | wall incl. sync µs / iter |")
        L.append("|---|---|---|---|---|")
        for k, v in host["variants"].items():
            if v.get("status") != "ok":
                L.append(f"| {label(k)} | {v.get('status')}: {str(v.get('error'))[:120]} | | | |")
                continue
            L.append(f"| {label(k)} | {v['cpu_us']:.1f} | {_f(v.get('x_eager'))} | {v['issue_wall_us']:.1f} | "
                     f"{v['wall_us']:.1f} |")
        L.append("")
        inter = host.get("interleaved") or {}
        if inter.get("status") == "ok":
            L.append(f"Interleaved: {inter['method']} ({inter['rounds']} rounds of {inter['iters']} steps).\n")
            L.append("| variant | CPU µs / iter (median of rounds) | × eager (median of per-round ratios) |")
            L.append("|---|---|---|")
            for k, us in inter["cpu_us"].items():
                L.append(f"| {k} | {us:.1f} | {inter['x_eager'][k]:.3f} |")
            L.append("")
        elif inter:
            L.append(f"Interleaved comparison: {inter.get('status')}: {str(inter.get('error'))[:200]}\n")

    skipped = res.get("skipped") or []
    errors = res.get("errors") or []
    crashed = res.get("crashed") or []
    if skipped or errors or crashed or not res.get("complete"):
        L.append("## Not measured\n")
        if not res.get("complete"):
            L.append("- **the run did not finish**: these results are partial")
        for s in skipped:
            L.append(f"- skipped (time budget): {s}")
        for c in crashed:
            L.append(f"- crashed the process (exit {c.get('rc')}): {c.get('item')} / {c.get('variant')}; the bench "
                     "restarted and went on")
        for e in errors:
            L.append(f"- error: {e}")
        L.append("")
    return "\n".join(L) + "\n"


def _ms_cell(v):
    """A figure's ms for the console table, or its status cut to the column."""
    return f"{v['ms']:.3f}" if _ok(v) else (v or {}).get("status", "-")[:7]


def summary(res):
    """A short plain-text table for the end of the console output."""
    L = ["", "=== summary ==="]
    c = res.get("ceiling")
    if c and c.get("tflops"):
        ce = res.get("ceiling_end") or {}
        L.append(f"ceiling {c['n']}^3 {c['dtype']}: {c['tflops']:.0f} TF/s"
                 + (f" (at the end: {ce['tflops']:.0f})" if ce.get("tflops") else ""))
    L.append(f"{'cfg':<11}{'M x d':>12}{'floor':>9}{'eager':>9}{'compile':>9}{'auto':>9}{'auto L1':>9}"
             f"{'auto L2':>9}{'best h':>9} {'xfloor':>8} {'vs eag':>7} {'vs cmp':>7}")
    for r in res.get("mlp", []):
        vs = r["variants"]

        def ms(k):
            return _ms_cell(vs.get(k))
        hs = [(vs[k]["ms"], k) for k in ("h-1_l0", "h0_l0", "h1_l0", "h2_l0") if _ok(vs.get(k))]
        best = f"{min(hs)[0]:.3f}" if hs else "-"
        a = vs.get("auto_l0", {})
        L.append(f"{r['dtype'] + ' ' + ACT_SHORT.get(r['activation'], r['activation']):<11}"
                 f"{str(r['M']) + 'x' + str(r['d']):>12}{ms('floor'):>9}{ms('eager'):>9}{ms('compile'):>9}"
                 f"{ms('auto_l0'):>9}{ms('auto_l1'):>9}{ms('auto_l2'):>9}{best:>9}"
                 f" {_f(a.get('x_floor'), '{:.3f}', '-'):>8} {_f(a.get('speedup_vs_eager'), '{:.3f}', '-'):>7}"
                 f" {_f(a.get('speedup_vs_compile'), '{:.3f}', '-'):>7}")
    sus = res.get("sustained") or []
    if sus:
        L.append(f"sustained (each block after {_sustained_warmup_label(res)} of its own steps):")
        L.append(f"{'cfg':<11}{'M x d':>12}{'floor':>9}{'eager':>9}{'compile':>9}{'auto':>9}"
                 f" {'xfloor':>8} {'vs eag':>7} {'vs cmp':>7} {'SM MHz auto':>12} {'W auto':>7}")
        for r in sus:
            vs = r["variants"]
            a = vs.get("auto_l0") if _ok(vs.get("auto_l0")) else {}
            c = a.get("clocks", {})
            L.append(f"{r['dtype'] + ' ' + ACT_SHORT.get(r['activation'], r['activation']):<11}"
                     f"{str(r['M']) + 'x' + str(r['d']):>12}" + "".join(f"{_ms_cell(vs.get(k)):>9}" for k in SUSTAINED_KEYS)
                     + f" {_f(a.get('x_floor'), '{:.3f}', '-'):>8} {_f(a.get('speedup_vs_eager'), '{:.3f}', '-'):>7}"
                     f" {_f(a.get('speedup_vs_compile'), '{:.3f}', '-'):>7} {_f(c.get('sm_mhz'), '{:.0f}', '-'):>12}"
                     f" {_f(c.get('power_w'), '{:.0f}', '-'):>7}")
    trg = targets(res)
    if trg:
        L.append("targets:")
        for t, fig, met in trg:
            L.append(f"  [{'ok' if met else ('NO' if met is False else '--')}] {t}: {fig}")
    host = res.get("host") or {}
    for k, v in (host.get("variants") or {}).items():
        if v.get("status") == "ok":
            L.append(f"host {k}: {v['cpu_us']:.1f} us cpu / iter")
    if res.get("skipped"):
        L.append(f"skipped (budget): {len(res['skipped'])} items: {', '.join(res['skipped'])}")
    for c in res.get("crashed") or []:
        L.append(f"CRASHED (exit {c.get('rc')}): {c.get('item')} / {c.get('variant')}")
    if not res.get("complete"):
        L.append("INCOMPLETE: the run did not finish")
    return "\n".join(L)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("json")
    ap.add_argument("-o", "--out", help="markdown path (default: bench.md beside the JSON)")
    a = ap.parse_args(argv)
    with open(a.json) as f:
        res = json.load(f)
    out = a.out or os.path.join(os.path.dirname(os.path.abspath(a.json)), "bench.md")
    with open(out, "w") as f:
        f.write(markdown(res))
    print(summary(res))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
