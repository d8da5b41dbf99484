"""meshtrain's MoE layer under tensor parallelism: every expert split by hidden unit.

Megatron's expert tensor parallelism with the expert-parallel degree 1: each tp rank holds
every expert's columns ``h/tp`` of ``w_in`` [E, d, h] (``Shard(2)``) and the same rows of
``w_out`` [E, h, d] (``Shard(1)``). The router is replicated and sees the whole tokens on every
tp rank, so every rank routes alike and sends each expert the same tokens; an expert's output
on one rank is its share of the sum over the hidden units. The router weights combine the
shares into each token's share of the layer's output, which is all-reduced once per layer (as
a dense MLP's row-parallel output: tokens x d, not the routed tokens x k x d), and the
weights' and the routed tokens' gradients, each rank's share, are summed backward (as a
column-parallel input's). The shared expert is a dense MLP split the same way.
Under sequence parallel the layer gathers the sequence on entry and hands back this rank's
part (its output is whole on every rank: the slice costs no communication).

The experts run on their local shards (:func:`run_on_local_params`): the grouped GEMM
(meshtrain/moe/grouped.py) on plain tensors, as the rest of the layer runs.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.tensor import (
    DTensor, Partial, Replicate, Shard, distribute_module, distribute_tensor,
)
from torch.distributed.tensor.parallel import ParallelStyle, PrepareModuleInputOutput

from meshtrain.parallel.tensor.tensor_parallel import mlp_plan, run_on_local_params

SPLITS = {"w_in": Shard(2), "w_out": Shard(1)}  # GroupedExperts' weights: by hidden unit


def _shares_in(tensor, mesh):
    """``tensor`` (alike on every tp rank) as is; its gradient, each rank's share, summed."""
    whole = DTensor.from_local(tensor, mesh, [Replicate()], run_check=False)
    return whole.to_local(grad_placements=[Partial()])


class HiddenSplit:
    """What the MoE layer (``MoE.hidden_split``) does with the experts' output shares."""

    def __init__(self, mesh):
        self.mesh = mesh

    def shares_in(self, weights):
        return _shares_in(weights, self.mesh)

    @torch.compiler.disable(reason="a collective on the experts' outputs, run eagerly")
    def summed(self, shares):
        """The layer's output: the ranks' shares all-reduced (gradient passed as is)."""
        partial = DTensor.from_local(shares, self.mesh, [Partial()], run_check=False)
        return partial.redistribute(self.mesh, [Replicate()]).to_local()


class MoETensorParallel(ParallelStyle):
    """The MoE layer: its outputs summed over tp after the router weights combine them."""

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        module.hidden_split = HiddenSplit(device_mesh)
        return module


class ExpertTensorParallel(ParallelStyle):
    """:class:`~meshtrain.moe.layer.GroupedExperts` split by hidden unit over the tp mesh: the
    tokens come in whole on every rank (their gradient summed backward); the outputs are this
    rank's shares (summed by :class:`MoETensorParallel`'s layer)."""

    @staticmethod
    def _params(name, module, mesh):
        for p_name, placement in SPLITS.items():
            param = getattr(module, p_name)
            if not isinstance(param, DTensor):
                split = distribute_tensor(param.detach(), mesh, [placement])
                module.register_parameter(p_name, nn.Parameter(split, param.requires_grad))

    @staticmethod
    def _inputs(module, inputs, mesh):
        tokens, *rest = inputs
        return (_shares_in(tokens, mesh), *rest)

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        distribute_module(module, device_mesh, self._params, self._inputs)
        run_on_local_params(module, partial_grads=False)  # each rank's own columns' gradient
        return module


def moe_tp_plan(prefix: str, moe: nn.Module, *, sequence_parallel: bool
                ) -> dict[str, ParallelStyle]:
    """Plan entries for the MoE layer at ``prefix`` (the router is left to the caller's
    ``replicate_the_rest``: replicated, it computes alike on every rank)."""
    plan: dict[str, ParallelStyle] = {f"{prefix}.experts": ExpertTensorParallel()}
    if moe.shared is not None:
        plan.update(mlp_plan(f"{prefix}.shared", "fc_in", "fc_out"))
    plan[prefix] = _SequenceAround() if sequence_parallel else MoETensorParallel()
    return plan


class _SequenceAround(PrepareModuleInputOutput):
    """:class:`MoETensorParallel` under sequence parallel: the sequence gathered on entry and
    this rank's part of the (whole) output kept."""

    def __init__(self):
        super().__init__(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                         use_local_input=True, output_layouts=(Replicate(),),
                         desired_output_layouts=(Shard(1),), use_local_output=True)

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        MoETensorParallel()._apply(module, device_mesh)
        return super()._apply(module, device_mesh)


def expert_sizes(moe: nn.Module) -> dict[str, int]:
    """The widths tp splits in an MoE layer: the experts' hidden units, the shared expert's."""
    sizes = {"expert_hidden_dim": moe.experts.w_in.shape[-1]}
    if moe.shared is not None:
        sizes["mlp_hidden_dim"] = moe.shared.fc_in.out_features
    return sizes


__all__ = ["ExpertTensorParallel", "HiddenSplit", "MoETensorParallel", "expert_sizes",
           "moe_tp_plan"]
