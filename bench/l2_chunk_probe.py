"""Does fc2's data gradient get cheaper when its GEMM and the activation backward run in row
blocks small enough that the GEMM's output is still in L2 when the elementwise pass reads it?

  d_act = dY @ W2 ; d_pre = gelu'(pre) * d_act      (bf16, GELU tanh, no bias gradient)

  whole          one GEMM over all M rows, then one elementwise pass (what the unfused path does)
  rows/k         k row blocks, each GEMM block followed at once by its elementwise block; at
                 M = 8192, d = 1024 and k = 8 a block's d_act is 8 MiB, well inside the H200's L2
  ours whole     fused_dense act_linear_dgrad, unfused (heuristic -1), no bias gradient
  ours rows/k    the same op called per row block

aten's gelu_backward stands in for our kernel in the first two (the same bytes read and written).
Each line also gives the time against 'whole'; a gain would show as < 1.

    python bench/l2_chunk_probe.py [--shapes 8192x1024 ...]

A probe for issue #5, not part of bench/run.py: one line per shape and variant.
"""
import os
import sys

import torch
import triton.testing

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _probe import OPS, fc2_cases  # noqa: E402

GELU_BACKWARD = torch.ops.aten.gelu_backward.grad_input


def main():
    for spec, M, d, (w2, g, pre) in fc2_cases():
        d_act = torch.empty_like(pre)
        d_pre = torch.empty_like(pre)

        def aten_rows(k):
            bounds = [(M * i // k, M * (i + 1) // k) for i in range(k)]

            def f():
                for lo, hi in bounds:
                    torch.mm(g[lo:hi], w2, out=d_act[lo:hi])
                    GELU_BACKWARD(d_act[lo:hi], pre[lo:hi], approximate="tanh", grad_input=d_pre[lo:hi])
            return f

        def ours_rows(k):
            bounds = [(M * i // k, M * (i + 1) // k) for i in range(k)]

            def f():
                for lo, hi in bounds:
                    OPS.act_linear_dgrad(w2, g[lo:hi], pre[lo:hi], 1, False, -1)
            return f

        # the blocked results must equal the whole ones before any timing means anything
        aten_rows(1)()
        ref = d_pre.clone()
        d_pre.fill_(float("nan"))
        aten_rows(8)()
        blocked_diff = ((d_pre.float() - ref.float()).norm() / ref.float().norm()).item()
        ours_ref = OPS.act_linear_dgrad(w2, g, pre, 1, False, -1)[0]
        ours_diff = ((ours_ref.float() - ref.float()).norm() / ref.float().norm()).item()
        print(f"{spec} check: rows/8 vs whole rel. diff {blocked_diff:.1e}; ours vs aten {ours_diff:.1e}", flush=True)

        variants = [("whole", aten_rows(1))] + [(f"rows/{k}", aten_rows(k)) for k in (2, 4, 8, 16)]
        variants += [("ours whole", ours_rows(1))] + [(f"ours rows/{k}", ours_rows(k)) for k in (4, 8)]
        base = None
        for name, fn in variants:
            fn()
            torch.cuda.synchronize()
            ms = triton.testing.do_bench(fn, warmup=50, rep=300)
            base = base or ms
            print(f"{spec} {name:14s} {ms * 1e3:8.1f} us  {ms / base:5.3f}x whole", flush=True)


if __name__ == "__main__":
    main()
