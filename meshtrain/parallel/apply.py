"""Turning a plain model into a parallel one, in one fixed order.

The order (as in torchtitan) is: pipeline split (done by the Trainer before this is called on
each stage), tensor parallel, activation checkpointing, then the data-parallel wrapper (FSDP or
DDP) last, because it must see the final parameters. ``torch.compile`` belongs between
checkpointing and the wrapper and is not implemented yet. Each strategy is one
``apply_*`` function in its own module; this file only decides which ones run, and in what order.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch.distributed.fsdp import FSDPModule
from torch.nn.parallel import DistributedDataParallel

from meshtrain.errors import ConfigError
from meshtrain.parallel.layout import Layout

BlocksFn = Callable[[torch.nn.Module], Iterable[torch.nn.Module]]


@dataclass(frozen=True)
class ParallelOptions:
    """Knobs of the strategies, taken from the Trainer's arguments."""

    bucket_cap_mb: float = 25.0
    comm_hook: str | None = None
    powersgd_rank: int = 1
    precision: str = "fp32"
    offload: str | None = None
    activation_checkpointing: str | None = None
    blocks: BlocksFn | None = None
    sequence_parallel: bool = False
    loss_parallel: bool = False
    # a plan, or a function module -> plan or None (None: the module's own ``tp_plan``)
    tp_plan: dict | Callable[[torch.nn.Module], dict | None] | None = None


def model_blocks(model: torch.nn.Module, options: ParallelOptions) -> list[torch.nn.Module]:
    """The repeated blocks that FSDP shards one by one and checkpointing recomputes."""
    from meshtrain.parallel.fully_shard import find_blocks

    if options.blocks is not None:
        return list(options.blocks(model))
    return find_blocks(model)


def check_model(model: torch.nn.Module, layout: Layout, options: ParallelOptions) -> None:
    """Checks that need the model but no process group (run on a meta-device copy)."""
    if layout.degree("tp") > 1 and tp_plan_of(model, options) is None:
        from meshtrain.parallel.tensor_parallel import check_tp, model_tp_plan

        tp = layout.degree("tp")  # the model's own checks, and a plan it must supply
        check_tp(model, tp, sequence_parallel=options.sequence_parallel)
        model_tp_plan(model, tp, sequence_parallel=options.sequence_parallel,
                      loss_parallel=options.loss_parallel)
    if not any(p.requires_grad for p in model.parameters()):
        raise ConfigError(
            "the model has no trainable parameters (requires_grad=True), so there is nothing "
            f"to train{' or shard' if layout.is_sharded else ''}"
        )
    if options.activation_checkpointing and not model_blocks(model, options):
        raise ConfigError(
            f"activation_checkpointing={options.activation_checkpointing!r} needs the model's "
            "repeated blocks (e.g. an nn.ModuleList of layers) and none were found; pass "
            "blocks=lambda model: [...] to the Trainer, or set activation_checkpointing=None"
        )


def tp_plan_of(module: torch.nn.Module, options: ParallelOptions) -> dict | None:
    """The plan given for ``module`` (a dict, or what the function returns for it); None means
    the module supplies its own (``module.tp_plan``)."""
    plan = options.tp_plan
    return plan(module) if callable(plan) else plan


def parallelize(
    model: torch.nn.Module,
    layout: Layout,
    mesh,
    *,
    device: torch.device,
    options: ParallelOptions = ParallelOptions(),
) -> torch.nn.Module:
    """Apply ``layout`` to ``model`` in place; return the module to call for training steps.

    The returned module may be a wrapper (DDP) used only inside the Trainer; ``model`` itself
    keeps its parameters, so user code reads and saves ``model`` as it is. Under ``pp`` this is
    called once per pipeline stage; with ``pp`` or ``tp``, plain ``dp`` gradients are averaged by
    the Trainer (``allreduce_gradients``) rather than by DDP.
    """
    if layout.degree("tp") > 1:
        from meshtrain.parallel.tensor_parallel import apply_tp

        apply_tp(model, mesh["tp"], plan=tp_plan_of(model, options),
                 sequence_parallel=options.sequence_parallel, loss_parallel=options.loss_parallel)
    needs_blocks = options.activation_checkpointing or layout.is_sharded
    blocks = model_blocks(model, options) if needs_blocks else []
    if options.activation_checkpointing:
        from meshtrain.parallel.activation_checkpointing import apply_activation_checkpointing

        apply_activation_checkpointing(model, options.activation_checkpointing, blocks)
    if layout.is_sharded:
        from meshtrain.parallel.fully_shard import apply_fsdp

        shard_mesh = mesh[layout.data_parallel_axes]  # 1-D: FSDP; 2-D (replicate, shard): HSDP
        apply_fsdp(
            model, shard_mesh, reshard_after_forward=layout.zero_stage == 3,
            precision=options.precision, offload=options.offload, blocks=blocks or None,
        )
        return model
    if layout.uses_ddp:
        from meshtrain.parallel.data_parallel import apply_ddp

        return apply_ddp(
            model, mesh, axis="dp", bucket_cap_mb=options.bucket_cap_mb,
            comm_hook=options.comm_hook, powersgd_rank=options.powersgd_rank, device=device,
        )
    return model


def build_optimizer(model: torch.nn.Module, factory, layout: Layout, mesh):
    """The user's optimizer, or for ZeRO-1 the same optimizer with its state sharded."""
    if layout.zero_stage == 1 and layout.degree("dp") > 1:
        from meshtrain.parallel.zero1 import make_zero1_optimizer

        return make_zero1_optimizer(model.parameters(), factory, mesh.get_group("dp"))
    return factory(model.parameters())


@contextlib.contextmanager
def gradient_sync(train_module: torch.nn.Module, model: torch.nn.Module, enabled: bool):
    """Skip the gradient reduction for micro-steps that only accumulate (DDP or FSDP2)."""
    if enabled:
        yield
    elif isinstance(train_module, DistributedDataParallel):
        with train_module.no_sync():
            yield
    elif isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)
    else:
        yield


def loss_context(layout: Layout, options: ParallelOptions):
    """Where the loss and its backward run: under ``loss_parallel()`` when the tensor-parallel
    head leaves the logits sharded over the vocabulary, else nothing special."""
    if options.loss_parallel and layout.degree("tp") > 1:
        from meshtrain.parallel.tensor_parallel import loss_parallel_context

        return loss_parallel_context(True)
    return contextlib.nullcontext()
