"""How close the FP8 quantize passes run to the GPU's memory bandwidth: fused_dense's fp8_quantize
at the shapes of a llama-4096 training step (weights and activations; the gated forward pass of
SwiGLU), current scaling (amax pass + cast pass) and at a given scale (the cast pass alone), each
against a copy of the same bytes (torch's copy kernel, a read and a write: what the GPU's memory
reaches here).

    python tools/quantize_bandwidth.py [--json FILE]

Per shape: ms of current scaling and of the cast alone (bench.timing.Bench: medians, the L2 cache
flushed before each call), the amax pass by difference, and each pass's bytes over its time in
GB/s beside the copy's. A pass well under the copy's GB/s has room to gain.
"""
import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import fused_dense  # noqa: E402
from fused_dense import ops  # noqa: E402
from bench.timing import Bench  # noqa: E402

# (name, rows, cols, activation): a llama-4096 step's quantized tensors (2 x 4096 tokens), each with
# its row-wise and transposed copies, as the GEMMs of forward and backward read them
SHAPES = [
    ("weight qkv 6144x4096", 6144, 4096, "none"),
    ("weight o 4096x4096", 4096, 4096, "none"),
    ("weight gate_up 28672x4096", 28672, 4096, "none"),
    ("weight down 4096x14336", 4096, 14336, "none"),
    ("input 8192x4096", 8192, 4096, "none"),
    ("swiglu fwd gu 8192x28672", 8192, 28672, "swiglu"),
]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if not torch.cuda.is_available() or not fused_dense.has_cuda_kernels():
        p.error("needs a GPU and the library's CUDA kernels")
    dev = torch.device("cuda")
    bench = Bench(dev)
    rows_out = []
    print(f"{torch.cuda.get_device_name(dev)}; GB/s = bytes moved / time")
    print(f"{'tensor':28} {'current ms':>10} {'cast ms':>8} {'amax ms':>8} {'cast GB/s':>9} {'amax GB/s':>9} "
          f"{'copy GB/s':>9}")
    e4m3 = ops.FP8_FORMATS["e4m3"]
    for name, rows, cols, act in SHAPES:
        g = torch.Generator(device=dev).manual_seed(rows * 7 + cols)
        x = torch.randn(rows, cols, dtype=torch.bfloat16, device=dev, generator=g)
        code = ops.ACTIVATIONS[act]
        out_cols = cols // 2 if act in ops.GATED_ACTIVATIONS else cols
        scale = torch.tensor([3.0], dtype=torch.float32, device=dev)

        def current():
            return torch.ops.fused_dense.fp8_quantize(x, None, code, False, e4m3, None, True, True, False)

        def cast():
            return torch.ops.fused_dense.fp8_quantize(x, None, code, False, e4m3, scale, True, True, False)

        y = torch.empty_like(x)
        t_cur, t_cast, t_copy = (bench(fn)["ms"] for fn in (current, cast, lambda: y.copy_(x)))
        read = x.numel() * 2
        written = 2 * rows * out_cols  # data and data_t, a byte each
        t_amax = max(t_cur - t_cast, 1e-6)
        r = {"tensor": name, "current_ms": t_cur, "cast_ms": t_cast, "amax_ms": t_amax,
             "cast_gbs": (read + written) / t_cast / 1e6, "amax_gbs": read / t_amax / 1e6,
             "copy_gbs": 2 * read / t_copy / 1e6}
        rows_out.append(r)
        print(f"{name:28} {t_cur:10.4f} {t_cast:8.4f} {t_amax:8.4f} {r['cast_gbs']:9.0f} {r['amax_gbs']:9.0f} "
              f"{r['copy_gbs']:9.0f}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(dev), "method": bench.method, "rows": rows_out}, f, indent=1)


if __name__ == "__main__":
    main()
