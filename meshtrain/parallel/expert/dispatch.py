"""Tokens to their experts' ranks and back (torchtitan's and Megatron's dropless dispatch).

A rank's routed tokens arrive sorted by (global) expert with ``counts[e]`` for each; under
``ep=R`` rank r holds experts ``r*L .. (r+1)*L - 1`` (L = E / R). Two all-to-alls: first the
counts (every rank learns how many tokens each other rank sends each of its experts), then the
tokens with those uneven splits (autograd-aware: the backward sends the gradients back the same
way). The received tokens come grouped by source rank, then expert; they are regrouped by
expert for the grouped matmuls, and the outputs return in the order they came. A rank that
sends or receives no token takes part with empty splits: nobody waits on it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed._functional_collectives import all_to_all_single_autograd


class AllToAllExperts:
    """``MoE.dispatch`` under ep: ``(tokens, counts [E]) -> outputs`` for every token, computed
    where its expert lives by ``compute(tokens, counts)`` (that rank's L experts, on tokens
    grouped by expert)."""

    def __init__(self, compute, group: dist.ProcessGroup, size: int):
        self.compute, self.group, self.size = compute, group, size

    def __call__(self, tokens: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        size = self.size
        local = counts.numel() // size
        counts = counts.to(torch.int64)
        received_counts = torch.empty_like(counts)
        dist.all_to_all_single(received_counts, counts, group=self.group)
        matrix = received_counts.view(size, local)  # [source rank, my expert]
        send = counts.view(size, local).sum(1).tolist()
        receive = matrix.sum(1).tolist()
        received = _wait(all_to_all_single_autograd(tokens, receive, send, self.group))
        segments = matrix.flatten().tolist()  # (source, expert) order
        by_expert = [s * local + e for e in range(local) for s in range(size)]
        pieces = received.split(segments)
        grouped = torch.cat([pieces[i] for i in by_expert]) if pieces else received
        out = self.compute(grouped, matrix.sum(0).tolist())
        if grouped.requires_grad:  # the backward's all-to-alls run on every rank, also where
            # the experts' output does not depend on what came (none of them got a token)
            out = out + grouped[:, :0].sum()
        out_pieces = out.split([segments[i] for i in by_expert])
        position = {i: k for k, i in enumerate(by_expert)}
        restored = torch.cat([out_pieces[position[i]] for i in range(size * local)])
        return _wait(all_to_all_single_autograd(restored, send, receive, self.group))


def _wait(tensor: torch.Tensor) -> torch.Tensor:
    """A functional collective's result, waited for (an AsyncCollectiveTensor otherwise)."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    return tensor.wait() if isinstance(tensor, AsyncCollectiveTensor) else tensor
