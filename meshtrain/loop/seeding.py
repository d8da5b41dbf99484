"""The same initial weights on every rank and in every layout, whoever built the model.

Two mechanisms, because a model reaches ``fit`` in two ways:

* ``Trainer(seed=...)`` seeds Python's ``random``, NumPy and torch (every device) when it is
  built, as Lightning's ``seed_everything`` does: a model object built after the Trainer
  (``trainer.fit(MyModel(), ...)``, the README's example) draws the same weights in one process
  and in every rank of any layout (torch's own default seed differs per process). A factory is
  built after a second ``torch.manual_seed(seed)`` in ``fit`` (loop/setup.py).
* Before the layout is applied, :func:`agree_on_initial_state` compares a fingerprint of every
  rank's model (its parameters and buffers, bit for bit) and, where a rank differs (a model
  built before the Trainer, or an init that draws from a generator of its own), copies rank 0's
  tensors to every rank and warns. The ranks then train one model; the warning says how to make
  it the one a single process would have built too.
"""

from __future__ import annotations

import random

import torch
import torch.distributed as dist


def seed_everything(seed: int) -> None:
    """Seed Python's ``random``, NumPy (when installed) and torch on every device."""
    random.seed(seed)
    try:
        import numpy
    except ImportError:  # numpy is optional for torch
        pass
    else:
        numpy.random.seed(seed % 2**32)
    torch.manual_seed(seed)  # (every device's generator, CUDA included)


def fingerprint(module: torch.nn.Module) -> torch.Tensor:
    """One int64 per parameter and buffer: the sum of its bytes read as integers (exact and
    independent of the order of the sum, so equal tensors give equal numbers on any rank)."""
    sums = []
    for tensor in module.state_dict().values():
        data = tensor.detach().contiguous().flatten()
        if not data.numel():
            sums.append(torch.zeros((), dtype=torch.int64, device=data.device))
            continue
        raw = data.view(torch.uint8)
        if raw.numel() % 4 == 0:
            raw = raw.view(torch.int32)
        sums.append(raw.sum(dtype=torch.int64))
    return torch.stack(sums) if sums else torch.zeros(0, dtype=torch.int64)


def agree_on_initial_state(model: torch.nn.Module, group, device, log=print) -> list[int]:
    """Make every rank of ``group`` hold rank 0's parameters and buffers (collective; nothing
    to do without a group or on the meta device). Returns the ranks that differed; ``log``
    (rank 0's console) says so."""
    if group is None or dist.get_world_size(group) == 1:
        return []
    tensors = list(model.state_dict().values())
    if any(t.is_meta for t in tensors):
        return []
    mine = fingerprint(model).to(device)
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(everyone, mine, group=group)
    differ = [rank for rank, theirs in enumerate(everyone) if not torch.equal(theirs, everyone[0])]
    if not differ:
        return []
    source = dist.get_global_rank(group, 0)
    for tensor in tensors:  # rank 0's values, tensor by tensor (no second copy of the model)
        buffer = tensor.detach()
        if buffer.device != torch.device(device) or not buffer.is_contiguous():
            buffer = buffer.to(device).contiguous()
        dist.broadcast(buffer, src=source, group=group)
        if buffer.data_ptr() != tensor.data_ptr():
            with torch.no_grad():
                tensor.copy_(buffer)
    message = (
        f"the model's initial weights differed between ranks (rank(s) {differ} against rank 0): "
        "it was built before Trainer(...) seeded torch, or its init draws from a generator of "
        "its own. meshtrain copied rank 0's weights to every rank. To start from the weights "
        "one process builds too, build the model after Trainer(...) or pass a function that "
        "builds it: fit(lambda: MyModel(), ...)")
    log(f"warning: {message}")  # (rank 0's console)
    return differ
