"""Real values for a meta-device model's tensors, made when an op takes them and freed soon
after: a check can run a model of any size on real numbers holding a few tensors at a time.

:class:`StandIns` gives each parameter or buffer of the model a deterministic stand-in (the
same values every time it is made, from a seed of the tensor's name): weights ~ N(0, 0.02),
vectors (norm weights, biases) 1 + N(0, 0.1), integer buffers zeros. Values are drawn once
per tensor from a pool of a prime length (so no two rows of a matrix repeat each other) and
tiled, which writes a large tensor at memory speed rather than the generator's. The stand-ins
live in a cache of ``budget`` bytes (by default 64 MiB or two of the largest tensor), the
least recently used dropped first (made again, equal, when an op takes them again: with 256
MiB the check held more than the pipeline stage it guards, half of a 214M Llama's fp32
weights set up under pp=2, 0.53 of the whole model against the stage's 0.50). Not the model's initial values: a check comparing two ways of
computing the same forward only needs both to see the same numbers.
"""

from __future__ import annotations

import ctypes
import hashlib
from collections import OrderedDict

import torch
from torch import nn

POOL = 1_000_003  # elements drawn per tensor at most (a prime), tiled beyond


class StandIns:
    def __init__(self, model: nn.Module, budget: int | None = None):
        self.names, largest = {}, 0
        for name, tensor in (*model.named_parameters(remove_duplicate=False),
                             *model.named_buffers(remove_duplicate=False)):
            self.names.setdefault(id(tensor), name)
            largest = max(largest, tensor.numel() * tensor.element_size())
        # (default: 64 MiB, or two of the largest tensor: an op's weights held together)
        self.budget = budget if budget is not None else max(64 * 2**20, 2 * largest)
        self.held, self.cache = 0, OrderedDict()

    def __contains__(self, tensor) -> bool:
        return isinstance(tensor, torch.Tensor) and tensor.is_meta and id(tensor) in self.names

    def real(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor``'s stand-in on the CPU (a meta tensor of the model)."""
        key = id(tensor)
        if key in self.cache:
            self.cache.move_to_end(key)
            return self.cache[key]
        value = _stand_in(tensor, self.names[key])
        self.cache[key] = value
        self.held += value.numel() * value.element_size()
        while self.held > self.budget and len(self.cache) > 1:
            _, dropped = self.cache.popitem(last=False)
            self.held -= dropped.numel() * dropped.element_size()
        return value


def _stand_in(tensor: torch.Tensor, name: str) -> torch.Tensor:
    if not tensor.is_floating_point():
        return torch.zeros(tensor.shape, dtype=tensor.dtype, device="cpu")
    seed = int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "little") % 2**63
    numel = tensor.numel()
    pool = torch.randn(min(numel, POOL), generator=torch.Generator().manual_seed(seed),
                       device="cpu")
    values = pool.repeat(-(-numel // POOL))[:numel] if numel > POOL else pool
    values = values.view(tensor.shape).to(tensor.dtype)
    return values.mul_(0.02) if tensor.dim() >= 2 else values.mul_(0.1).add_(1.0)


def trim_heap() -> None:
    """Give the C library's freed heap pages back to the system (glibc's ``malloc_trim``): a
    large model's stand-ins leave some 100 MiB of them, which the stage set up next does not
    reuse (its tensors are mapped apart) and which would add to the set-up's peak. Nothing
    where the C library is not glibc."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
