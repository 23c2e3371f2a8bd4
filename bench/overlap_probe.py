"""Can the memory-bound activation backward hide behind fc2's weight-gradient GEMM? Times, at the
MLP's shapes (bf16, GELU tanh), the fc2 half of the backward:

  d_act = dY @ W2 ; d_pre = gelu'(pre) * d_act ; dW2 = dYᵀ @ act

  serial        the three kernels on one stream (aten mm, aten gelu_backward, aten mm)
  overlap ew1st d_pre on a side stream, launched before dW2's GEMM on the main stream
  overlap mm1st the same, dW2's GEMM launched first
  ours          fused_dense act_linear_dgrad (auto, with bias grad) + linear_bias_wgrad (auto)

aten's gelu_backward stands in for our activation-backward kernel: the same bytes read and
written (two reads, one write), so the overlap it shows is the one ours could get.

    python bench/overlap_probe.py [--shapes 8192x1024 ...]

A probe for issue #5, not part of bench/run.py: one line per shape and variant.
"""
import os
import sys

import torch
import triton.testing

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _probe import OPS, fc2_cases  # noqa: E402


def main():
    side = None
    for spec, M, d, (w2, g, pre) in fc2_cases():
        side = side or torch.cuda.Stream()
        act = torch.nn.functional.gelu(pre, approximate="tanh")

        def dgrad_gemm():
            return torch.mm(g, w2)

        def ew(d_act):
            return torch.ops.aten.gelu_backward(d_act, pre, approximate="tanh")

        def wgrad_gemm():
            return torch.mm(g.t(), act)

        def serial():
            ew(dgrad_gemm())
            wgrad_gemm()

        def overlap(ew_first):
            def f():
                main = torch.cuda.current_stream()
                d_act = dgrad_gemm()
                side.wait_stream(main)
                if ew_first:
                    with torch.cuda.stream(side):
                        ew(d_act)
                    wgrad_gemm()
                else:
                    wgrad_gemm()
                    with torch.cuda.stream(side):
                        ew(d_act)
                main.wait_stream(side)
            return f

        def ours():
            OPS.act_linear_dgrad(w2, g, pre, 1, True, -2)
            OPS.linear_bias_wgrad(act, g, True)

        parts = [("dY@W2 alone", dgrad_gemm), ("gelu_backward alone", lambda: ew(pre)),
                 ("dYt@act alone", wgrad_gemm)]
        variants = [("serial", serial), ("overlap ew1st", overlap(True)),
                    ("overlap mm1st", overlap(False)), ("ours", ours)]
        base = None
        for name, fn in parts + variants:
            fn()
            torch.cuda.synchronize()
            ms = triton.testing.do_bench(fn, warmup=50, rep=300)
            if name == "serial":
                base = ms
            rel = f"{ms / base:5.3f}x serial" if base else ""
            print(f"{spec} {name:20s} {ms * 1e3:8.1f} us  {rel}", flush=True)


if __name__ == "__main__":
    main()
