"""Collectives for tensor and sequence parallelism, on any torch.distributed backend.

Three layers:

* raw helpers -- ``all_gather_raw``, ``reduce_scatter_raw``, ``all_reduce_raw`` -- run one
  collective along dim 0 and return ``(output, handle)``. ``handle`` is None for a synchronous
  call; with ``async_op=True`` it is an object whose ``wait()`` makes ``output`` valid. The
  autograd Functions in ``functional.py`` use these to overlap communication with GEMMs.
* autograd forms -- ``all_gather``, ``reduce_scatter``, ``all_reduce``, ``copy_to_group`` --
  differentiable versions used by the parallel modules. Their backward follows the
  tensor-parallel convention that every rank computes the same loss from replicated values: the
  gradient of a gather is a reduce-scatter (each rank's use of the gathered tensor contributes a
  partial gradient), the gradient of a reduce-scatter is a gather, the gradient of an all-reduce
  is passed through unchanged (every rank already holds the gradient of the replicated sum), and
  ``copy_to_group`` is the all-reduce's conjugate: the identity in forward (a replicated input
  entering layers that each use it for their own shard), the sum of the ranks' partial gradients
  in backward.
* model helpers -- ``sync_shared_params``, ``allreduce_sequence_parallel_grad`` and
  ``get_dim_for_local_rank``.

Backends: NCCL (and other GPU backends) get the single-buffer collectives
(``all_gather_into_tensor``, ``reduce_scatter_tensor``). Gloo and MPI have not always had them,
so there the helpers use the list form of ``all_gather`` (written straight into views of the
output) and build reduce-scatter out of an ``all_reduce`` of a copy followed by a slice (for an
asynchronous call the slice is taken by the returned handle's ``wait()``). The result is
identical; only the traffic differs, which does not matter on the CPU.
"""
from typing import Any, Optional, Tuple

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

__all__ = [
    "all_gather_raw",
    "reduce_scatter_raw",
    "all_reduce_raw",
    "all_gather",
    "reduce_scatter",
    "all_reduce",
    "copy_to_group",
    "sync_shared_params",
    "allreduce_sequence_parallel_grad",
    "get_dim_for_local_rank",
]

# Backends whose single-buffer tensor collectives are avoided (see the module docstring).
# Tests may clear this set to exercise the native path on a backend that does support them.
LIST_COLLECTIVE_BACKENDS = {"gloo", "mpi"}


class _DoneHandle:
    """Handle of an 'async' collective that had nothing to do (world size 1)."""

    def wait(self, timeout: Any = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


_DONE = _DoneHandle()


class _FinishingHandle:
    """Wraps a backend's work handle: ``wait()`` waits for it, then runs ``finish`` (once), which
    completes the output the caller already holds."""

    def __init__(self, work, finish):
        self._work, self._finish = work, finish

    def wait(self, timeout: Any = None) -> bool:
        if self._finish is not None:
            self._work.wait() if timeout is None else self._work.wait(timeout)
            self._finish()
            self._finish = self._work = None  # drop the buffer the closure holds
        return True

    def is_completed(self) -> bool:
        return self._finish is None or self._work.is_completed()


def _uses_list_collectives(process_group: Optional[ProcessGroup]) -> bool:
    return str(dist.get_backend(process_group)).lower() in LIST_COLLECTIVE_BACKENDS


def _world_size(process_group: Optional[ProcessGroup]) -> int:
    return dist.get_world_size(process_group)


def all_gather_raw(input_: Tensor, process_group: Optional[ProcessGroup],
                   async_op: bool = False) -> Tuple[Tensor, Any]:
    """Concatenate every rank's ``input_`` along dim 0: ``[n, ...] -> [world_size * n, ...]``.

    Every rank must pass a tensor of the same shape and dtype. Returns ``(output, handle)``;
    with ``async_op=True`` call ``handle.wait()`` before reading ``output``.
    """
    world_size = _world_size(process_group)
    if world_size == 1:
        return input_, (_DONE if async_op else None)
    input_ = input_.contiguous()
    output = input_.new_empty((world_size * input_.shape[0],) + tuple(input_.shape[1:]))
    if _uses_list_collectives(process_group):
        # Dim-0 slices of a contiguous tensor are contiguous views: the backend writes into
        # `output` directly, so nothing is left to do after wait().
        n = input_.shape[0]
        handle = dist.all_gather([output.narrow(0, r * n, n) for r in range(world_size)], input_,
                                 group=process_group, async_op=async_op)
    else:
        handle = dist.all_gather_into_tensor(output, input_, group=process_group, async_op=async_op)
    return output, handle


def reduce_scatter_raw(input_: Tensor, process_group: Optional[ProcessGroup],
                       async_op: bool = False) -> Tuple[Tensor, Any]:
    """Sum ``input_`` over ranks and give rank r the r-th of ``world_size`` equal dim-0 slices.

    ``input_.shape[0]`` must be divisible by the world size. Returns ``(output, handle)``.
    """
    world_size = _world_size(process_group)
    if world_size == 1:
        return input_, (_DONE if async_op else None)
    if input_.shape[0] % world_size != 0:
        raise ValueError(
            f"reduce_scatter_raw: input_.shape[0] = {input_.shape[0]} is not divisible by the "
            f"world size {world_size}"
        )
    n = input_.shape[0] // world_size
    if _uses_list_collectives(process_group):
        # All-reduce a private copy, then copy this rank's slice out of it, so that the
        # world_size-times larger buffer is freed as soon as the result is there.
        buffer = input_.clone(memory_format=torch.contiguous_format)
        output = input_.new_empty((n,) + tuple(input_.shape[1:]))
        rank = dist.get_rank(process_group)
        work = dist.all_reduce(buffer, op=dist.ReduceOp.SUM, group=process_group, async_op=async_op)

        def finish():
            output.copy_(buffer.narrow(0, rank * n, n))

        if not async_op:
            finish()
            return output, None
        return output, _FinishingHandle(work, finish)
    input_ = input_.contiguous()
    output = input_.new_empty((n,) + tuple(input_.shape[1:]))
    handle = dist.reduce_scatter_tensor(output, input_, op=dist.ReduceOp.SUM, group=process_group,
                                        async_op=async_op)
    return output, handle


def all_reduce_raw(input_: Tensor, process_group: Optional[ProcessGroup],
                   async_op: bool = False) -> Tuple[Tensor, Any]:
    """Sum ``input_`` over ranks, in place when ``input_`` is contiguous. Returns ``(result, handle)``.

    A non-contiguous ``input_`` is reduced in a contiguous copy, which is what is returned.
    """
    world_size = _world_size(process_group)
    if world_size == 1:
        return input_, (_DONE if async_op else None)
    input_ = input_.contiguous()
    handle = dist.all_reduce(input_, op=dist.ReduceOp.SUM, group=process_group, async_op=async_op)
    return input_, handle


# --------------------------------------------------------------------------------------------
# Autograd forms


class AllGatherFunc(torch.autograd.Function):
    """Gather along dim 0 in forward; reduce-scatter the gradient in backward."""

    @staticmethod
    def forward(ctx, input_: Tensor, process_group: Optional[ProcessGroup]) -> Tensor:
        ctx.process_group = process_group
        output, _ = all_gather_raw(input_, process_group)
        return output

    @staticmethod
    def backward(ctx, grad_output: Tensor):
        grad_input, _ = reduce_scatter_raw(grad_output, ctx.process_group)
        return grad_input, None


class ReduceScatterFunc(torch.autograd.Function):
    """Reduce-scatter along dim 0 in forward; gather the gradient in backward."""

    @staticmethod
    def forward(ctx, input_: Tensor, process_group: Optional[ProcessGroup]) -> Tensor:
        ctx.process_group = process_group
        output, _ = reduce_scatter_raw(input_, process_group)
        return output

    @staticmethod
    def backward(ctx, grad_output: Tensor):
        grad_input, _ = all_gather_raw(grad_output, ctx.process_group)
        return grad_input, None


try:
    from torch.autograd.graph import increment_version as _increment_version
except ImportError:  # older torch: never reduce in place
    _increment_version = None


def _can_reduce_in_place(t: Tensor) -> bool:
    """In place only on a contiguous non-leaf: a leaf that requires grad (or a view of one) is a
    user's parameter or input, and must not change under them."""
    base = t._base if t._base is not None else t
    return (_increment_version is not None and t.is_contiguous()
            and not (base.is_leaf and base.requires_grad))


class AllReduceFunc(torch.autograd.Function):
    """Sum over ranks in forward (in place where autograd allows it); pass the gradient through."""

    @staticmethod
    def forward(ctx, input_: Tensor, process_group: Optional[ProcessGroup]) -> Tensor:
        ctx.process_group = process_group
        if _world_size(process_group) == 1:
            return input_
        if _can_reduce_in_place(input_):
            # The typical input is a fresh GEMM output that nothing else holds: reduce it in
            # place. c10d does not bump the version counter, so do it here: anything that saved
            # this tensor for its backward then fails loudly instead of using the sum.
            # (Not mark_dirty: autograd refuses it when the input is a view made inside another
            # custom Function, as FusedDenseFunc's output is.)
            all_reduce_raw(input_, process_group)
            _increment_version(input_)
            return input_
        output, _ = all_reduce_raw(input_.clone(memory_format=torch.contiguous_format), process_group)
        return output

    @staticmethod
    def backward(ctx, grad_output: Tensor):
        # The sum is replicated: every rank holds it and runs the same downstream computation,
        # so every rank already holds d(loss)/d(sum), which is also d(loss)/d(its own term).
        return grad_output, None


class CopyToGroupFunc(torch.autograd.Function):
    """The identity in forward; sum the gradient over ranks in backward (AllReduceFunc's conjugate)."""

    @staticmethod
    def forward(ctx, input_: Tensor, process_group: Optional[ProcessGroup]) -> Tensor:
        ctx.process_group = process_group
        return input_

    @staticmethod
    def backward(ctx, grad_output: Tensor):
        if _world_size(ctx.process_group) == 1:
            return grad_output, None
        # A copy: the gradient autograd hands over may be shared with another input's.
        grad_input, _ = all_reduce_raw(grad_output.clone(memory_format=torch.contiguous_format), ctx.process_group)
        return grad_input, None


def all_gather(input_: Tensor, process_group: Optional[ProcessGroup]) -> Tensor:
    """Differentiable gather along dim 0 (backward: reduce-scatter)."""
    return AllGatherFunc.apply(input_, process_group)


def reduce_scatter(input_: Tensor, process_group: Optional[ProcessGroup]) -> Tensor:
    """Differentiable reduce-scatter (sum) along dim 0 (backward: all-gather)."""
    return ReduceScatterFunc.apply(input_, process_group)


def all_reduce(input_: Tensor, process_group: Optional[ProcessGroup]) -> Tensor:
    """Differentiable all-reduce (sum) of partial results into a replicated one (backward:
    identity, see the module docstring). May reuse ``input_``'s memory."""
    return AllReduceFunc.apply(input_, process_group)


def copy_to_group(input_: Tensor, process_group: Optional[ProcessGroup]) -> Tensor:
    """Differentiable identity for an input replicated on every rank of ``process_group`` that
    each rank uses for its own shard of the work (a column-parallel layer without sequence
    parallelism): backward sums the ranks' partial gradients (all-reduce)."""
    return CopyToGroupFunc.apply(input_, process_group)


# --------------------------------------------------------------------------------------------
# Model helpers


def _marked_params(model: torch.nn.Module, marker: str):
    """(name, param) for params carrying a truthy `marker` attribute, in a rank-independent order."""
    return sorted(((n, p) for n, p in model.named_parameters() if getattr(p, marker, False)),
                  key=lambda item: item[0])


def sync_shared_params(model: torch.nn.Module, process_group: Optional[ProcessGroup]) -> None:
    """Copy every parameter marked ``_shared_params`` from rank 0 of ``process_group`` to the rest.

    Use it after initialisation so that replicated parameters (layer norms, embeddings, ...)
    start identical on every rank. All ranks must hold the same set of marked parameters.
    """
    if _world_size(process_group) == 1:
        return
    params = _marked_params(model, "_shared_params")
    if not params:
        return
    group = process_group if process_group is not None else dist.group.WORLD
    src = dist.get_global_rank(group, 0)
    with torch.no_grad():
        pending = []
        for _, p in params:
            buf = p.data if p.data.is_contiguous() else p.data.contiguous()
            pending.append((p, buf, dist.broadcast(buf, src=src, group=process_group, async_op=True)))
        for p, buf, handle in pending:
            handle.wait()
            if buf.data_ptr() != p.data.data_ptr():
                p.data.copy_(buf)


def allreduce_sequence_parallel_grad(model: torch.nn.Module,
                                     process_group: Optional[ProcessGroup]) -> None:
    """Sum over ``process_group`` the gradients of parameters marked ``_sequence_parallel``.

    With sequence parallelism a replicated parameter (a layer norm, say) sees only this rank's
    slice of the sequence, so its gradient is partial; call this after ``backward()`` and before
    the optimizer step. Parameters without a gradient are skipped; every rank must have
    gradients for the same marked parameters.
    """
    if _world_size(process_group) == 1:
        return
    grads = [p.grad for _, p in _marked_params(model, "_sequence_parallel") if p.grad is not None]
    if not grads:
        return
    # One all-reduce per dtype over a flat buffer, then copy back.
    by_dtype = {}
    for g in grads:
        by_dtype.setdefault((g.dtype, g.device), []).append(g)
    for key in sorted(by_dtype, key=str):
        group = by_dtype[key]
        flat = torch.cat([g.reshape(-1) for g in group])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=process_group)
        offset = 0
        for g in group:
            n = g.numel()
            g.copy_(flat[offset:offset + n].view_as(g))
            offset += n


def get_dim_for_local_rank(dim: int, world_size: int, local_rank: int, multiple_of: int = 1) -> int:
    """Size of ``local_rank``'s shard when ``dim`` is split over ``world_size`` ranks.

    ``dim`` is cut in units of ``multiple_of`` (a head dimension, say); when the units do not
    divide evenly, the first ``units % world_size`` ranks get one unit more. The shards add up
    to ``dim``. Example: dim=10, world_size=4, multiple_of=1 -> 3, 3, 2, 2.
    """
    if multiple_of < 1:
        raise ValueError(f"multiple_of must be >= 1, got {multiple_of}")
    if world_size < 1 or not 0 <= local_rank < world_size:
        raise ValueError(f"need 0 <= local_rank < world_size, got local_rank={local_rank}, "
                         f"world_size={world_size}")
    if dim % multiple_of != 0:
        raise ValueError(f"dim={dim} is not a multiple of multiple_of={multiple_of}")
    units = dim // multiple_of
    base, extra = divmod(units, world_size)
    return (base + (1 if local_rank < extra else 0)) * multiple_of
