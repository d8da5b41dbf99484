"""The global batch for contrastive losses (in-batch negatives across data-parallel ranks).

A CLIP/SimCLR-style loss compares each local query with the keys of the whole global batch:
:func:`gather_batch` all-gathers a tensor over the data-parallel group (rank order) and says which
rows are this rank's. The collective is an all-gather whose backward is its adjoint, a
reduce-scatter (SUM): the gradients that all ranks' losses put on the gathered tensor are summed
and each rank gets its own rows (``_functional_collectives.all_gather_single``, autograd-aware;
runs on gloo and NCCL).

The group comes from a scope the training engine enters around forward and loss::

    with batch_group(dp_group):
        loss = model_and_loss(batch)   # may call gather_batch(embeddings)

Outside such a scope (or with a group of one rank) ``gather_batch`` is the identity.
"""

from __future__ import annotations

import contextlib
from contextvars import ContextVar

import torch
import torch.distributed as dist
try:
    from torch.distributed._functional_collectives import all_gather_single
except ImportError:  # torch < 2.13 (e.g. the 2.11 of the GPU image): the same autograd-aware gather
    from torch.distributed._functional_collectives import (
        all_gather_tensor_autograd as all_gather_single,
    )

from meshtrain.errors import ConfigError
from meshtrain.parallel.mesh import as_process_group

_BATCH_GROUP: ContextVar = ContextVar("meshtrain_batch_group", default=None)
_MAX_DIMS = 8  # dims compared by the shape check (more are rare)


@contextlib.contextmanager
def batch_group(group):
    """Within this scope :func:`gather_batch` gathers over ``group`` (a ProcessGroup, a 1-D
    DeviceMesh, or None for no gathering); the previous group is restored on exit."""
    token = _BATCH_GROUP.set(as_process_group(group))
    try:
        yield
    finally:
        _BATCH_GROUP.reset(token)


def current_batch_group():
    """The group :func:`gather_batch` would use now (None outside :func:`batch_group`)."""
    return _BATCH_GROUP.get()


def gather_batch(x: torch.Tensor, *, check_sizes: bool = True) -> tuple[torch.Tensor, slice]:
    """``x`` of every rank of the current data-parallel group, concatenated along dim 0 in rank
    order, and the slice of the rows that are this rank's.

    Autograd-aware: the backward sums the gradients of all ranks for the gathered tensor and hands
    each rank its own rows. Every rank must pass the same shape; ``check_sizes`` verifies it with
    an all-gather of the shapes (a few bytes; on GPU it also waits for the device) and raises
    ``ConfigError`` if they differ (e.g. a smaller last batch: use ``drop_last=True``).
    Outside a data-parallel scope: ``(x, slice(0, len(x)))``.
    """
    if x.dim() == 0:
        raise ConfigError("gather_batch needs a tensor with a batch dimension, got a scalar")
    group = _BATCH_GROUP.get()
    if group is None or dist.get_world_size(group) == 1:
        return x, slice(0, x.shape[0])
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if check_sizes:
        _check_same_shape(x, group, world)
    n = x.shape[0]
    gathered = all_gather_single(x.contiguous(), 0, group)
    return gathered, slice(rank * n, (rank + 1) * n)


def _check_same_shape(x: torch.Tensor, group, world: int) -> None:
    # every rank sends the same number of elements: (ndim, first _MAX_DIMS sizes, -1 padding)
    header = [x.dim(), *x.shape[:_MAX_DIMS]]
    local = torch.full((_MAX_DIMS + 1,), -1, dtype=torch.int64)
    local[: len(header)] = torch.tensor(header, dtype=torch.int64)
    shapes = all_gather_single(local.to(x.device), 0, group).view(world, -1).tolist()
    if any(s != shapes[0] for s in shapes):
        readable = [tuple(s[1:1 + s[0]]) for s in shapes]
        raise ConfigError(
            "gather_batch needs the same shape on every data-parallel rank, got (rank: shape) "
            + ", ".join(f"{r}: {s}" for r, s in enumerate(readable))
            + "; give every rank equal micro-batches (e.g. drop_last=True in the data loader)"
        )
