#!/usr/bin/env python
"""Times fused_dense's LM head + loss (linear_cross_entropy, bf16) at several chunk sizes against
Hugging Face's head + loss under torch.compile, in one set of interleaved rounds per shape, with
each variant's peak memory and its errors against float64: the measurements behind the op's chunk
rule (csrc/torch/lm_head.cpp, lce_chunk_rows).

    python tools/lce_chunk_sweep.py --out sweep.json
    python tools/lce_chunk_sweep.py --shapes 4096x32000x8192 --chunks 1024,2048 --out sweep.json

A shape is d x vocab x tokens; the problem, the reference and the error are bench.lm_head's (bf16
inputs, 5% of the targets ignore_index, mean loss, forward + backward). "rule" is the chunk the
op's rule picks for the shape (no chunk_size); it is timed as a variant of its own. With
--profile, each variant's kernels by time a call (torch.profiler over 2 calls) are logged and kept
in the JSON (`profile`).
"""
import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402

from bench import environment  # noqa: E402
from bench import lm_head as L  # noqa: E402
from bench.timing import MIB  # noqa: E402

sys.path.insert(0, os.path.join(ROOT, "tools"))
from sanitize_summary import TEMPLATE_WIDTH, short  # noqa: E402

SHAPES = "2048x32000x8192,4096x32000x8192,4096x32000x16384,2048x128256x8192,4096x128256x8192"
CHUNKS = "512,1024,2048,4096,8192"


def fused(chunk):
    from fused_dense.loss import linear_cross_entropy

    def loss(x, weight, target):
        return linear_cross_entropy(x, weight, target, ignore_index=L.IGNORE_INDEX, chunk_size=chunk)
    return loss


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default=SHAPES, help="comma list of d x vocab x tokens")
    p.add_argument("--chunks", default=CHUNKS, help="comma list of chunk sizes (rows)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--no-compile", action="store_true", help="leave Hugging Face + torch.compile out")
    p.add_argument("--device", default="cuda", help="cuda, or cpu for a functional check of the script")
    p.add_argument("--out", required=True, help="JSON to write")
    p.add_argument("--profile", action="store_true", help="also each variant's kernels by time a call")
    args = p.parse_args()
    device = torch.device(args.device)
    dtype = torch.bfloat16
    chunks = [int(c) for c in args.chunks.split(",")]
    res = {"environment": environment.environment(device, sys.argv), "rounds": args.rounds, "shapes": []}
    for shape in args.shapes.split(","):
        d, vocab, tokens = (int(v) for v in shape.lower().split("x"))
        rule = torch.ops.fused_dense.linear_cross_entropy_chunk_rows(tokens, d, vocab, dtype.itemsize, 0)
        fns = {} if args.no_compile or device.type != "cuda" else {"hf_compile": L.make_variant("hf_compile", device)}
        fns["rule"] = fused(None)
        for c in chunks:
            if c < tokens or c == chunks[0]:
                fns[f"chunk_{c}"] = fused(c)
        # bench.lm_head's timing (interleaved rounds, each variant's peak alone) and accuracy
        out = dict(L.run_shape(d, vocab, tokens, fns, args, device, dtype), rule_rows=rule)
        errors = L.accuracy(d, vocab, tokens, fns, device, dtype)["variants"]
        for n, v in out["variants"].items():
            if v["status"] == "ok":
                v.update(errors[n])  # an error there makes the variant's status "error"
        if args.profile and device.type == "cuda":
            from bench.model import profile_calls
            x, weight, target = L.problem(d, vocab, tokens, device, dtype)
            for n, fn in fns.items():
                def call(fn=fn):
                    fn(x, weight, target).backward()
                    x.grad = weight.grad = None
                call()
                by_class, top = profile_calls(call, 2, top=12)
                out["variants"][n]["profile"] = {"total_ms": round(by_class["total"], 4), "top": top}
                L.log(f"  profile {n}: {by_class['total']:.3f} ms of kernels a call")
                for k in top:
                    L.log(f"    {k[2]:8.4f} ms {k[3]:5.1f}x  {short(k[0], TEMPLATE_WIDTH)}")
            x = weight = target = None
        res["shapes"].append(out)
        base = out["variants"].get("hf_compile", {}).get("ms")
        L.log(f"d {d} vocab {vocab} tokens {tokens} (rule {rule} rows):")
        for n, v in out["variants"].items():
            if v["status"] != "ok":
                L.log(f"  {n}: {v['reason']}")
                continue
            rel = f" ({v['ms'] / base:.3f}x hf_compile)" if base else ""
            peak = "–" if v["peak_bytes"] is None else f"{v['peak_bytes'] / MIB:,.0f}"
            L.log(f"  {n:>12}: {v['ms']:.3f} ms{rel}, peak {peak} MiB, "
                  f"errors loss {v['loss']:.2e} dx {v['x_grad']:.2e} dw {v['weight_grad']:.2e}")
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
