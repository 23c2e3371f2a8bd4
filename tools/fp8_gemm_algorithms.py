"""The FP8 GEMMs of a converted Llama decoder layer (fused_dense's FP8 recipe, 8,192 tokens): each
of cuBLASLt's first algorithms (fp8_linear with an explicit heuristic index), 'auto' (the tuner's
choice, measured in this process) and torch._scaled_mm (torchao's GEMM) on the same operands.

    python tools/fp8_gemm_algorithms.py [--configs llama-4096,llama-2048] [--rounds 7] [--json FILE]

Per GEMM (the forward e4m3 x e4m3 with fast accumulation; the data and weight gradients e5m2 x
e4m3 without, as the FP8 layers call them; bf16 out): ms, bench.timing's interleaved rounds (the
L2 cache flushed before each run, medians), and the best index's gain over index 0 (cuBLASLt's first
choice, what 'auto' ran before it measured FP8 GEMMs). docs/performance.md, "FP8 GEMMs under 'auto'".
"""
import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import fused_dense  # noqa: E402,F401
from fused_dense import tuning  # noqa: E402
from bench.timing import Bench  # noqa: E402

TOKENS = 8192
# (name, N, K) of each linear: q / k / v stacked, o, gate / up packed, gate alone, down
LAYERS = {
    "llama-4096": [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096), ("gate", 14336, 4096),
                   ("down", 4096, 14336)],
    "llama-2048": [("qkv", 4096, 2048), ("o", 2048, 2048), ("gate_up", 16384, 2048), ("gate", 8192, 2048),
                   ("down", 2048, 8192)],
}
E4, E5 = torch.float8_e4m3fn, torch.float8_e5m2


def fp8(shape, fmt):
    """Normal values quantized at their amax, as the FP8 layers quantize."""
    t = torch.randn(shape, device="cuda")
    return (t * (torch.finfo(fmt).max / t.abs().max())).to(fmt)


def problems(config):
    """(linear, gemm, fp8_linear's (input, weight, fast_accum), torch._scaled_mm's (a, b, fast))."""
    out = []
    for name, N, K in LAYERS[config]:
        x, w, g = fp8((TOKENS, K), E4), fp8((N, K), E4), fp8((TOKENS, N), E5)
        w_t, g_t, x_t = w.t().contiguous(), g.t().contiguous(), x.t().contiguous()
        out.append((name, "forward", (x, w, True), (x, w.t(), True)))
        out.append((name, "dgrad", (g, w_t, False), (g, w_t.t(), False)))
        out.append((name, "wgrad", (g_t, x_t, False), (g_t, x_t.t(), False)))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", default="llama-4096,llama-2048")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--indices", type=int, default=8)
    ap.add_argument("--json")
    args = ap.parse_args()
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
        sys.exit("fp8_gemm_algorithms: needs an FP8 GPU (compute capability 8.9 or later)")
    tuning.configure(enabled=True, budget_s=1e6, pace=1.0)
    one = torch.ones((), device="cuda")
    bench = Bench(torch.device("cuda"))

    def fd(a, b, fast, h):
        return torch.ops.fused_dense.fp8_linear(a, b, one, one, None, torch.bfloat16, fast, h)

    rows = []
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, CUDA {torch.version.cuda}; {bench.method}")
    for config in args.configs.split(","):
        for name, gemm, (a, b, fast), sm in problems(config):
            fns = {}
            for h in range(args.indices):
                try:
                    fd(a, b, fast, h)
                except ValueError:  # past cuBLASLt's list
                    break
                fns[f"index {h}"] = (lambda h=h: fd(a, b, fast, h), None)
            fd(a, b, fast, -2)  # 'auto' measures here, once
            fns["auto"] = (lambda: fd(a, b, fast, -2), None)
            fns["torch._scaled_mm"] = (lambda: torch._scaled_mm(sm[0], sm[1], scale_a=one, scale_b=one,
                                                                out_dtype=torch.bfloat16, use_fast_accum=sm[2]), None)
            res = bench.interleaved(fns, args.rounds)
            med = {k: v["ms"] for k, v in res.items()}
            indices = [k for k in med if k.startswith("index")]
            best = min(indices, key=med.get)
            row = dict(config=config, linear=name, gemm=gemm, ms=med, best_index=best,
                       best_gain=med["index 0"] / med[best], auto_gain=med["index 0"] / med["auto"])
            rows.append(row)
            print(f"{config:10s} {name:8s} {gemm:7s} index 0 {med['index 0']:.4f}  best {best} {med[best]:.4f} "
                  f"({row['best_gain']:.3f}x)  auto {med['auto']:.4f} ({row['auto_gain']:.3f}x)  "
                  f"_scaled_mm {med['torch._scaled_mm']:.4f}  [{len(indices)} indices]", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, tokens=TOKENS,
                           rounds=args.rounds, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
