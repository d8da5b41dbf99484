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

Without ``seed=`` the seed is the user's own ``torch.manual_seed(N)`` made before the Trainer
(:func:`seed_from_torch`; ``lightning.seed_everything(N)`` is read from ``PL_GLOBAL_SEED``), else
0; once the processes exist every rank's seed must be the same (:func:`check_seed_agrees`).
"""

from __future__ import annotations

import random

import torch
import torch.distributed as dist


#: torch's global seed as this process last saw it: ``left``, the value meshtrain left (a
#: Trainer's seeding, or what a fit's own reseeding left); ``taken``, the seed last taken from
#: the user's ``torch.manual_seed`` (None: none taken)
_SEEDS: dict[str, int | None] = {"left": None, "taken": None}

#: A user's seed is below this; torch seeds a fresh process with 64 random bits (above it but
#: once in 2**32 processes)
USER_SEEDS = 2**32


def seed_from_torch() -> int | None:
    """The seed of the user's ``torch.manual_seed(N)`` before ``Trainer()``, or None.

    ``torch.initial_seed()`` is the last value the global generator was seeded with (drawing
    numbers does not change it). What is taken for the user's: a value that differs from the
    one meshtrain itself left last in this process (a Trainer seeds torch, a fit reseeds it per
    rank), and is below 2**32 (a fresh process's seed is 64 random bits; a seed someone wrote
    is small): the same number then answers every later Trainer until the user seeds again.
    A large seed of the user's (above 2**32) is not told from torch's own: seed= takes it."""
    current = torch.initial_seed()
    if current != _SEEDS["left"]:  # seeded since meshtrain last did: by the user (or nobody)
        _SEEDS["taken"] = current if current < USER_SEEDS else None
    return _SEEDS["taken"]


def remember_seed() -> None:
    """Where meshtrain is done with torch's global generator (the end of a fit): what it left
    is its own, not a seed of the user's."""
    _SEEDS["left"] = torch.initial_seed()


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
    remember_seed()


def check_seed_agrees(seed: int, group) -> None:
    """(Collective, once the processes exist.) Every rank of ``group`` must have the same
    seed: it orders the data and initialises a factory's model, and ranks that differ would
    read overlapping samples (a ``torch.manual_seed(base + rank)`` before the Trainer, or a
    per-rank seed=). Refused on every rank alike, naming the fix."""
    if group is None or dist.get_world_size(group) == 1:
        return
    seeds: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(seeds, seed, group=group)
    if len(set(seeds)) > 1:
        from meshtrain.errors import ConfigError

        shown = ", ".join(f"rank {r}: {s}" for r, s in enumerate(seeds[:4]))
        raise ConfigError(
            f"the ranks' seeds differ ({shown}{', ...' if len(seeds) > 4 else ''}): the seed "
            "orders the data and initialises the model, so every rank needs the same one. Pass "
            "the same Trainer(seed=N) on every rank (a torch.manual_seed(N) before Trainer() "
            "is taken as its seed when seed= is not given: make it the same on every rank; "
            "draw per-rank randomness after the Trainer)")


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
