"""The tensor-parallel layers with their communication pipelined against their GEMMs, forward
and backward: ``ParallelFusedMLP`` runs on :class:`PipelinedParallelMLPFunc`, and
``ColumnParallelLinear`` / ``RowParallelLinear`` with ``overlap_chunks > 1`` on
:class:`PipelinedColumnLinearFunc` / :class:`PipelinedRowLinearFunc` (end of this file).

The MLP is row-wise: fc2(act(fc1(x))) of a block of rows depends on those rows only. So the
rows of this rank's input are cut into ``chunks`` blocks, and block c goes through the whole
layer while the communication of its neighbours runs:

* sequence parallel (x is this rank's dim-0 shard): forward all-gathers block c of every rank
  (rows ``[rank 0's block c, rank 1's block c, ...]``) while block c - 1 computes, and
  reduce-scatters block c's fc2 partial sums while block c + 1 computes, so each rank gets its
  own block c back, in order; backward all-gathers the output gradient's blocks (and the input's
  again, which is not kept gathered), and reduce-scatters the input gradient's blocks, each
  against the neighbouring blocks' GEMMs;
* without sequence parallelism (x replicated): forward all-reduces each block's output, backward
  each block's input gradient, likewise overlapped.

What each block keeps for backward and what it recomputes is decided by the C++ checkpoint plan
(``fused_mlp_plan``), and its two halves are the C++ ops ``fused_mlp_train_forward`` and
``fused_mlp_backward``: the rules are the same as for every other MLP path (docs/contract.md,
"Checkpoint levels"). The weight and bias gradients are summed over the blocks in float32 and
rounded once.

A collective in flight here is asynchronous on the process group's own stream (NCCL) or thread
(gloo), so on a GPU it overlaps with the GEMMs that the Python code enqueues meanwhile. With
``chunks=1`` (the default) the layer does what ``fused_mlp_func`` + a reduction does: the
gather of x is waited before fc1 and the reduction of fc2's output after it, and only backward
overlaps (the re-gather of x under fc2's gradients, the input gradient's reduction under fc1's
weight gradient). More blocks cost smaller GEMMs and, in backward, a float32 sum of each weight
gradient over the blocks; the block count that pays off on NCCL has not been measured yet, so
the default keeps the single block.
"""
from typing import List, Optional

import torch
from torch import Tensor

from . import ops
from .distributed import all_gather_raw, all_reduce_raw, reduce_scatter_raw
from ._common import (as_2d, autocast_off, bias_grad, check_op_tensors, compute_dtype, dgrad, linear, prepare,
                      use_ops, wait, wgrad)

__all__ = ["PipelinedParallelMLPFunc", "PipelinedColumnLinearFunc", "PipelinedRowLinearFunc",
           "pipelined_parallel_mlp"]


def _blocks(t: Optional[Tensor], chunks: int) -> List[Optional[Tensor]]:
    """t cut along dim 0 into `chunks` blocks of the sizes every rank uses (torch.chunk's rule,
    which depends on the row count only, the same on every rank), as contiguous tensors."""
    if t is None:
        return [None] * chunks
    return [b.contiguous() for b in torch.tensor_split(t, chunks, dim=0)]


def _block_count(rows: int, chunks: int) -> int:
    return max(1, min(chunks, rows))


class _Comm:
    """The collectives of one direction of the pipeline: gather in, reduce out."""

    def __init__(self, group, sequence_parallel: bool):
        self.group, self.sp = group, sequence_parallel

    def gather(self, t: Optional[Tensor]):
        """(whole rows, handle): the all-gather of a block when sequence parallel, else the block."""
        if t is None or not self.sp:
            return t, None
        return all_gather_raw(t, self.group, async_op=True)

    def reduce(self, t: Tensor):
        """(this rank's result, handle): reduce-scatter (sequence parallel) or all-reduce."""
        if self.sp:
            return reduce_scatter_raw(t, self.group, async_op=True)
        return all_reduce_raw(t, self.group, async_op=True)


class _Accumulator:
    """Sum of per-block gradients: one block's gradient is taken as it is; more are summed in
    float32 (for 16-bit parameters) and rounded once at the end."""

    def __init__(self):
        self.total, self.blocks = None, 0

    def add(self, t: Optional[Tensor]) -> None:
        if t is None:
            return
        self.blocks += 1
        if self.blocks == 1:
            self.total = t
            return
        if self.blocks == 2 and self.total.dtype in (torch.float16, torch.bfloat16):
            self.total = self.total.float()
        self.total.add_(t)

    def result(self, dtype: Optional[torch.dtype]) -> Optional[Tensor]:
        if self.total is None:
            return None
        return self.total if dtype is None or self.total.dtype == dtype else self.total.to(dtype)


class PipelinedParallelMLPFunc(torch.autograd.Function):
    """fc2(act(fc1(x))) on a tensor-parallel group, reduced across it (the module docstring
    says how); returns this rank's rows (sequence parallel) or all rows."""

    @staticmethod
    def forward(ctx, x, weight1, bias1, weight2, bias2, activation, save_pre_act, checkpoint_lvl, heuristic,
                process_group, sequence_parallel, chunks):
        act = ops.check_mlp_arguments(activation, checkpoint_lvl, "any")  # the C++ ops check the weights
        code = ops.heuristic_code(heuristic)
        if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
            raise ValueError(f"chunks must be an integer >= 1, got {chunks!r}")
        lvl = checkpoint_lvl if save_pre_act else 2
        dtype, autocast = compute_dtype(x)
        # the gradients are returned in each parameter's own dtype, from float32 sums
        ctx.param_dtypes = tuple(None if t is None else t.dtype for t in (weight1, bias1, weight2, bias2))
        with autocast_off(x.device.type):
            x = prepare(x, dtype)
            weight1, bias1, weight2, bias2 = (prepare(t, dtype, autocast) for t in (weight1, bias1, weight2, bias2))
            check_op_tensors("ParallelFusedMLP", x, weight1, bias1, weight2, bias2)
            needs = list(ctx.needs_input_grad[:5])
            needs[2] = needs[2] and bias1 is not None
            needs[4] = needs[4] and bias2 is not None
            plan = ops.mlp_plan(act, lvl, needs)
            comm = _Comm(process_group, sequence_parallel)
            n = _block_count(x.shape[0], chunks)
            x_blocks = _blocks(x, n)
            train_forward = ops.op_overload("fused_mlp_train_forward")

            outs, pending, saved = [None] * n, [None] * n, []
            gathered = comm.gather(x_blocks[0])
            for c in range(n):
                whole, handle = gathered
                wait(handle)
                if c + 1 < n:  # the next block's gather runs under this block's GEMMs
                    gathered = comm.gather(x_blocks[c + 1])
                res = train_forward(as_2d(whole), weight1, bias1, weight2, bias2, act, lvl, code, needs)
                saved.append(res[1:])
                out = res[0].reshape(*whole.shape[:-1], res[0].shape[-1])
                outs[c], pending[c] = comm.reduce(out)
            for handle in pending:
                wait(handle)
            out = torch.cat(outs, dim=0) if n > 1 else outs[0]

        ctx.mlp = (act, lvl, code, needs, plan["recompute_fc1"], n, [len(s) for s in saved])
        ctx.comm = comm
        ctx.save_for_backward(
            x if plan["save_x"] else None,
            weight1 if plan["save_weight1"] else None,
            bias1 if plan["save_bias1"] else None,
            weight2 if plan["save_weight2"] else None,
            *[t for s in saved for t in s],
        )
        return out

    @staticmethod
    def backward(ctx, grad_out):
        with autocast_off(grad_out.device.type):
            return PipelinedParallelMLPFunc._backward(ctx, grad_out)

    @staticmethod
    def _backward(ctx, grad_out):
        x, weight1, bias1, weight2, *flat_saved = ctx.saved_tensors
        act, lvl, code, needs, recompute_fc1, n, saved_counts = ctx.mlp
        need_x, need_w1, need_b1, need_w2, need_b2 = needs
        comm = ctx.comm
        backward_half = ops.op_overload("fused_mlp_backward")
        saved, i = [], 0
        for count in saved_counts:
            saved.append(flat_saved[i:i + count])
            i += count
        g_blocks = _blocks(grad_out, n)
        x_blocks = _blocks(x, n)
        gw1, gb1, gw2, gb2 = _Accumulator(), _Accumulator(), _Accumulator(), _Accumulator()
        dx, pending = [None] * n, [None] * n

        def gather_inputs(c):
            return comm.gather(g_blocks[c]), comm.gather(x_blocks[c])

        gathered = gather_inputs(0)
        for c in range(n):
            (g_whole, g_handle), (x_whole, x_handle) = gathered
            wait(g_handle)
            if recompute_fc1:
                wait(x_handle)
                x_handle = None
            if c + 1 < n:
                gathered = gather_inputs(c + 1)
            x2 = None if x_whole is None else as_2d(x_whole)
            grads = iter(backward_half(as_2d(g_whole), x2 if recompute_fc1 else None, weight1, bias1, weight2,
                                       saved[c], act, lvl, code, needs))
            d_pre = next(grads) if need_w1 else None
            grad_x = next(grads) if need_x else None
            gb1.add(next(grads) if need_b1 else None)
            gw2.add(next(grads) if need_w2 else None)
            gb2.add(next(grads) if need_b2 else None)
            if need_x:  # its reduction runs under weight1's gradient GEMM and the next block's
                dx[c], pending[c] = comm.reduce(grad_x.reshape(*g_whole.shape[:-1], grad_x.shape[-1]))
            if need_w1:
                wait(x_handle)
                gw1.add(ops.linear_bias_wgrad(x2, d_pre, False)[0])
        for handle in pending:
            wait(handle)
        grad_x = None
        if need_x:
            grad_x = torch.cat(dx, dim=0) if n > 1 else dx[0]
        d_w1, d_b1, d_w2, d_b2 = ctx.param_dtypes
        return (grad_x, gw1.result(d_w1), gb1.result(d_b1), gw2.result(d_w2), gb2.result(d_b2),
                None, None, None, None, None, None, None)


def pipelined_parallel_mlp(x: Tensor, weight1: Tensor, weight2: Tensor, bias1: Optional[Tensor] = None,
                           bias2: Optional[Tensor] = None, activation: str = "gelu_approx",
                           save_pre_act: bool = True, checkpoint_lvl: int = 0, heuristic="auto",
                           process_group=None, sequence_parallel: bool = True, chunks: int = 1) -> Tensor:
    """fc2(act(fc1(x))) summed over ``process_group`` with the communication pipelined against
    the GEMMs in ``chunks`` row blocks. x: this rank's rows (sequence parallel) or all rows."""
    if process_group is None:
        raise ValueError("pipelined_parallel_mlp needs a process_group")
    return PipelinedParallelMLPFunc.apply(x, weight1, bias1, weight2, bias2, activation, save_pre_act,
                                          checkpoint_lvl, heuristic, process_group, sequence_parallel, chunks)


# ----------------------------------------------------------------------------------------------
# The parallel linear layers. Their other side is not row-wise within the layer pair, so the
# rows of a block are not contiguous in the layer's input or output: a ColumnParallelLinear
# returns all rows rank by rank, a RowParallelLinear reads them so. Block c of every rank is
# therefore copied out of (or into) those rows: one extra pass over the rank-major tensor per
# direction, the price of the overlap here.


def _offsets(rows: int, n: int) -> List[tuple]:
    """(offset, size) of the n blocks of `rows` local rows (torch.tensor_split's sizes)."""
    sizes = [len(b) for b in torch.tensor_split(torch.empty(rows, 0), n)]
    out, off = [], 0
    for s in sizes:
        out.append((off, s))
        off += s
    return out


def _take_rows(t: Tensor, world: int, off: int, size: int) -> Tensor:
    """Rows off..off+size of every rank's part of the rank-major t, as one [world * size, ...]."""
    local = t.shape[0] // world
    return t.reshape(world, local, *t.shape[1:])[:, off:off + size].reshape(world * size, *t.shape[1:]).contiguous()


def _put_rows(dst: Tensor, src: Tensor, world: int, off: int, size: int) -> None:
    local = dst.shape[0] // world
    dst.view(world, local, *dst.shape[1:])[:, off:off + size].copy_(src.view(world, size, *src.shape[1:]))


def _save_linear(ctx, x, weight, on_ops, comm, blocks, world) -> None:
    """What a pipelined linear layer keeps: x for the weight gradient, the weight for the input's."""
    ctx.use_ops, ctx.comm, ctx.blocks, ctx.world = on_ops, comm, blocks, world
    need_x, need_w = ctx.needs_input_grad[:2]
    ctx.save_for_backward(x if need_w else None, weight if need_x else None)


def _add_weight_grads(gw: "_Accumulator", gb: "_Accumulator", x2: Optional[Tensor], g2: Tensor, need_w: bool,
                      need_b: bool, on_ops: bool) -> None:
    """One block's weight and bias gradients, added to the sums."""
    if need_w:
        w_c, b_c = wgrad(x2, g2, need_b, on_ops)
        gw.add(w_c)
        gb.add(b_c)
    elif need_b:
        gb.add(bias_grad(g2))


def _linear_prepare(ctx, x, weight, bias, chunks):
    if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
        raise ValueError(f"chunks must be an integer >= 1, got {chunks!r}")
    dtype, autocast = compute_dtype(x)
    ctx.param_dtypes = (weight.dtype, None if bias is None else bias.dtype)
    x = prepare(x, dtype)
    weight, bias = prepare(weight, dtype, autocast), prepare(bias, dtype, autocast)
    return x, weight, bias, use_ops(x, weight, bias)


class PipelinedColumnLinearFunc(torch.autograd.Function):
    """Sequence-parallel ColumnParallelLinear: out[all rows, rank by rank] = gather(x) @ W^T + b,
    with block c + 1's gather under block c's GEMM; backward reduce-scatters the input gradient
    block by block under the next block's GEMMs, re-gathering x ahead."""

    @staticmethod
    def forward(ctx, x, weight, bias, process_group, chunks):
        with autocast_off(x.device.type):
            x, weight, bias, on_ops = _linear_prepare(ctx, x, weight, bias, chunks)
            world = torch.distributed.get_world_size(process_group)
            blocks = _offsets(x.shape[0], _block_count(x.shape[0], chunks))
            out = x.new_empty((world * x.shape[0], *x.shape[1:-1], weight.shape[0]))
            comm = _Comm(process_group, True)
            gathered = comm.gather(x[blocks[0][0]:blocks[0][0] + blocks[0][1]].contiguous())
            for c, (off, size) in enumerate(blocks):
                whole, handle = gathered
                wait(handle)
                if c + 1 < len(blocks):
                    o, s = blocks[c + 1]
                    gathered = comm.gather(x[o:o + s].contiguous())
                y = linear(as_2d(whole), weight, bias, on_ops)
                _put_rows(out, y.reshape(*whole.shape[:-1], y.shape[-1]), world, off, size)
        _save_linear(ctx, x, weight, on_ops, comm, blocks, world)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        with autocast_off(grad_out.device.type):
            x, weight = ctx.saved_tensors
            need_x, need_w, need_b = ctx.needs_input_grad[:3]
            comm, blocks, world, on_ops = ctx.comm, ctx.blocks, ctx.world, ctx.use_ops
            g = grad_out.contiguous()
            gw, gb = _Accumulator(), _Accumulator()
            dx, pending = [None] * len(blocks), [None] * len(blocks)

            def gather_x(c):
                o, s = blocks[c]
                return comm.gather(x[o:o + s].contiguous()) if need_w else (None, None)

            gathered = gather_x(0)
            for c, (off, size) in enumerate(blocks):
                x_whole, x_handle = gathered
                if c + 1 < len(blocks):
                    gathered = gather_x(c + 1)
                g_c = _take_rows(g, world, off, size)
                g2 = as_2d(g_c)
                if need_x:
                    d = dgrad(weight, g2, on_ops)
                    dx[c], pending[c] = comm.reduce(d.reshape(*g_c.shape[:-1], d.shape[-1]))
                if need_w:
                    wait(x_handle)
                _add_weight_grads(gw, gb, None if x_whole is None else as_2d(x_whole), g2, need_w, need_b, on_ops)
            for handle in pending:
                wait(handle)
        grad_x = (torch.cat(dx, dim=0) if len(dx) > 1 else dx[0]) if need_x else None
        return grad_x, gw.result(ctx.param_dtypes[0]), gb.result(ctx.param_dtypes[1]), None, None


class PipelinedRowLinearFunc(torch.autograd.Function):
    """RowParallelLinear: the partial x @ W^T (+ b on the rank that holds it) reduced across the
    group, reduce-scattered to this rank's rows (sequence parallel) or all-reduced, block c's
    collective under block c + 1's GEMM. Sequence-parallel backward gathers the output gradient
    block by block under the previous block's GEMMs."""

    @staticmethod
    def forward(ctx, x, weight, bias, process_group, sequence_parallel, chunks):
        with autocast_off(x.device.type):
            x, weight, bias, on_ops = _linear_prepare(ctx, x, weight, bias, chunks)
            world = torch.distributed.get_world_size(process_group)
            if sequence_parallel and x.shape[0] % world != 0:
                raise ValueError(f"RowParallelLinear: x.shape[0] = {x.shape[0]} rows must be divisible by the "
                                 f"world size {world} with sequence_parallel=True")
            rows = x.shape[0] // world if sequence_parallel else x.shape[0]
            blocks = _offsets(rows, _block_count(rows, chunks))
            comm = _Comm(process_group, sequence_parallel)
            outs, pending = [None] * len(blocks), [None] * len(blocks)
            for c, (off, size) in enumerate(blocks):
                x_c = _take_rows(x, world, off, size) if sequence_parallel else x[off:off + size]
                y = linear(as_2d(x_c), weight, bias, on_ops)
                outs[c], pending[c] = comm.reduce(y.reshape(*x_c.shape[:-1], y.shape[-1]))
            for handle in pending:
                wait(handle)
            out = torch.cat(outs, dim=0) if len(outs) > 1 else outs[0]
        _save_linear(ctx, x, weight, on_ops, comm, blocks, world)
        ctx.sp, ctx.x_shape = sequence_parallel, x.shape
        return out

    @staticmethod
    def backward(ctx, grad_out):
        with autocast_off(grad_out.device.type):
            x, weight = ctx.saved_tensors
            need_x, need_w, need_b = ctx.needs_input_grad[:3]
            comm, blocks, world, sp, on_ops = ctx.comm, ctx.blocks, ctx.world, ctx.sp, ctx.use_ops
            g = grad_out.contiguous()
            dx = g.new_empty(ctx.x_shape) if need_x else None
            gw, gb = _Accumulator(), _Accumulator()
            g_blocks = [g[o:o + s].contiguous() for o, s in blocks]
            gathered = comm.gather(g_blocks[0])
            for c, (off, size) in enumerate(blocks):
                g_whole, handle = gathered
                wait(handle)
                if c + 1 < len(blocks):
                    gathered = comm.gather(g_blocks[c + 1])
                g2 = as_2d(g_whole)
                if need_x:
                    d = dgrad(weight, g2, on_ops).reshape(*g_whole.shape[:-1], ctx.x_shape[-1])
                    if sp:
                        _put_rows(dx, d, world, off, size)
                    else:
                        dx[off:off + size].copy_(d)
                x_c = None
                if need_w:
                    x_c = as_2d(_take_rows(x, world, off, size) if sp else x[off:off + size])
                _add_weight_grads(gw, gb, x_c, g2, need_w, need_b, on_ops)
        return dx, gw.result(ctx.param_dtypes[0]), gb.result(ctx.param_dtypes[1]), None, None, None
