#!/usr/bin/env python
"""The LM head benchmark: the LM head and its cross-entropy fused (issue #42) against Hugging Face's
and Liger's.

    python -m bench.lm_head --out docs/results              # the run of record (H200)
    python -m bench.lm_head --out DIR --device cpu --quick  # a functional check of the script

Shapes: hidden d 4096 -> vocab 32000 and 128256, at 8192 and 16384 tokens, bf16 hidden states and
weight, no bias; targets uniform over the vocabulary with 5% set to ignore_index (-100), loss the
mean over the counted tokens. Variants, each timed as forward + backward of the loss (the hidden
states' and the weight's gradients):
  hf_eager    the LM head (F.linear) then F.cross_entropy on the logits upcast to float32, as
              transformers' ForCausalLMLoss computes it
  hf_compile  the same function under torch.compile (on the GPU only)
  liger       liger_kernel's LigerFusedLinearCrossEntropyLoss, where liger_kernel imports (else
              recorded unavailable)
  fused       fused_dense.loss.linear_cross_entropy
  fused_fp8   the same with fp8=True (the logits' and the input gradient's GEMMs in FP8; off by
              default in the library, measured beside; the targets are the default's)

Reported per shape and variant: ms (median over --rounds interleaved rounds of bench.timing's
Bench, every round's block after its own warm-up), peak memory over what was allocated before the
step (each variant alone: torch.cuda.reset_peak_memory_stats, max_memory_allocated minus
memory_allocated before; the gradients the step allocates are counted). Accuracy, per shape: every
variant's loss, hidden-state gradient and weight gradient on the timed problem against a float64
reference computed on the same device from the same bf16 inputs, as the relative error
||out - ref|| / ||ref||. The reference goes REFERENCE_ROWS tokens at a time (the whole problem's
float64 logits would be 17 GB at 16384 x 128256): each block's float64 logits, their
log-sum-exps and the gradient of the mean loss, accumulated into the float64 gradients.

Targets (#42, the H200), per shape: fused time <= hf_compile's and <= 0.95x liger's; fused peak
<= 1.15x liger's; each of the fused variant's three errors <= hf_eager's, plus the distance float32
rounding alone puts between two results of the same loss ((1 + log2 tokens) * 2^-24: error_slack)
(a target whose comparator is unavailable is "n/a").
Writes DIR/lm_head-<YYYY-MM-DD>.json, .md and .png and removes the other lm_head-<date> files there.
"""
import math
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from bench import report  # noqa: E402
from bench.timing import MIB, Bench, step_memory  # noqa: E402

D, VOCABS, TOKENS = 4096, (32000, 128256), (8192, 16384)
CPU_D, CPU_VOCABS, CPU_TOKENS = 64, (512, 1000), (128, 256)
VARIANTS = ("hf_eager", "hf_compile", "liger", "fused", "fused_fp8")
IGNORE_INDEX, IGNORED_SHARE = -100, 0.05
REFERENCE_ROWS = 1024
TARGETS = {"time_vs_hf_compile": 1.0, "time_vs_liger": 0.95, "peak_vs_liger": 1.15, "error_vs_hf_eager": 1.0}


def log(msg):
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


class Unavailable(Exception):
    pass


def hf_loss(x, weight, target):
    """transformers' causal-LM loss on the LM head's logits (the targets already shifted)."""
    logits = F.linear(x, weight).float()
    return F.cross_entropy(logits, target, ignore_index=IGNORE_INDEX)


def make_variant(name, device):
    """loss_fn(x, weight, target) of a variant; Unavailable when it cannot run here."""
    if name == "hf_eager":
        return hf_loss
    if name == "hf_compile":
        if device.type != "cuda":
            raise Unavailable("torch.compile is timed on the GPU only")
        return torch.compile(hf_loss)
    if name == "liger":
        try:
            from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
        except ImportError as exc:
            raise Unavailable(f"liger_kernel not importable: {exc}") from exc
        if device.type != "cuda":
            raise Unavailable("liger_kernel runs on the GPU only")
        liger = LigerFusedLinearCrossEntropyLoss(ignore_index=IGNORE_INDEX)

        def liger_loss(x, weight, target):
            out = liger(weight, x, target)
            return out[0] if isinstance(out, tuple) else out
        return liger_loss
    if name in ("fused", "fused_fp8"):
        try:
            from fused_dense.loss import linear_cross_entropy
        except Exception as exc:  # noqa: BLE001 - a build without the op is recorded, not fatal
            raise Unavailable(f"fused_dense.loss not importable: {type(exc).__name__}: {exc}") from exc
        fp8 = name == "fused_fp8"
        if fp8 and device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
            raise Unavailable("FP8 needs compute capability 8.9+")

        def fused_loss(x, weight, target):
            return linear_cross_entropy(x, weight, target, ignore_index=IGNORE_INDEX, fp8=fp8)
        return fused_loss
    raise ValueError(f"unknown variant {name!r}")


def problem(d, vocab, tokens, device, dtype, seed=0):
    """(x, weight, target): the hidden states and weight (leaves that require grad) and the targets."""
    g = torch.Generator(device).manual_seed(seed)
    x = (torch.randn(tokens, d, generator=g, device=device) / d ** 0.25).to(dtype).requires_grad_()
    weight = (torch.randn(vocab, d, generator=g, device=device) / d ** 0.25).to(dtype).requires_grad_()
    target = torch.randint(0, vocab, (tokens,), generator=g, device=device)
    target[torch.rand(tokens, generator=g, device=device) < IGNORED_SHARE] = IGNORE_INDEX
    return x, weight, target


def peak_bytes(fn, x, weight, device):
    """The peak allocated during one step over what was allocated before it (the variant alone)."""
    if device.type != "cuda":
        return None
    x.grad = weight.grad = None
    peak = step_memory(device, fn, count_saved=False)["peak_bytes"]
    x.grad = weight.grad = None
    return peak


def run_shape(d, vocab, tokens, fns, args, device, dtype):
    """Times and measures the available variants at one shape."""
    x, weight, target = problem(d, vocab, tokens, device, dtype)
    steps = {}
    for name, fn in fns.items():
        steps[name] = (lambda fn=fn: fn(x, weight, target).backward(), [x, weight])
    out = {"d": d, "vocab": vocab, "tokens": tokens, "variants": {}}
    bench = Bench(device) if device.type == "cuda" else Bench(device, warmup_ms=5.0, rep_ms=20.0)
    timed = bench.interleaved(steps, args.rounds)
    for name in fns:
        t = timed[name]
        if "error" in t:
            out["variants"][name] = {"status": "error", "reason": f"{type(t['error']).__name__}: {t['error']}"}
            continue
        out["variants"][name] = dict(t, status="ok", peak_bytes=peak_bytes(steps[name][0], x, weight, device))
    out["method"] = bench.method
    return out


def reference(x, weight, target):
    """(loss, x grad, weight grad) of the mean loss in float64 from the same rounded inputs,
    REFERENCE_ROWS tokens at a time."""
    x64, w64 = x.detach().double(), weight.detach().double()
    counted = target != IGNORE_INDEX
    n = counted.sum().double()
    loss = torch.zeros((), dtype=torch.float64, device=x.device)
    dx, dw = torch.empty_like(x64), torch.zeros_like(w64)
    for i in range(0, x64.shape[0], REFERENCE_ROWS):
        rows = slice(i, i + REFERENCE_ROWS)
        z = x64[rows] @ w64.T
        c = counted[rows]
        t = torch.where(c, target[rows], torch.zeros_like(target[rows]))
        lse = torch.logsumexp(z, dim=-1)
        loss += ((lse - z.gather(1, t[:, None])[:, 0]) * c).sum()
        g = torch.softmax(z, dim=-1)
        g[torch.arange(g.shape[0], device=g.device), t] -= 1.0
        g *= (c / n)[:, None]
        dx[rows] = g @ w64
        dw += g.T @ x64[rows]
        del z, g
    return loss / n, dx, dw


def rel_err(out, ref):
    out, ref = out.detach().double(), ref.detach().double()
    return float(torch.linalg.vector_norm(out - ref) / torch.linalg.vector_norm(ref).clamp_min(1e-300))


def accuracy(d, vocab, tokens, fns, device, dtype):
    """Each variant's relative error of loss, x grad and weight grad against the float64 reference,
    on the timed problem."""
    x, weight, target = problem(d, vocab, tokens, device, dtype)
    ref = reference(x, weight, target)
    out = {"d": d, "vocab": vocab, "tokens": tokens, "variants": {}}
    for name, fn in fns.items():
        x.grad = weight.grad = None
        try:
            loss = fn(x, weight, target)
            loss.backward()
        except Exception as exc:  # noqa: BLE001 - recorded for this variant; the others go on
            out["variants"][name] = {"status": "error", "reason": f"{type(exc).__name__}: {exc}"}
            continue
        out["variants"][name] = {"status": "ok", "loss": rel_err(loss, ref[0]), "x_grad": rel_err(x.grad, ref[1]),
                                 "weight_grad": rel_err(weight.grad, ref[2])}
    x.grad = weight.grad = None
    return out


def error_slack(tokens):
    """How far apart two float32 results of the same loss can be from rounding alone: the loss's
    own rounding and one per halving of the sum over the tokens, (1 + log2 tokens) * 2^-24."""
    return (1 + math.log2(max(tokens, 1))) * 2.0 ** -24


def targets(res):
    """{shape or vocabulary label: {target: 'met' / 'not met' / 'n/a'}}."""
    out = {}
    for s in res["shapes"]:
        label = f"{s['d']}x{s['vocab']} @ {s['tokens']}"
        ms = {n: report.ok_value(s, n, "ms") for n in VARIANTS}
        peak = {n: report.ok_value(s, n, "peak_bytes") for n in VARIANTS}
        met = report.verdict
        out[label] = {"time_vs_hf_compile": met(ms["fused"], ms["hf_compile"], TARGETS["time_vs_hf_compile"]),
                      "time_vs_liger": met(ms["fused"], ms["liger"], TARGETS["time_vs_liger"]),
                      "peak_vs_liger": met(peak["fused"], peak["liger"], TARGETS["peak_vs_liger"])}
    for a in res["accuracy"]:
        verdicts = [report.verdict(report.ok_value(a, "fused", k), report.ok_value(a, "hf_eager", k),
                                   TARGETS["error_vs_hf_eager"], error_slack(a["tokens"]))
                    for k in ("loss", "x_grad", "weight_grad")]
        verdict = "n/a" if "n/a" in verdicts else ("met" if all(v == "met" for v in verdicts) else "not met")
        out.setdefault(f"{a['d']}x{a['vocab']} @ {a['tokens']}", {})["error_vs_hf_eager"] = verdict
    return out


def _mib(v):
    b = v.get("peak_bytes") if v.get("status") == "ok" else None
    return "–" if b is None else f"{b / MIB:,.0f}"


def recorded_variants(res):
    """The variants a result holds (a record made before a variant existed leaves it out)."""
    return [n for n in VARIANTS if any(n in s["variants"] for s in res["shapes"])]


def markdown(res):
    env = res["environment"]
    names_run = recorded_variants(res)
    lines = [f"# The LM head and its loss, fused ({env.get('date_utc', '')[:10]})", "",
             f"{report.environment_line(env)}. {res['dtype']}, no bias, "
             f"{int(100 * IGNORED_SHARE)}% of the targets ignore_index, mean loss, forward + backward. Produced by "
             "`python -m bench.lm_head` (bench/lm_head.py says what each variant is).", ""]
    unavailable = res.get("unavailable", {})
    if unavailable:
        lines += ["Unavailable: " + "; ".join(f"{k}: {v}" for k, v in unavailable.items()) + ".", ""]
    lines += [f"## Time (ms, median and p20–p80 over {res['rounds']} interleaved rounds) and peak memory (MiB "
              "over what was allocated before the step, each variant alone)", "",
              "| shape | " + " | ".join(f"{n} ms | {n} MiB" for n in names_run) + " |",
              "|---|" + "---|---|" * len(names_run)]
    for s in res["shapes"]:
        cells = []
        for n in names_run:
            v = s["variants"].get(n, {"status": "unavailable"})
            cells += [report.ms_cell(v), _mib(v)]
        lines.append(f"| {s['d']} → {s['vocab']}, {s['tokens']} tokens | " + " | ".join(cells) + " |")
    lines += ["", "## Relative error against float64 (the timed problems; the reference from the same bf16 "
              f"inputs on the same device, {REFERENCE_ROWS} tokens at a time)", "",
              "| shape | variant | loss | x grad | weight grad |", "|---|---|---|---|---|"]
    for a in res["accuracy"]:
        where = f"{a['d']} → {a['vocab']}, {a['tokens']} tokens"
        for n in names_run:
            v = a["variants"].get(n, {"status": "unavailable"})
            if v.get("status") != "ok":
                lines.append(f"| {where} | {n} | {v.get('status')} | | |")
                continue
            lines.append(f"| {where} | {n} | {v['loss']:.2e} | {v['x_grad']:.2e} | {v['weight_grad']:.2e} |")
    lines += ["", "## Targets (#42)", "", "| where | target | verdict |", "|---|---|---|"]
    names = {"time_vs_hf_compile": "fused time ≤ hf_compile's", "time_vs_liger": "fused time ≤ 0.95× liger's",
             "peak_vs_liger": "fused peak ≤ 1.15× liger's", "error_vs_hf_eager": "fused errors ≤ hf_eager's (+ float32 rounding)"}
    for where, verdicts in res["targets_met"].items():
        for key, verdict in verdicts.items():
            lines.append(f"| {where} | {names[key]} | {verdict} |")
    lines.append("")
    return "\n".join(lines)


def make_png(res, path):
    plt = report.pyplot()
    if plt is None:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    labels = [f"{s['vocab']}\n{s['tokens']} tok" for s in res["shapes"]]
    names_run = recorded_variants(res)
    width = 0.8 / len(names_run)
    for ax, key, scale, ylabel in ((axes[0], "ms", 1.0, "ms (forward + backward)"),
                                   (axes[1], "peak_bytes", 1.0 / MIB, "peak MiB over resident")):
        for j, n in enumerate(names_run):
            vals = [(report.ok_value(s, n, key) or 0.0) * scale for s in res["shapes"]]
            ax.bar([i + j * width for i in range(len(labels))], vals, width, label=n)
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(labels))], labels)
        ax.set(ylabel=ylabel, title=f"d {res['shapes'][0]['d'] if res['shapes'] else ''} LM head + loss")
        ax.legend()
    return report.save_figure(plt, fig, path)


def parse_args(argv):
    p = report.record_parser(__doc__)
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma list of {', '.join(VARIANTS)}")
    p.add_argument("--rounds", type=int, default=5, help="interleaved timing rounds (at least 5 for the record)")
    p.add_argument("--quick", action="store_true", help="one vocabulary and token count (the CPU: tiny shapes)")
    args = report.parse_record_args(p, argv)
    if args.report:
        return args
    args.variants = report.comma_list(p, "--variants", args.variants, VARIANTS)
    return report.checked_record_args(p, args)


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if report.rewrote_record(args, markdown, make_png):
        return None
    from bench import environment
    device = torch.device(args.device)
    dtype = torch.bfloat16
    if device.type == "cuda":
        d, vocabs, tokens = D, VOCABS, TOKENS
    else:
        d, vocabs, tokens = CPU_D, CPU_VOCABS, CPU_TOKENS
    if args.quick:
        vocabs, tokens, args.rounds = vocabs[:1], tokens[:1], min(args.rounds, 2)
    fns, unavailable = {}, {}
    for name in args.variants:
        try:
            fns[name] = make_variant(name, device)
        except Unavailable as exc:
            unavailable[name] = str(exc)
            log(f"{name}: unavailable ({exc})")
    res = {"environment": environment.environment(device, sys.argv if argv is None else argv), "targets": TARGETS,
           "dtype": str(dtype).replace("torch.", ""), "rounds": args.rounds,
           "reference_rows": REFERENCE_ROWS, "unavailable": unavailable, "shapes": [], "accuracy": []}
    for vocab in vocabs:
        for m in tokens:
            shape = run_shape(d, vocab, m, fns, args, device, dtype)
            for name in unavailable:
                shape["variants"][name] = {"status": "unavailable", "reason": unavailable[name]}
            res["shapes"].append(shape)
            log(f"d={d} vocab={vocab} tokens={m}: " + ", ".join(
                f"{n} {v['ms']:.3f} ms" for n, v in shape["variants"].items() if v["status"] == "ok"))
            res["accuracy"].append(accuracy(d, vocab, m, fns, device, dtype))
            log("  errors against float64: " + ", ".join(
                f"{n} loss {v['loss']:.1e} dx {v['x_grad']:.1e} dw {v['weight_grad']:.1e}"
                for n, v in res["accuracy"][-1]["variants"].items() if v["status"] == "ok"))
    res["targets_met"] = targets(res)
    log("wrote " + ", ".join(report.write_dated_record(args.out, "lm_head", res, markdown, make_png)))
    return res


if __name__ == "__main__":
    main()
