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
