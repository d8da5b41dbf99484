"""Synchronised batch norm for data-parallel layouts, on CPU/gloo as well as NCCL.

The technique is cross-GPU batch normalisation as in MegDet (Peng et al., "MegDet: A Large
Mini-Batch Object Detector", CVPR 2018) and torch's ``nn.SyncBatchNorm``: in training, each
channel's mean and variance are those of the micro-batches of all ranks of a data-parallel group
together, as if one process saw the whole batch. torch's own ``SyncBatchNorm`` refuses CPU tensors
in 2.13; this one is plain autograd over two ``all_reduce`` (SUM) collectives: first of the local
per-channel sums and element counts (mean = sum / count), then of the local sums of squared
deviations from that mean (two passes, numerically like one process). Their backward is again an
``all_reduce`` (SUM) of the gradient, so input and parameter gradients are those of one process.

:func:`apply_sync_batchnorm` converts modules in place by swapping ``module.__class__`` to a cached
subclass of the original class: parameter and buffer names, the state_dict and
``_check_input_dim`` are unchanged.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from meshtrain.errors import ConfigError
from meshtrain.parallel.mesh import as_process_group


class _AllReduceSum(torch.autograd.Function):
    """``all_reduce`` (SUM) over ``group`` whose backward is the ``all_reduce`` of the gradient."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        out = tensor.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=ctx.group)
        return grad, None


def all_reduce_sum(tensor: torch.Tensor, group) -> torch.Tensor:
    """Autograd-aware SUM all-reduce of ``tensor`` over ``group`` (a new tensor)."""
    return _AllReduceSum.apply(tensor, group)


class _GroupRef:
    """Holds a process group on a module: ``copy.deepcopy`` keeps the same group (by reference);
    pickling drops it (a group cannot cross processes), so an unpickled module is unsynchronised
    until :func:`apply_sync_batchnorm` is called on it again."""

    __slots__ = ("group", "size")

    def __init__(self, group):
        self.group = group
        self.size = 1 if group is None else dist.get_world_size(group)

    def __deepcopy__(self, memo):
        return self

    def __reduce__(self):
        return _GroupRef, (None,)


class _SyncMixin:
    """The forward of a converted module (mixed in before the original class)."""

    _sync_base: type  # the original class
    _sync_group: _GroupRef

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        ref = self.__dict__.get("_sync_group")
        if not self.training or ref is None or ref.size == 1:
            # torch's SyncBatchNorm.forward would sync over WORLD (and refuse CPU): plain BN
            base = _BatchNorm if issubclass(self._sync_base, nn.SyncBatchNorm) else self._sync_base
            return base.forward(self, input)
        self._check_input_dim(input)
        return _sync_forward(self, input, ref.group)

    def __reduce_ex__(self, protocol):
        # rebuild through the cache: a dynamically made class cannot be pickled by name
        return _new_synced, (self._sync_base,), self.__dict__


_CLASSES: dict[type, type] = {}


def synced_class(base: type) -> type:
    """The cached subclass of the ``_BatchNorm`` class ``base`` with a synchronised forward."""
    if base not in _CLASSES:
        _CLASSES[base] = type(
            f"Synced{base.__name__}", (_SyncMixin, base),
            {"_sync_base": base, "__module__": __name__},
        )
    return _CLASSES[base]


def _new_synced(base: type):
    return object.__new__(synced_class(base))


def apply_sync_batchnorm(model: nn.Module, group) -> int:
    """Make every ``_BatchNorm`` submodule of ``model`` (itself included) normalise over the
    micro-batches of all ranks of ``group`` in training; returns how many were converted.

    In place; names, state_dict and eval behaviour are unchanged. ``group`` None or of size 1:
    the modules behave like the originals. Calling it again changes the group.
    """
    if not isinstance(model, nn.Module):
        raise ConfigError(f"apply_sync_batchnorm expects an nn.Module, got {type(model).__name__}")
    ref = _GroupRef(as_process_group(group))
    count = 0
    for module in model.modules():
        if isinstance(module, _BatchNorm):
            base = getattr(type(module), "_sync_base", type(module))
            module.__class__ = synced_class(base)
            module._sync_group = ref
            count += 1
    return count


def _sync_forward(bn: _BatchNorm, x: torch.Tensor, group) -> torch.Tensor:
    """Training forward: batch statistics over all ranks of ``group``; updates running stats."""
    channels = x.shape[1]
    dims = [0] + list(range(2, x.dim()))
    shape = [1, channels] + [1] * (x.dim() - 2)
    # compute in float32 at least (bf16/fp16 inputs), float64 for a float64 model
    dtype = torch.promote_types(x.dtype, torch.float32)
    xf = x.to(dtype)
    local_count = x.numel() // channels if channels else 0
    # one all-reduce for the sums and the count (fp64: exact counts, sums of many ranks)
    packed = torch.cat([
        xf.sum(dims).double(),
        torch.full((1,), float(local_count), dtype=torch.float64, device=x.device),
    ])
    packed = all_reduce_sum(packed, group)
    count = packed[channels:].detach()
    mean = (packed[:channels] / count).to(dtype)
    centered = xf - mean.view(shape)
    sq_dev = all_reduce_sum(centered.square().sum(dims).double(), group)
    var = (sq_dev / count).to(dtype)  # biased: for normalisation
    scale = torch.rsqrt(var + bn.eps)
    if bn.weight is not None:
        scale = scale * bn.weight.to(dtype)
    y = centered * scale.view(shape)
    if bn.bias is not None:
        y = y + bn.bias.to(dtype).view(shape)
    if bn.track_running_stats and bn.running_mean is not None:
        _update_running_stats(bn, mean.detach(), (sq_dev.detach() / (count - 1)).to(dtype))
    return y.to(x.dtype)


@torch.no_grad()
def _update_running_stats(bn: _BatchNorm, mean: torch.Tensor, unbiased_var: torch.Tensor) -> None:
    """As torch's BatchNorm: momentum, or a cumulative average when momentum is None."""
    factor = 0.0 if bn.momentum is None else bn.momentum
    if bn.num_batches_tracked is not None:
        bn.num_batches_tracked.add_(1)
        if bn.momentum is None:
            factor = 1.0 / float(bn.num_batches_tracked)
    bn.running_mean.mul_(1 - factor).add_(mean.to(bn.running_mean.dtype), alpha=factor)
    bn.running_var.mul_(1 - factor).add_(unbiased_var.to(bn.running_var.dtype), alpha=factor)
