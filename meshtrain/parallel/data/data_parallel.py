"""Data parallelism with PyTorch's DistributedDataParallel (Li et al., VLDB 2020).

Every rank holds the whole model; after backward, gradients are averaged with a bucketed
all-reduce that overlaps with the rest of backward. ``apply_ddp`` wraps the module for the
Trainer's internal use only: the user's module keeps its own parameters, so user code never has
to unwrap ``.module``.

Communication hooks trade exactness for bandwidth:
  * ``"fp16"`` / ``"bf16"``: gradients are cast to half precision for the all-reduce;
  * ``"powersgd"``: PowerSGD low-rank compression (Vogels et al., NeurIPS 2019) with error feedback.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from meshtrain.errors import ConfigError

COMM_HOOKS = ("fp16", "bf16", "powersgd")


def apply_ddp(
    model: torch.nn.Module,
    mesh,
    *,
    axis: str = "dp",
    bucket_cap_mb: float = 25.0,
    comm_hook: str | None = None,
    powersgd_rank: int = 1,
    device: torch.device | None = None,
    whole_block_graphs: bool = False,
) -> DistributedDataParallel:
    """Wrap ``model`` in DDP over the ``axis`` dimension of ``mesh`` and return the wrapper.
    ``whole_block_graphs``: the blocks are compiled with selective checkpointing inside
    (see ``_keep_block_graphs_whole``)."""
    group = mesh.get_group(axis)
    from meshtrain.parallel.expert import expert_params

    held = {id(p) for p in expert_params(model)}
    experts = [name for name, p in model.named_parameters() if id(p) in held]
    if experts:  # ep's experts: each rank holds others (meshtrain/parallel/expert/)
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, experts)
    device_ids = [device.index] if device is not None and device.type == "cuda" else None
    ddp = DistributedDataParallel(
        model,
        device_ids=device_ids,
        process_group=group,
        bucket_cap_mb=bucket_cap_mb,
        gradient_as_bucket_view=True,
        # Parameters are already identical (seeded init); rank 0's copy is broadcast anyway.
        init_sync=True,
    )
    if comm_hook is not None:
        _register_comm_hook(ddp, group, comm_hook, powersgd_rank)
    if whole_block_graphs:
        _keep_block_graphs_whole(ddp)
    return ddp


def _keep_block_graphs_whole(ddp: DistributedDataParallel) -> None:
    """Compile each block whole under DDP, not cut at DDP's bucket boundaries by Dynamo's
    ``DDPOptimizer``: torch 2.13's partitioner fails on the cut graphs of a block compiled with
    selective checkpointing inside (``TypeError: '>' not supported between ... 'NoneType'`` in
    ``cleanup_recompute_tags``: the cut loses the checkpoint's region ids). A block compiled on
    its own has its gradients ready at its end anyway, so DDP still overlaps the all-reduce with
    the blocks before it; only the cut within a block larger than a bucket is given up.
    ``optimize_ddp`` is set only while DDP's forward runs (when Dynamo compiles the blocks) and
    restored after it, even when the forward fails."""
    patch = torch._dynamo.config.patch(optimize_ddp=False)
    ddp.register_forward_pre_hook(lambda module, args: patch.__enter__())
    ddp.register_forward_hook(lambda module, args, output: patch.__exit__(None, None, None),
                              always_call=True)


def check_comm_hook(comm_hook: str | None, powersgd_rank: int = 1) -> None:
    """Reject unknown hook names before any process starts."""
    if comm_hook is not None and comm_hook not in COMM_HOOKS:
        raise ConfigError(
            f"unknown comm_hook {comm_hook!r}; choose one of {', '.join(COMM_HOOKS)} or None"
        )
    if powersgd_rank < 1:
        raise ConfigError(f"powersgd_rank must be at least 1, got {powersgd_rank}")


def _register_comm_hook(ddp, group, name: str, powersgd_rank: int) -> None:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    if name == "powersgd":
        state = powerSGD_hook.PowerSGDState(
            process_group=group,
            matrix_approximation_rank=powersgd_rank,
            start_powerSGD_iter=2,  # one plain all-reduce step first, as the paper recommends
            use_error_feedback=True,
            warm_start=True,
        )
        ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
        return
    dtype = torch.float16 if name == "fp16" else torch.bfloat16
    if ddp.device_ids or name == "fp16":
        hook = default_hooks.fp16_compress_hook if name == "fp16" else default_hooks.bf16_compress_hook
        ddp.register_comm_hook(group, hook)
    else:
        # PyTorch's bf16 hook refuses CPU tensors; gloo reduces bf16 fine, so cast ourselves.
        ddp.register_comm_hook(group, _make_cast_hook(dtype))


def _make_cast_hook(dtype: torch.dtype):
    def cast_allreduce_hook(group, bucket):
        grads = bucket.buffer()
        world = dist.get_world_size(group)
        compressed = grads.to(dtype).div_(world)
        work = dist.all_reduce(compressed, group=group, async_op=True)

        def decompress(fut):
            grads.copy_(fut.value()[0])
            return grads

        return work.get_future().then(decompress)

    return cast_allreduce_hook


def allreduce_gradients(parameters, group) -> None:
    """Average gradients over ``group`` with one all-reduce per dtype (flattened buckets).

    Used where DDP cannot wrap the model: pipeline stages (DDP breaks under pipelining) and
    tensor-parallel models (DTensor parameters); sharded layouts use FSDP2 instead.
    """
    from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

    grads = [p.grad for p in parameters if p.grad is not None]
    grads = [g.to_local() if hasattr(g, "to_local") else g for g in grads]
    world = dist.get_world_size(group)
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for grad in grads:
        by_dtype.setdefault(grad.dtype, []).append(grad)
    for same in by_dtype.values():
        flat = _flatten_dense_tensors(same)
        dist.all_reduce(flat, group=group)
        flat /= world
        for grad, reduced in zip(same, _unflatten_dense_tensors(flat, same)):
            grad.copy_(reduced)
