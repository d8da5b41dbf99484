"""The ZeRO paper's per-rank model-state formulas, and how meshtrain's layouts realise them.

Model state is parameters, gradients and optimizer state (Rajbhandari et al., "ZeRO: Memory
Optimizations Toward Training Trillion Parameter Models", SC 2020); activations, buffers and
temporary communication buffers are not part of it. With Ψ parameters on N ranks, b_p and b_g
bytes per parameter and gradient element and K bytes of optimizer state per parameter, one rank
holds

=========  ==========  ==========  ========  ==========================================
stage      params      grads       optim     what meshtrain runs
=========  ==========  ==========  ========  ==========================================
0          b_p·Ψ       b_g·Ψ       K·Ψ       ``dp``: DDP
1          b_p·Ψ       b_g·Ψ       K·Ψ/N     ``zero1``: DDP + ZeroRedundancyOptimizer
2          b_p·Ψ       b_g·Ψ/N     K·Ψ/N     ``zero2``: FSDP2, reshard_after_forward=False
3          b_p·Ψ/N     b_g·Ψ/N     K·Ψ/N     ``zero3`` / ``dp_shard``: FSDP2
=========  ==========  ==========  ========  ==========================================

The paper counts mixed-precision Adam: fp16 parameters and gradients plus fp32 master
parameters, momentum and variance, i.e. 2Ψ + 2Ψ + KΨ with K = 12 (16Ψ in all at stage 0).
meshtrain keeps fp32 parameters (with DDP, ``bf16-mixed`` is autocast: only activations are
bf16), so with Adam it is 4Ψ + 4Ψ + 8Ψ: the parameter *is* the master copy and K = 8 (momentum
+ variance).
FSDP2 realises the stages like this:

* its sharded fp32 parameter (a DTensor, dim 0 split over the mesh) is the master copy the
  optimizer updates; the full parameter exists only while it is gathered;
* ZeRO-3 (``reshard_after_forward=True``) frees the gathered parameters of each block after its
  forward and again after its backward, so at rest a rank holds Ψ/N;
* ZeRO-2 (``reshard_after_forward=False``) keeps them from forward to the end of backward. The
  formula's full b_p·Ψ is what a rank holds *in that window*; after backward FSDP2 reshards, so
  after the optimizer step it holds Ψ/N like ZeRO-3. Compare stage 2 with the parameters
  measured between forward and backward (:class:`ForwardParamBytes`). In that window the
  sharded master copy (b_p·Ψ/N) is resident too; the formula does not count it (in the paper's
  mixed-precision form it is part of K);
* the root module's own parameters (those outside the sharded blocks, e.g. embeddings or a final
  norm) stay gathered after forward by default, because backward needs them at once.

With FSDP2's bf16 ``param_dtype`` (``bf16-mixed`` on a sharded layout) the gathered copy is bf16,
so ZeRO-2's window holds 2Ψ of parameters beside the fp32 shards: the paper's mixed-precision form.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ModelStateBytes:
    """Bytes of parameters, gradients and optimizer state on one rank."""

    params: int
    grads: int
    optimizer: int

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The part of ``tensor`` stored on this rank (a DTensor's local shard, else itself)."""
    from torch.distributed.tensor import DTensor

    if isinstance(tensor, DTensor):
        with torch.no_grad():
            return tensor.to_local()
    return tensor


# -- predicted ------------------------------------------------------------------------------------
def predicted_bytes(
    num_params: int,
    zero_stage: int,
    num_shards: int,
    *,
    bytes_per_param: int = 4,
    bytes_per_grad: int = 4,
    optimizer_bytes_per_param: int = 8,
) -> ModelStateBytes:
    """Per-rank model-state bytes from the ZeRO paper's formulas (see the module docstring).

    ``num_params`` is Ψ (the full model), ``num_shards`` N (ranks the state is sharded over);
    the defaults are fp32 parameters and gradients with Adam (K = 8). Mixed precision as in the
    paper: ``bytes_per_param=2, bytes_per_grad=2, optimizer_bytes_per_param=12``. Divisions are
    exact (floats rounded to whole bytes).
    """
    if zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_stage must be 0, 1, 2 or 3, got {zero_stage}")
    if num_shards < 1:
        raise ValueError(f"num_shards must be at least 1, got {num_shards}")
    n = num_shards
    params = bytes_per_param * num_params / (n if zero_stage >= 3 else 1)
    grads = bytes_per_grad * num_params / (n if zero_stage >= 2 else 1)
    opt = optimizer_bytes_per_param * num_params / (n if zero_stage >= 1 else 1)
    return ModelStateBytes(round(params), round(grads), round(opt))


def shard_count(layout) -> int:
    """N of the formulas for a :class:`~meshtrain.parallel.layout.Layout`.

    ZeRO-1 shards the optimizer over the ``dp`` ranks; ZeRO-2/3 shard over ``dp_shard`` (with
    HSDP the ``dp_replicate`` replicas each hold a full set of shards, so they do not divide).
    """
    if layout.zero_stage == 1:
        return layout.degree("dp")
    if layout.zero_stage in (2, 3):
        return layout.degree("dp_shard")
    return 1


def optimizer_bytes_per_param(optimizer: torch.optim.Optimizer, default: int = 8) -> int:
    """K: bytes of parameter-sized optimizer state per parameter (Adam fp32: 8, SGD momentum: 4).

    Read after a step from the state slots of the first parameter that has state (``step`` and
    other entries not the parameter's size excluded); no state at all then means a stateless
    optimizer (plain SGD: 0). ``default`` is for a ZeRO-1 rank that owns no parameters.
    """
    inner = getattr(optimizer, "optim", None)
    opt = inner if isinstance(inner, torch.optim.Optimizer) else optimizer
    for param, state in opt.state.items():
        numel = local_tensor(param).numel()
        return sum(
            local_tensor(v).element_size() for k, v in state.items()
            if isinstance(v, torch.Tensor) and k != "step" and local_tensor(v).numel() == numel
        )
    owns_params = any(group["params"] for group in opt.param_groups)
    return 0 if owns_params else default
