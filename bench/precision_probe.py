#!/usr/bin/env python
"""Precision of every cuBLASLt algorithm on a cancelling sum: one row x, K = 2391, |x.w| ~ 4,
bias chosen so that x.w + b ~ +-0.03. Prints the relative error of pre_act per heuristic index,
per epilogue, next to PyTorch's F.linear on the same data. An algorithm that rounds x.w to 16 bits
before adding the bias (or adds split-K partials in 16 bits) shows |x.w| * 2^-9 / 0.03 ~ 0.2 for
bf16 and ~ 0.03 for fp16; fp32 epilogue math shows ~ 2^-9 (bf16) / 2^-12 (fp16).

    python bench/precision_probe.py
"""
import math
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from fused_dense import ops  # noqa: E402


def rel(a, b):
    return (torch.linalg.vector_norm(a.double() - b) / torch.linalg.vector_norm(b)).item()


def main():
    torch.manual_seed(0)
    K, N = 2391, 64
    for dtype in (torch.float16, torch.bfloat16):
        for rows in (1, 64):
            x = torch.randn(rows, K, device="cuda").to(dtype)
            w = (torch.randn(N, K, device="cuda") * 4 / math.sqrt(K)).to(dtype)
            s = x.double() @ w.double().t()
            b = (-s[0] + 0.03 * torch.sign(torch.randn(N, device="cuda", dtype=torch.float64))).to(dtype)
            ref = x.double() @ w.double().t() + b.double()
            line = [f"{str(dtype):15s} rows={rows:3d}  F.linear {rel(F.linear(x, w, b), ref):.1e}"]
            for act, name in (("none", "bias"), ("gelu_approx", "gelu_aux"), ("relu", "relu")):
                errs = []
                for h in (-1, *range(64)):
                    try:
                        out, pre = ops.linear_act(x, w, b, act, act == "gelu_approx", h)
                    except ValueError:
                        break
                    errs.append(f"{h}:{rel(out if act != 'gelu_approx' else pre, ref if act != 'relu' else F.relu(ref)):.0e}")
                line.append(f"  {name}: " + " ".join(errs))
            print("\n".join(line), flush=True)


if __name__ == "__main__":
    main()
