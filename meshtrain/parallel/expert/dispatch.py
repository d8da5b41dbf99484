"""Tokens to their experts' ranks and back (torchtitan's and Megatron's dropless dispatch).

A rank's routed tokens arrive sorted by (global) expert with ``counts[e]`` for each (a tensor
on their device); under ``ep=R`` rank r holds experts ``r*L .. (r+1)*L - 1`` (L = E / R). Two
all-to-alls: first the counts (every rank learns how many tokens each other rank sends each of
its experts), then the tokens with those uneven splits (autograd-aware: the backward sends the
gradients back the same way). The split sizes are the one host sync of a layer's step
(:meth:`AllToAllExperts.exchange`: one ``tolist`` of 2R numbers, forward only; the backward
reuses them). The received tokens come grouped by source rank, then expert; a permutation
computed on the device regroups them by expert for the local experts (one grouped GEMM per
weight, meshtrain/moe/grouped.py, with the counts per local expert as a device tensor), and
the outputs return in the order they came. A rank that sends or receives no token takes part
with empty splits: nobody waits on it.

Under ``torch.compile`` the two exchanges run eagerly (``torch.compiler.disable``: collectives
with split sizes read from the data) and the local experts between them are compiled, their
row count marked dynamic (one graph for every count).
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from torch.distributed._functional_collectives import all_to_all_single_autograd

from meshtrain.fault.inject import fault_point


class AllToAllExperts:
    """``MoE.dispatch`` under ep: ``(tokens, counts [E]) -> outputs`` for every token, computed
    where its expert lives by ``compute(tokens, counts)`` (that rank's L experts, on tokens
    grouped by expert, ``counts`` [L] on the device)."""

    def __init__(self, compute, group: dist.ProcessGroup, size: int):
        self.compute, self.group, self.size = compute, group, size

    def __call__(self, tokens: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        grouped, local_counts, order, splits = self.exchange(tokens, counts)
        out = self.compute(grouped, local_counts)
        return self.combine(out, grouped, order, splits)

    @torch.compiler.disable(reason="ep's all-to-alls: split sizes read from the data")
    def exchange(self, tokens: torch.Tensor, counts: torch.Tensor):
        """Tokens to their experts' ranks: (the tokens received, grouped by local expert;
        their counts per local expert [L]; the permutation that grouped them; the splits)."""
        size = self.size
        local = counts.numel() // size
        counts = counts.to(torch.int64)
        received_counts = torch.empty_like(counts)
        dist.all_to_all_single(received_counts, counts, group=self.group)
        fault_point("moe_all_to_all")  # MESHTRAIN_FAULT (meshtrain/fault/inject.py)
        matrix = received_counts.view(size, local)  # [source rank, my expert]
        # the layer's one host sync: how many tokens go to and come from each rank
        sizes = torch.cat([counts.view(size, local).sum(1), matrix.sum(1)]).tolist()
        send, receive = sizes[:size], sizes[size:]
        received = _wait(all_to_all_single_autograd(tokens, receive, send, self.group))
        # rows in (source, expert) order; each row's local expert, then stably by expert
        ends = matrix.flatten().cumsum(0)
        rows = torch.arange(received.shape[0], device=received.device)
        segment = torch.searchsorted(ends, rows, right=True)
        order = (segment % local).argsort(stable=True)
        grouped = received[order]
        dynamo = sys.modules.get("torch._dynamo")  # (imported where something compiles)
        if dynamo is not None:
            dynamo.maybe_mark_dynamic(grouped, 0)  # (the compiled experts: one graph)
        return grouped, matrix.sum(0), order, (send, receive)

    @torch.compiler.disable(reason="ep's all-to-alls: split sizes read from the data")
    def combine(self, out: torch.Tensor, grouped: torch.Tensor, order: torch.Tensor, splits):
        """The experts' outputs back to the ranks their tokens came from, in their order."""
        send, receive = splits
        if grouped.requires_grad:  # the backward's all-to-alls run on every rank, also where
            # the experts' output does not depend on what came (none of them got a token)
            out = out + grouped[:, :0].sum()
        restored = torch.empty_like(out).index_copy(0, order, out)  # (source, expert) order
        return _wait(all_to_all_single_autograd(restored, send, receive, self.group))


def _wait(tensor: torch.Tensor) -> torch.Tensor:
    """A functional collective's result, waited for (an AsyncCollectiveTensor otherwise)."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    return tensor.wait() if isinstance(tensor, AsyncCollectiveTensor) else tensor
