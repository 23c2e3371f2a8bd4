#!/usr/bin/env python
"""Tells compute-sanitizer's reports about NVIDIA's GEMM kernels apart from real faults.

Run one case per process under a tool, e.g.
    compute-sanitizer --tool initcheck python tools/sanitizer_probe.py mm_fresh
Cases (bf16, 1024 x 1024 x 1024, every result checked against an fp32 reference):
    mm_fresh        torch.mm into a fresh (never written) output, then a copy reads it
    mm_prefilled    the same, but the output is zero-filled by a memset before torch.mm(out=...)
    fd_fresh        fused_dense's linear_act (GELU, saved pre-activation), then a copy reads both
    act_fresh_mm    fused_dense's act_forward (GELU) reads a fresh torch.mm output, as every
                    unfused path of the library does with its GEMM's output
    act_prefilled_mm  the same on a zero-filled output written by torch.mm(out=...)
    empty_read      a copy reads a fresh torch.empty buffer that nothing wrote: the positive
                    control, initcheck must report it
If initcheck reports mm_fresh but not mm_prefilled, the reads it flags are of bytes the GEMM did
write (the values check out), i.e. the tool does not see that kernel's stores; plain PyTorch is
enough to show it. racecheck on mm_fresh shows whether the GEMM kernels alone report hazards.
"""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def check(name, got, ref, tol=2e-2):
    err = ((got.float() - ref).norm() / ref.norm()).item()
    print(f"{name}: relative error {err:.2e}", flush=True)
    if not err <= tol:
        raise SystemExit(f"{name}: wrong result ({err:.2e} > {tol})")


def main(case):
    torch.manual_seed(0)
    n = 1024
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    ref = a.float() @ b.float()
    torch.cuda.synchronize()
    print(f"== case {case} begins", flush=True)
    if case == "mm_fresh":
        c = torch.mm(a, b)
        check(case, c.clone(), ref)
    elif case == "mm_prefilled":
        c = torch.zeros(n, n, device="cuda", dtype=torch.bfloat16)
        torch.mm(a, b, out=c)
        check(case, c.clone(), ref)
    elif case == "fd_fresh":
        import fused_dense  # noqa: F401
        bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
        out, pre = torch.ops.fused_dense.linear_act(a, b.t().contiguous(), bias, 1, True, -2)
        pre_ref = ref + bias.float()
        check(case + " pre_act", pre.clone(), pre_ref)
        check(case + " out", out.clone(), torch.nn.functional.gelu(pre_ref, approximate="tanh"))
    elif case in ("act_fresh_mm", "act_prefilled_mm"):
        import fused_dense  # noqa: F401
        if case == "act_fresh_mm":
            c = torch.mm(a, b)
        else:
            c = torch.zeros(n, n, device="cuda", dtype=torch.bfloat16)
            torch.mm(a, b, out=c)
        out = torch.ops.fused_dense.act_forward(c, 1)
        check(case, out.clone(), torch.nn.functional.gelu(ref, approximate="tanh"))
    elif case == "empty_read":
        c = torch.empty(n, n, device="cuda", dtype=torch.bfloat16)
        c.clone()
    else:
        raise SystemExit(f"unknown case {case!r}")
    torch.cuda.synchronize()
    print(f"== case {case} ends", flush=True)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "mm_fresh")
