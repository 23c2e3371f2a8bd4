#!/usr/bin/env python
"""Bar chart of MLP forward + backward TF/s per shape per variant, from bench.json.

    python bench/plot.py DIR/bench.json [-o DIR/bench.png]

Needs matplotlib (`pip install matplotlib`); no torch.
"""
import argparse
import json
import os
import sys

ORDER = ["floor", "eager", "compile", "auto_l0", "auto_l1", "auto_l2", "h-1_l0", "h0_l0", "h1_l0", "h2_l0"]
LABELS = {
    "floor": "six GEMMs (floor)", "eager": "eager PyTorch", "compile": "torch.compile",
    "auto_l0": "FusedMLP auto", "auto_l1": "FusedMLP auto, ckpt 1", "auto_l2": "FusedMLP auto, ckpt 2",
    "h-1_l0": "FusedMLP h=-1 (unfused)", "h0_l0": "FusedMLP h=0", "h1_l0": "FusedMLP h=1", "h2_l0": "FusedMLP h=2",
}
COLORS = {
    "floor": "#9e9e9e", "eager": "#ef6c00", "compile": "#c62828", "auto_l0": "#1565c0", "auto_l1": "#42a5f5",
    "auto_l2": "#90caf9", "h-1_l0": "#2e7d32", "h0_l0": "#66bb6a", "h1_l0": "#a5d6a7", "h2_l0": "#c8e6c9",
}


def make_png(res, path):
    """Write the chart; raises ImportError when matplotlib is missing."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mlp = res.get("mlp", [])
    configs = []
    for r in mlp:
        c = (r["dtype"], r["activation"])
        if c not in configs:
            configs.append(c)
    if not configs:
        raise ValueError("bench.json has no MLP results to plot")
    env = res.get("env", {})
    ceiling = (res.get("ceiling") or {}).get("tflops")
    n = len(configs)
    fig, axes = plt.subplots(n, 1, figsize=(13, 3.6 * n + 0.8), squeeze=False)
    for ax, (dtype, act) in zip(axes[:, 0], configs):
        recs = [r for r in mlp if r["dtype"] == dtype and r["activation"] == act]
        def has(k):
            return any((r["variants"].get(k) or {}).get("status") == "ok" and r["variants"][k].get("tflops")
                       for r in recs)
        keys = [k for k in ORDER if has(k)]
        keys += sorted({k for r in recs for k in r["variants"] if k not in keys and has(k)})
        width = 0.8 / max(1, len(keys))
        for i, k in enumerate(keys):
            xs, ys = [], []
            for j, r in enumerate(recs):
                v = r["variants"].get(k)
                if v and v.get("status") == "ok" and v.get("tflops"):
                    xs.append(j - 0.4 + width * (i + 0.5))
                    ys.append(v["tflops"])
            if xs:
                bars = ax.bar(xs, ys, width * 0.95, label=LABELS.get(k, k), color=COLORS.get(k))
                if len(keys) * len(recs) <= 48:
                    ax.bar_label(bars, fmt="%.0f", fontsize=6, padding=1, rotation=90)
        if ceiling:
            ax.axhline(ceiling, color="k", ls="--", lw=0.8)
            ax.text(0.995, ceiling, f"ceiling: {res['ceiling']['n']}³ {res['ceiling'].get('dtype', '')} mm "
                    f"{ceiling:.0f} TF/s", transform=ax.get_yaxis_transform(), va="bottom", ha="right", fontsize=7)
        ax.set_xticks(range(len(recs)))
        ax.set_xticklabels([f"M={r['M']}, d={r['d']}" for r in recs])
        ax.set_ylabel("TF/s (12·M·d·h / time)")
        ax.set_title(f"MLP forward + backward, {dtype}, {act}", fontsize=10)
        top = max([ceiling or 0] + [v.get("tflops") or 0 for r in recs for v in r["variants"].values()
                                    if isinstance(v, dict)])
        ax.set_ylim(0, top * 1.18 if top else 1)
        ax.legend(fontsize=7, ncol=5, loc="lower center", bbox_to_anchor=(0.5, 1.07), frameon=False)
        ax.grid(axis="y", alpha=0.3)
    gpu = env.get("gpu") or "CPU (smoke test)"
    fig.suptitle(f"fused_dense — {gpu}, torch {env.get('torch')}, CUDA {env.get('torch_cuda')}, "
                 f"cuBLASLt {env.get('cublasLt_version_str', '–')}, {str(env.get('date_utc', ''))[:10]}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("json")
    ap.add_argument("-o", "--out", help="PNG path (default: bench.png beside the JSON)")
    a = ap.parse_args(argv)
    with open(a.json) as f:
        res = json.load(f)
    out = a.out or os.path.join(os.path.dirname(os.path.abspath(a.json)), "bench.png")
    make_png(res, out)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
