"""Sequence parallelism's all-gathers and reduce-scatters on the sequence dim (Korthikanti et al.
2022) as Megatron-LM does them: two autograd functions on local tensors, used by the
tensor-parallel plans' styles below instead of DTensor's redistribution where the tp axis is
meshtrain's shared-memory group (CPU processes of one host); on any other group (gloo, NCCL)
DTensor's own redistribution runs.

Between a block's pairs of matrices the activations are sharded on the sequence dim. Before a
column-parallel pair they are all-gathered (backward: the partial input gradients are
reduce-scattered back to shards); after a row-parallel pair the partial sums are
reduce-scattered (backward: the shards' gradients are all-gathered). DTensor's
``redistribute`` does the same with a plan per call and, on a dim other than 0, one more copy
of the activation (functional collectives gather on dim 0, then ``torch.cat`` the chunks; the
reduce-scatter the other way round). On the tp axis's shared-memory group
(``shm/collectives.py``) the chunks are received straight into their place in the output and
sent straight from theirs. Measured (benchmarks/tensor_parallel.py, "tp+sp dtensor" rows; two
runs on 2026-11-28): a step through DTensor's redistribution took 1.10-1.16x (L = 2, 4 blocks)
of one through these functions on the shared-memory group, but 0.88-0.94x on gloo, where the
functions had run torch's functional collectives: so on gloo, NCCL and any group but the
shared-memory one DTensor's redistribution runs (torch's own facility, at least as fast where
measured; NCCL not yet measured). Under ``CommDebugMode`` (``tp_debug.comm_counts``) and in a
graph torch.compile traces DTensor's redistribution runs too (the autograd functions gave
wrong gradients under torch.compile in torch 2.13).

The replicated parameters used on sequence shards (the norms) get a partial gradient on each
rank: :func:`complete_partial_grads` sums them all once per step (the Trainer, after the last
micro-batch), as Megatron-LM's ``finalize_model_grads``.

Styles: :class:`GatherSequenceInput` (a module's first input, e.g. attention's shared q/k/v
input), :class:`ColwiseFromSequence` (``ColwiseParallel`` with ``input_layouts=Shard(d)``) and
:class:`RowwiseToSequence` (``RowwiseParallel`` with ``output_layouts=Shard(d)``). With other
layouts the two subclasses are torch's styles unchanged.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn as nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel
from torch.profiler import record_function
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

from meshtrain.parallel.shm.collectives import SharedMemoryCollectives

# torch 2.13's names; older ones (the GPU image's 2.11) have the *_tensor ones alone
_ALL_GATHER = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor
_REDUCE_SCATTER = getattr(funcol, "reduce_scatter_single", None) or funcol.reduce_scatter_tensor


# True: DTensor's own redistribution everywhere instead of the two functions (what
# benchmarks/tensor_parallel.py's "tp+sp dtensor" rows time against them; never set in a run)
DTENSOR_REDISTRIBUTE = False


def _direct(group) -> bool:
    """Whether the shared-memory group's own strided exchange may run: not while a dispatch
    mode (e.g. CommDebugMode) needs to see the collectives, nor in a graph torch.compile
    traces (which takes functional collectives only)."""
    return (isinstance(group, SharedMemoryCollectives) and not torch.compiler.is_compiling()
            and not _get_current_dispatch_mode_stack())


def _done(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.wait() if isinstance(tensor, funcol.AsyncCollectiveTensor) else tensor


def all_gather_on(local: torch.Tensor, mesh, dim: int) -> torch.Tensor:
    """Every rank's ``local`` of the 1-D ``mesh`` put together on ``dim`` (rank order)."""
    group = mesh.get_group()
    if not _direct(group):
        return _done(_ALL_GATHER(local.contiguous(), dim, (mesh, 0)))
    shape = list(local.shape)
    shape[dim] *= group.size()
    out = local.new_empty(shape)
    with record_function("meshtrain_shm::all_gather_on"):  # for profiles: a collective
        group.all_gather_on(out, local, dim)
    return out


def reduce_scatter_on(whole: torch.Tensor, mesh, dim: int) -> torch.Tensor:
    """This rank's chunk on ``dim`` of the sum of every rank's ``whole`` over the 1-D ``mesh``."""
    group = mesh.get_group()
    if not _direct(group):
        return _done(_REDUCE_SCATTER(whole.contiguous(), "sum", dim, (mesh, 0)))
    shape = list(whole.shape)
    shape[dim] //= group.size()
    out = whole.new_empty(shape)
    with record_function("meshtrain_shm::reduce_scatter_on"):
        group.reduce_scatter_on(out, whole, dim)
    return out


class _Gather(torch.autograd.Function):
    """Sequence shard -> the whole sequence as a replicated DTensor; backward: the gradient's
    partial sums reduce-scattered back to this rank's shard."""

    @staticmethod
    def forward(ctx, local, mesh, dim):
        ctx.mesh, ctx.dim = mesh, dim
        return DTensor.from_local(all_gather_on(local, mesh, dim), mesh, [Replicate()],
                                  run_check=False)

    @staticmethod
    def backward(ctx, grad):
        mesh, dim = ctx.mesh, ctx.dim
        if not isinstance(grad, DTensor):  # a plain gradient: the same on every rank
            return grad.chunk(mesh.size(), dim)[mesh.get_local_rank()], None, None
        (placement,) = grad.placements
        if placement.is_partial() and placement.reduce_op == "sum":
            local = reduce_scatter_on(grad.to_local(), mesh, dim)
        elif placement.is_replicate():
            local = grad.to_local().chunk(mesh.size(), dim)[mesh.get_local_rank()]
        else:
            local = grad.redistribute(mesh, [Shard(dim)]).to_local()
        return local, None, None


class _Scatter(torch.autograd.Function):
    """Partial sums -> this rank's sequence shard of their total; backward: the shards'
    gradients all-gathered (every rank's partial sum feeds the whole total)."""

    @staticmethod
    def forward(ctx, partial, mesh, dim):
        ctx.mesh, ctx.dim = mesh, dim
        return reduce_scatter_on(partial, mesh, dim)

    @staticmethod
    def backward(ctx, grad):
        return all_gather_on(grad.contiguous(), ctx.mesh, ctx.dim), None, None


def gather_sequence(x: torch.Tensor, mesh, dim: int) -> DTensor:
    """``x``, this rank's shard on ``dim`` (a plain tensor or a DTensor sharded so), as the
    whole replicated DTensor: through :class:`_Gather` on the shared-memory group, else (any
    other group, any other DTensor, a graph torch.compile traces) DTensor's redistribution."""
    dtensor = DTENSOR_REDISTRIBUTE or not _direct(mesh.get_group())
    if not isinstance(x, DTensor):
        if dtensor:
            x = DTensor.from_local(x, mesh, [Shard(dim)], run_check=False)
        else:
            return _Gather.apply(x, mesh, dim % x.dim())
    if dtensor or x.placements not in ((Shard(dim),), (Shard(dim % x.dim()),)):
        return x.redistribute(mesh, [Replicate()])
    return _Gather.apply(x.to_local(), mesh, dim % x.dim())


def scatter_partial(x: DTensor, mesh, dim: int) -> torch.Tensor:
    """A partial-sum DTensor's total, this rank's shard of it on ``dim`` (a plain tensor)."""
    local = x.to_local(grad_placements=[Replicate()])  # the total's gradient reaches every part
    return _Scatter.apply(local, mesh, dim % local.dim())


def _sum_partial(x) -> bool:
    return (isinstance(x, DTensor) and len(x.placements) == 1 and x.placements[0].is_partial()
            and x.placements[0].reduce_op == "sum")


class GatherSequenceInput(ParallelStyle):
    """A module's first positional input, sharded on ``dim``, all-gathered into a replicated
    DTensor (``PrepareModuleInput(input_layouts=(Shard(dim), ...), desired_input_layouts=
    (Replicate(), ...))``); the other inputs pass untouched."""

    def __init__(self, dim: int = 1):
        super().__init__()
        self.dim = dim

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        def gather_first(_, args):
            return (gather_sequence(args[0], device_mesh, self.dim), *args[1:])

        module.register_forward_pre_hook(gather_first)
        return module


class ColwiseFromSequence(ColwiseParallel):
    """``ColwiseParallel``; an input sharded on the sequence dim (``input_layouts=Shard(d)``) is
    gathered by :func:`gather_sequence`."""

    @staticmethod
    def _prepare_input_fn(input_layouts, desired_input_layouts, mod, inputs, device_mesh):
        (layout,) = input_layouts
        if isinstance(layout, Shard) and desired_input_layouts == (Replicate(),):
            return gather_sequence(inputs[0], device_mesh, layout.dim)
        return ColwiseParallel._prepare_input_fn(input_layouts, desired_input_layouts, mod,
                                                 inputs, device_mesh)


class RowwiseToSequence(RowwiseParallel):
    """``RowwiseParallel``; with ``output_layouts=Shard(d)`` the partial sums are
    reduce-scattered by :func:`scatter_partial`."""

    @staticmethod
    def _prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh):
        (layout,) = output_layouts
        if isinstance(layout, Shard) and _sum_partial(outputs) and \
                _direct(device_mesh.get_group()) and not DTENSOR_REDISTRIBUTE:
            shard = scatter_partial(outputs, device_mesh, layout.dim)
            return shard if use_local_output else DTensor.from_local(
                shard, device_mesh, [layout], run_check=False)
        return RowwiseParallel._prepare_output_fn(output_layouts, use_local_output, mod,
                                                  outputs, device_mesh)


def complete_partial_grads(parameters) -> int:
    """Sum every partial gradient (a replicated parameter's, computed on part of the
    activations) over its mesh: flattened, one all-reduce per mesh and dtype; how many.
    Gradients already in their parameter's placements are left alone (under FSDP2 its
    reduce-scatter has summed them)."""
    from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

    buckets: dict[tuple, list[DTensor]] = {}
    for param in parameters:
        grad = param.grad
        if not isinstance(grad, DTensor) or grad.placements == param.placements:
            continue
        if all(g == p or (isinstance(g, Partial) and g.reduce_op == "sum"
                          and isinstance(p, Replicate))
               for g, p in zip(grad.placements, param.placements)):
            buckets.setdefault((grad.device_mesh, grad.dtype, grad.placements), []).append(param)
        else:  # not a plain sum: DTensor's own redistribution
            param.grad = grad.redistribute(param.device_mesh, param.placements)
    reduces = 0
    for (mesh, _, placements), params in buckets.items():
        local = [p.grad.to_local() for p in params]
        flat = _flatten_dense_tensors(local)
        for dim, placement in enumerate(placements):
            if isinstance(placement, Partial):
                dist.all_reduce(flat, group=mesh.get_group(dim))
                reduces += 1
        for param, summed in zip(params, _unflatten_dense_tensors(flat, local)):
            param.grad = DTensor.from_local(summed, mesh, param.placements, run_check=False)
    return reduces
