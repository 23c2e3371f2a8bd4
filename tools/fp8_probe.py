"""Every FP8 kernel once at small shapes, for compute-sanitizer (tools/README.md): fp8_quantize in
each mode (plain, forward activations, backward activation derivatives, the gated forward and
backward; current and delayed scaling; row-major, transposed and column sums; in place over an
e4m3 pre_act: fp8_quantize_grad_), fp8_transpose, fp8_linear with
each format pair, fp8_linear_act (its one-GEMM kernels and the two-kernel path), and an FP8 MLP,
gated MLP and linear layer step under both recipes.
``--quantize-only``: the quantize calls alone, on inputs that PyTorch's own kernels wrote (for
initcheck, which does not see the stores of cuBLAS's GEMMs: docs/reliability.md)."""
import sys

import torch

import fused_dense

dev = "cuda"
q = torch.ops.fused_dense.fp8_quantize
for rows, cols in [(1, 8), (77, 40), (130, 200)]:
    x = torch.randn(rows, cols, device=dev, dtype=torch.bfloat16)
    pre = torch.randn(rows, cols, device=dev, dtype=torch.bfloat16)
    scale = torch.tensor(5.0, device=dev)
    for act, backward in [(0, False), (1, False), (2, False), (3, False), (1, True), (2, True), (3, True)]:
        for fmt in (0, 1):
            for s in (None, scale):
                q(x, pre if backward else None, act, backward, fmt, s, True, True, True)
    gu = torch.randn(rows, 2 * cols, device=dev, dtype=torch.bfloat16)
    for act in (4, 5):
        for fmt in (0, 1):
            for s in (None, scale):
                q(gu, None, act, False, fmt, s, True, True, True)
                q(x, gu, act, True, fmt, s, True, True, True)
        q(gu.float(), None, act, False, 0, None, True, True, True)
        q(x.float(), gu.float(), act, True, 1, None, True, True, True)
    q(x.float(), None, 0, False, 0, None, True, True, True)
    q(x.half(), None, 1, False, 1, None, False, True, False)
    # the backward quantize written over an e4m3 pre_act (plain and gated), and the byte transpose
    for p, acts in [(pre, (1, 2, 3)), (gu, (4, 5))]:
        p8 = q(p, None, 0, False, 0, None, True, False, False)
        for act in acts:
            for fmt in (0, 1):
                for s in (None, scale):
                    torch.ops.fused_dense.fp8_quantize_grad_(p8[0].clone(), x, act, fmt, s, True, p8[3])
    if cols % 16 == 0:
        torch.ops.fused_dense.fp8_transpose(q(x, None, 0, False, 1, None, True, False, False)[0])
for rows, cols in [(300, 208), (1000, 64)]:  # several row tiles of the transpose, padded rows
    torch.ops.fused_dense.fp8_transpose(
        q(torch.randn(rows, cols, device=dev, dtype=torch.bfloat16), None, 0, False, 0, None, True, False, False)[0])
if "--quantize-only" in sys.argv:
    torch.cuda.synchronize()
    print("fp8_probe: done (quantize only)")
    sys.exit(0)
xi = q(torch.randn(48, 64, device=dev, dtype=torch.bfloat16), None, 0, False, 0, None, True, False, False)
gi = q(torch.randn(48, 64, device=dev, dtype=torch.bfloat16), None, 0, False, 1, None, True, False, False)
wi = q(torch.randn(32, 64, device=dev, dtype=torch.bfloat16), None, 0, False, 0, None, True, False, False)
for a, w in [(xi, wi), (gi, wi), (wi, gi)]:
    bias = torch.randn(w[0].shape[0], device=dev)
    for dt in (torch.bfloat16, torch.float16, torch.float32):
        torch.ops.fused_dense.fp8_linear(a[0], w[0], a[3], w[3], bias.to(dt), dt, False, -2)
# fp8_linear_act: the one-GEMM kernels (B, K, N multiples of 16, with partial tiles; delayed and
# current scaling) and the two-kernel path (B = 50), with and without the transposed copy
for B, K, N in [(64, 64, 96), (272, 160, 208), (50, 64, 96)]:
    xa = q(torch.randn(B, K, device=dev, dtype=torch.bfloat16), None, 0, False, 0, None, True, False, False)
    wa = q(torch.randn(N, K, device=dev, dtype=torch.bfloat16), None, 0, False, 0, None, True, False, False)
    bias = torch.randn(N, device=dev, dtype=torch.bfloat16)
    for scale in (torch.tensor(3.0, device=dev), None):
        for cw in (False, True):
            torch.ops.fused_dense.fp8_linear_act(xa[0], wa[0], xa[3], wa[3], bias, torch.bfloat16, 1, scale, cw)
for scaling in ("current", "delayed"):
    recipe = fused_dense.Float8Recipe(scaling=scaling, min_features=0)
    for lvl in (0, 1, 2):
        m = fused_dense.FusedMLP(64, 256, checkpoint_lvl=lvl, device=dev, dtype=torch.bfloat16, fp8=recipe)
        x = torch.randn(100, 64, device=dev, dtype=torch.bfloat16, requires_grad=True)
        for _ in range(2):
            m(x).float().square().sum().backward()
        g = fused_dense.FusedGatedMLP(64, 96, checkpoint_lvl=lvl, device=dev, dtype=torch.bfloat16, fp8=recipe)
        for _ in range(2):
            g(x).float().square().sum().backward()
    d = fused_dense.FusedDense(64, 48, device=dev, dtype=torch.bfloat16, fp8=recipe)
    for _ in range(2):  # delayed scaling's first step runs current scaling: the second its own kernels
        d(torch.randn(33, 64, device=dev, dtype=torch.bfloat16, requires_grad=True)).sum().backward()
torch.cuda.synchronize()
print("fp8_probe: done")
