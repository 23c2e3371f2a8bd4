"""Where should fc1's bias gradient come from? Times, at the MLP's shapes, the backward half that
produces d_pre = (dY @ W2) * gelu'(pre), db1 and dW1:

  now        act_linear_dgrad with the bias gradient (auto) + linear_bias_wgrad without it
  dgelu h=k  act_linear_dgrad without it, fused DGELU epilogue (cuBLASLt entry k)
             + linear_bias_wgrad with it (BGRADB epilogue or our column sum, auto)
  unfused    act_linear_dgrad without it, unfused + linear_bias_wgrad with it

    python bench/dgrad_split_probe.py [--shapes 8192x1024 ...]

A probe for issue #5, not part of bench/run.py: it prints one line per shape and variant.
"""
import os
import sys

import torch
import triton.testing

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _probe import OPS, fc2_cases  # noqa: E402


def main():
    for spec, M, d, (w2, g, pre) in fc2_cases():
        x = torch.randn(M, d, dtype=g.dtype, device="cuda")

        def now():
            d_pre, _ = OPS.act_linear_dgrad(w2, g, pre, 1, True, -2)
            OPS.linear_bias_wgrad(x, d_pre, False)

        def split(heur):
            def f():
                d_pre, = OPS.act_linear_dgrad(w2, g, pre, 1, False, heur)
                OPS.linear_bias_wgrad(x, d_pre, True)
            return f

        d_pre_ref, db_ref = OPS.act_linear_dgrad(w2, g, pre, 1, True, -1)
        variants = [("now", now), ("unfused", split(-1))] + [(f"dgelu h={k}", split(k)) for k in range(4)]
        base = None
        for name, fn in variants:
            try:
                fn()
            except Exception as e:  # an out-of-range heuristic index
                print(f"{spec} {name}: skipped ({str(e).splitlines()[0][:80]})")
                continue
            ms = triton.testing.do_bench(fn, warmup=50, rep=300)
            base = base or ms
            print(f"{spec} {name:12s} {ms * 1e3:8.1f} us  {ms / base:5.3f}x now", flush=True)
        for k in range(2):
            try:
                d_pre, = OPS.act_linear_dgrad(w2, g, pre, 1, False, k)
            except Exception:
                continue
            err = ((d_pre.float() - d_pre_ref.float()).norm() / d_pre_ref.float().norm()).item()
            print(f"{spec} dgelu h={k} d_pre rel. diff vs unfused: {err:.2e}")


if __name__ == "__main__":
    main()
