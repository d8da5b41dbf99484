"""The model summary ``fit`` prints at the start: rank 0's top-level modules with their type and
parameters (whole tensors' counts; under pp only its stages) and how many parameter elements
each rank holds under the layout (its shards, its stages), gathered from every rank."""

from __future__ import annotations

import torch
import torch.distributed as dist


def _local(p: torch.Tensor) -> int:
    local = getattr(p, "_local_tensor", None)  # a DTensor's shard
    return (local if local is not None else p).numel()


def _count(n: float) -> str:
    return f"{int(n):,}"


def model_summary(model: torch.nn.Module, group, world_size: int) -> str:
    """The table (collective over ``group``: every rank sends its local count)."""
    rows, seen = [], set()
    for name, child in model.named_children():
        params = [p for p in child.parameters() if id(p) not in seen]
        seen.update(id(p) for p in params)
        rows.append((name, type(child).__name__, sum(p.numel() for p in params),
                     sum(_local(p) for p in params)))
    own = [p for p in model.parameters(recurse=False) if id(p) not in seen]
    if own:
        rows.append(("(own)", type(model).__name__, sum(p.numel() for p in own),
                     sum(_local(p) for p in own)))
    local = torch.tensor([float(sum(r[3] for r in rows))], dtype=torch.float64)
    per_rank = [local.clone() for _ in range(world_size)]
    if group is not None and world_size > 1:
        device = next(model.parameters(), local).device
        per_rank = [t.to(device) for t in per_rank]
        dist.all_gather(per_rank, local.to(device), group=group)
    width = max([len(r[0]) for r in rows] + [6])
    kind = max([len(r[1]) for r in rows] + [4])
    lines = [f"{'module':<{width}}  {'type':<{kind}}  {'params':>11}  {'on rank 0':>11}"]
    lines += [f"{n:<{width}}  {k:<{kind}}  {_count(c):>11}  {_count(m):>11}"
              for n, k, c, m in rows]
    total = sum(r[2] for r in rows)
    held = ", ".join(f"rank {r}: {_count(float(v))}" for r, v in enumerate(per_rank))
    lines.append(f"{_count(total)} parameters in rank 0's modules (under pp: its stages); "
                 f"held per rank under the layout: {held}")
    return "\n".join(lines)
