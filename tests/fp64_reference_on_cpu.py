"""FUSED_DENSE_TEST_FP64_REFERENCE_ON_CPU=1: the tests' float64 reference matmuls run on the CPU.

The tests compare every CUDA result with a float64 reference in plain PyTorch, mostly computed on
the same GPU. Under compute-sanitizer, racecheck above all, float64 GEMMs (which stage their tiles
through shared memory thread by thread, where Hopper's 16-bit GEMMs use TMA and wgmma) are the cost
that keeps tests from finishing: a FusedMLP test with a float64 reference at 1024 x 4096 does not
finish in 480 s under racecheck, while a forward-only bf16 test of that size without one takes
24-43 s (H200). The sanitizers are there to check fused_dense's kernels, not
PyTorch's DGEMM, so the sanitize step sets this variable: a TorchFunctionMode sends each float64
matmul-like call with a CUDA operand to the CPU and moves its result back, autograd included (the
copies are differentiable). Nothing else changes: the library's float64 ops are dispatcher ops, not
these Python functions, and still run on the GPU; elementwise reference work stays on the GPU too.
"""
import contextlib
import os

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map

ENV = "FUSED_DENSE_TEST_FP64_REFERENCE_ON_CPU"

MATMULS = frozenset({
    F.linear, torch.matmul, torch.mm, torch.bmm, torch.addmm, torch.baddbmm, torch.einsum,
    torch.Tensor.__matmul__, torch.Tensor.__rmatmul__, torch.Tensor.matmul, torch.Tensor.mm,
    torch.Tensor.bmm, torch.Tensor.addmm,
})


class Float64MatmulsOn(TorchFunctionMode):
    """Runs float64 matmul-like calls that have an operand on `source` (a device type) on `target`.

    `moved` counts the calls it moved (the tests of this module check it)."""

    def __init__(self, source="cuda", target="cpu"):
        super().__init__()
        self.source, self.target, self.moved = source, torch.device(target), 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        # torch.compile traces through an active mode: stay out of its way (a compiled graph has
        # no float64 reference in it, and the counter would be a side effect it refuses)
        if func in MATMULS and not torch.compiler.is_compiling():
            tensors = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
            if (tensors and all(t.dtype == torch.float64 for t in tensors)
                    and any(t.device.type == self.source for t in tensors)):
                home = next(t.device for t in tensors if t.device.type == self.source)
                there = tree_map(lambda a: a.to(self.target) if isinstance(a, torch.Tensor) else a, (args, kwargs))
                self.moved += 1
                out = func(*there[0], **there[1])
                return tree_map(lambda a: a.to(home) if isinstance(a, torch.Tensor) else a, out)
        return func(*args, **kwargs)


def from_env():
    """The mode when the variable is 1, else a no-op context. A TorchFunctionMode is per thread:
    conftest's autouse fixture enters it for each test, and a test's own worker threads enter theirs."""
    spec = os.environ.get(ENV, "")
    if spec not in ("", "0", "1"):
        raise ValueError(f"{ENV} must be 0 or 1, got {spec!r}")
    return Float64MatmulsOn("cuda", "cpu") if spec == "1" else contextlib.nullcontext()
