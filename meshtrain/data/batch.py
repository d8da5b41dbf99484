"""Small helpers on batches: (inputs, targets) pairs, dicts of tensors, or a tensor."""

from __future__ import annotations

from collections.abc import Iterable

import torch


def to_device(batch, device: torch.device):
    """``batch`` with every tensor moved to ``device`` (as it is on the CPU)."""
    if device.type == "cpu":
        return batch
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, (tuple, list)):
        return type(batch)(to_device(b, device) for b in batch)
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    return batch


def plain(value: torch.Tensor) -> torch.Tensor:
    """A loss or norm as a plain tensor (under loss parallel or FSDP a replicated DTensor)."""
    return value.full_tensor() if hasattr(value, "full_tensor") else value


def first_tensor(batch) -> torch.Tensor | None:
    if isinstance(batch, torch.Tensor):
        return batch
    items = batch.values() if isinstance(batch, dict) else batch
    if isinstance(items, Iterable):
        for item in items:
            found = first_tensor(item)
            if found is not None:
                return found
    return None


def batch_size(batch) -> int:
    first = first_tensor(batch)
    return int(first.shape[0]) if first is not None and first.dim() > 0 else 1


def throughput_unit(batch) -> str:
    """What :func:`count_tokens` counts in ``batch``: "tokens" for integer (token id) inputs,
    else "samples"."""
    first = first_tensor(batch)
    return "tokens" if first is not None and not first.is_floating_point() else "samples"


def count_tokens(batch) -> int:
    """Tokens for integer (token id) inputs, else samples (:func:`throughput_unit`)."""
    first = first_tensor(batch)
    if first is None:
        return 1
    return first.numel() if not first.is_floating_point() else int(first.shape[0])


def describe(batch) -> str:
    """Shapes and dtypes, for messages: ``(tensor (8, 12) float32, tensor (8,) int64)``."""
    if isinstance(batch, torch.Tensor):
        return f"tensor {tuple(batch.shape)} {str(batch.dtype).removeprefix('torch.')}"
    if isinstance(batch, dict):
        return "{" + ", ".join(f"{k!r}: {describe(v)}" for k, v in batch.items()) + "}"
    if isinstance(batch, (tuple, list)):
        return "(" + ", ".join(describe(b) for b in batch) + ")"
    return type(batch).__name__
