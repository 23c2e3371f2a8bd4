"""What the one-idea probes in bench/ share: the ops loaded from this checkout, and --shapes."""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import fused_dense  # noqa: E402,F401  (loads the ops)

OPS = torch.ops.fused_dense


def mlp_shapes(default=("8192x1024", "8192x2048", "8192x4096")):
    """--shapes MxD ... from the command line, as (M, d) pairs."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="+", default=list(default), help="M tokens x d (hidden 4d)")
    return [tuple(int(v) for v in spec.split("x")) for spec in ap.parse_args().shapes]


def fc2_backward_inputs(M, d, dtype=torch.bfloat16):
    """Fresh random inputs of fc2's backward in Linear(d, 4d) -> GELU -> Linear(4d, d): its weight
    W2 [d, 4d] (scaled like an initialized layer), the output gradient dY [M, d] and the stored
    pre-activation [M, 4d]."""
    h = 4 * d
    w2 = torch.randn(d, h, dtype=dtype, device="cuda") / h ** 0.5
    g = torch.randn(M, d, dtype=dtype, device="cuda")
    pre = torch.randn(M, h, dtype=dtype, device="cuda")
    return w2, g, pre


def fc2_cases(dtype=torch.bfloat16):
    """Per --shapes entry: its label 'MxD', M, d and fresh fc2_backward_inputs (the command line is
    read before any tensor is made, so --help needs no GPU)."""
    for M, d in mlp_shapes():
        yield f"{M}x{d}", M, d, fc2_backward_inputs(M, d, dtype)
