"""Activation checkpointing: keep fewer activations in forward, recompute them in backward.

Modes, applied to each of the model's repeated blocks:

* ``"full"``: a block keeps only its input and reruns its forward during backward
  (gradient checkpointing, Chen et al., "Training Deep Nets with Sublinear Memory Cost", 2016);
* ``"selective"``: op-level selective checkpointing (Korthikanti et al., "Reducing Activation
  Recomputation in Large Transformer Models", MLSys 2023): the outputs of matmuls and attention,
  which are expensive to recompute, are kept; the cheap ops between them (norms, activations,
  reshapes, additions) are recomputed. Built on ``create_selective_checkpoint_contexts``.

Both use the composable, non-reentrant ``torch.distributed._composable.checkpoint``, which works
through forward hooks: unlike ``checkpoint_wrapper`` (which inserts
``_checkpoint_wrapped_module`` into every parameter name) parameter FQNs stay as they are, so
checkpoints, optimizers and FSDP see the same names. Apply it before DDP or FSDP2
(``fully_shard``); FSDP2 knows that a recomputing block's parameters are already gathered.
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.distributed._composable import checkpoint
from torch.distributed._composable.contract import _get_registry
from torch.distributed.fsdp import FSDPModule
from torch.nn.parallel import DistributedDataParallel
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from meshtrain.errors import ConfigError

MODES = ("full", "selective")

_aten = torch.ops.aten
#: Ops whose outputs "selective" keeps: matrix products and attention kernels (any device).
SAVE_OPS = frozenset(
    getattr(getattr(_aten, name), "default")
    for name in (
        "mm", "addmm", "bmm", "baddbmm", "_scaled_mm",
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
        "_scaled_dot_product_fused_attention_overrideable",
    )
    if hasattr(_aten, name)
)


def save_matmuls_and_attention(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    """Selective-checkpointing policy: keep matmul and attention outputs, recompute the rest."""
    return CheckpointPolicy.MUST_SAVE if op in SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def apply_activation_checkpointing(
    model: nn.Module, mode: str | None, blocks: list[nn.Module]
) -> dict[nn.Module, list[int]]:
    """Checkpoint each of ``blocks`` (submodules of ``model``) in ``mode``, in place.

    ``mode`` is ``"full"``, ``"selective"`` or ``None`` (nothing). Call it on the plain model,
    before DDP or ``fully_shard``. Returns each block's checkpoint pre-hook keys (for
    :func:`checkpoint_hooks_first`).
    """
    if mode is None:
        return {}
    if mode not in MODES:
        raise ConfigError(
            f"unknown activation checkpointing mode {mode!r}; choose 'full' (recompute each "
            "block), 'selective' (keep matmul and attention outputs) or None (off)"
        )
    blocks = list(blocks) if blocks is not None else []
    if not blocks:
        raise ConfigError(
            "activation checkpointing needs the model's repeated blocks; none were found — pass "
            "blocks=... (e.g. blocks=list(model.layers))"
        )
    if isinstance(model, (DistributedDataParallel, FSDPModule)):
        raise ConfigError(
            f"activation checkpointing was applied after {type(model).__name__}; apply it to the "
            "plain model first, then wrap it for data parallelism"
        )
    members = {id(m) for m in model.modules()}
    for index, block in enumerate(blocks):
        if not isinstance(block, nn.Module) or id(block) not in members:
            raise ConfigError(
                f"blocks[{index}] ({type(block).__name__}) is not a submodule of the model; pass "
                "the model's own blocks, e.g. blocks=list(model.layers)"
            )
        if isinstance(block, FSDPModule):
            raise ConfigError(
                f"blocks[{index}] is already sharded with fully_shard; apply activation "
                "checkpointing before FSDP2"
            )
        if "checkpoint" in (_get_registry(block) or {}):
            raise ConfigError(
                f"blocks[{index}] ({type(block).__name__}) is already checkpointed; apply "
                "activation checkpointing once"
            )
    hooks = {}
    for block in blocks:
        before = set(block._forward_pre_hooks)
        if mode == "full":
            checkpoint(block)
        else:
            checkpoint(block, context_fn=functools.partial(
                create_selective_checkpoint_contexts, save_matmuls_and_attention))
        # The checkpoint keeps the block's inputs as its first pre-hook sees them and its
        # recompute calls the block again, running the other pre-hooks once more. So the
        # checkpoint's goes first: an input hook laid on the block before it (tensor
        # parallel's slicing of the sequence-parallel stream at the first block) then works
        # on the same input in the recompute as in the forward (it sliced a slice before).
        hooks[block] = [k for k in block._forward_pre_hooks if k not in before]
    checkpoint_hooks_first(hooks)
    return hooks


def checkpoint_hooks_first(hooks: dict[nn.Module, list[int]]) -> None:
    """Put each block's checkpoint pre-hook (``hooks``: from :func:`apply_activation_checkpointing`)
    before the block's other pre-hooks, in place.

    FSDP2's pre-hook, laid on later with ``prepend=True``, would otherwise run before the
    checkpoint's, outside the checkpointed region, while the recompute runs it again inside
    (torch 2.13: FSDP2 casts the inputs to ``param_dtype`` again there). A selective
    checkpoint's recompute may run only the ops its forward saw: with mixed precision it failed
    the first backward ("profiler._record_function_enter_new.default encountered during
    backward but not found in storage"). So call this again after ``fully_shard``."""
    for block, keys in hooks.items():
        for key in reversed(keys):
            block._forward_pre_hooks.move_to_end(key, last=False)
