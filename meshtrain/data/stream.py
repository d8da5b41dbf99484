"""Streaming data: an ``IterableDataset`` read in one global order, whatever the dp degree.

Policy
------
A stream's items, numbered 0, 1, 2, ... in the order one pass over the dataset yields them,
are cut into global batches exactly as :class:`~meshtrain.data.sampler.GlobalBatchSampler`
cuts a map-style order: global batch ``b`` is items ``[b*G, (b+1)*G)``, and micro-step ``k``
of data-parallel rank ``r`` takes the ``(k*dp_degree + r)``-th slice of ``M`` items. Each
pass is an epoch (``dataset.set_epoch(epoch)`` is called first when the dataset has it, as
Hugging Face ``datasets`` streams do); a trailing partial global batch ends the pass unused.

Sharding: every rank (and every DataLoader worker of a rank) reads the stream and keeps only
its own slices, so the global batches, and therefore the training, do not depend on how many
ranks read it. The price is that each reader decodes every item; a source whose items are
costly should keep the costly part after the selection (a map-style dataset over prepared
shards, :class:`~meshtrain.data.tokens.PackedTokens`, reads only its own samples).

Resume: the position is ``(epoch, consumed_samples)``, saved in checkpoints like the sampler's.
Resuming -- on the same or another dp degree, micro-batch size or number of workers -- reads the
pass again from its start and skips the consumed items (``dataset.skip(n)`` when the dataset
has one, else by reading them), so it continues with exactly the next items, provided the
stream yields the same sequence when read again after ``set_epoch(epoch)`` (a shuffle buffer
must be seeded from the epoch). ``global_batch_size`` must stay the same. A stream with no
``__len__`` has no known epoch length: training it needs ``max_steps``.
"""

from __future__ import annotations

import math
from itertools import islice

from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from meshtrain.errors import ConfigError


def is_stream(dataset) -> bool:
    return isinstance(dataset, IterableDataset)


def stream_length(dataset) -> int | None:
    """``len(dataset)`` when the stream declares one, else None."""
    try:
        return len(dataset)
    except TypeError:
        return None


def first_items(dataset, count: int) -> list:
    """The first ``count`` items of one pass (fewer when the stream is shorter)."""
    if hasattr(dataset, "set_epoch"):
        dataset.set_epoch(0)
    return list(islice(iter(dataset), count))


def _pass_from(dataset, epoch: int, start: int):
    """An iterator over one pass of ``dataset`` from item ``start`` on."""
    if hasattr(dataset, "set_epoch"):
        dataset.set_epoch(epoch)
    if start and callable(getattr(dataset, "skip", None)):
        return iter(dataset.skip(start))
    return islice(iter(dataset), start, None)


def _worker() -> tuple[int, int]:
    info = get_worker_info()
    return (info.id, info.num_workers) if info is not None else (0, 1)


class _RankSlices(IterableDataset):
    """This rank's items of the global batches from item ``start`` on, in micro-batch order;
    DataLoader worker ``w`` of ``W`` yields this rank's micro-batches ``t`` with ``t % W == w``,
    which the DataLoader's round-robin over workers puts back in order."""

    def __init__(self, dataset, *, epoch, start, global_batch_size, micro_batch_size, dp_rank,
                 dp_degree, piece_size=None):
        self.dataset, self.epoch, self.start = dataset, epoch, start
        self.size, self.micro = global_batch_size, micro_batch_size
        self.rank, self.ways = dp_rank, dp_degree
        self.piece = piece_size or micro_batch_size  # (as GlobalBatchSampler's piece_size)

    def __iter__(self):
        worker, workers = _worker()
        items = _pass_from(self.dataset, self.epoch, self.start)
        pieces = self.micro // self.piece  # of one micro-batch
        own = list(range(self.rank, self.size // self.piece, self.ways))
        t = 0  # this rank's micro-batches so far
        while True:
            batch = list(islice(items, self.size))
            if len(batch) < self.size:  # a partial global batch is not trained
                return
            for first in range(0, len(own), pieces):
                if t % workers == worker:
                    for slot in own[first:first + pieces]:
                        yield from batch[slot * self.piece:(slot + 1) * self.piece]
                t += 1


class _EvalSlices(IterableDataset):
    """Evaluation: consecutive micro-batches of ``M`` items go to the ranks in turn (the last
    may be short); every item is seen once over all ranks."""

    def __init__(self, dataset, *, micro_batch_size, dp_rank, dp_degree, max_samples=None):
        self.dataset, self.micro, self.rank, self.ways = (
            dataset, micro_batch_size, dp_rank, dp_degree)
        self.max_samples = max_samples  # the first items only (the same ones on any ranks)

    def __iter__(self):
        worker, workers = _worker()
        items = islice(_pass_from(self.dataset, 0, 0), self.max_samples)
        t = 0
        while chunk := list(islice(items, self.micro)):
            if t % self.ways == self.rank and (t // self.ways) % workers == worker:
                yield chunk
            t += 1


class _Lookahead:
    """An iterator that can tell whether another element follows (the loop asks before a step
    whether the pass has ended)."""

    def __init__(self, iterator, sampler) -> None:
        self.iterator, self.sampler, self.buffer, self.yielded = iterator, sampler, [], 0

    def __iter__(self):
        return self

    def ended(self) -> bool:
        if not self.buffer:
            try:
                self.buffer.append(next(self.iterator))
            except StopIteration:
                if self.yielded == 0 and self.sampler.consumed_samples == 0:
                    raise ConfigError(
                        f"the training stream yielded fewer than one global batch "
                        f"({self.sampler.global_batch_size} items) in epoch "
                        f"{self.sampler.epoch}; lower global_batch_size or check the "
                        "dataset's __iter__ (a stream is read again from its start each "
                        "epoch)") from None
                return True
        return False

    def __next__(self):
        if self.ended():
            raise StopIteration
        self.yielded += 1
        return self.buffer.pop()


class StreamSampler:
    """Where training stands in a stream: the role GlobalBatchSampler plays for a map-style
    dataset (``epoch``, ``consumed_samples``, ``advance``, ``state_dict``)."""

    def __init__(self, dataset, *, global_batch_size: int, micro_batch_size: int,
                 dp_rank: int, dp_degree: int, piece_size: int | None = None) -> None:
        self.dataset, self.piece_size = dataset, piece_size
        self.global_batch_size, self.micro_batch_size = global_batch_size, micro_batch_size
        self.dp_rank, self.dp_degree = dp_rank, dp_degree
        self.grad_accum_steps = global_batch_size // (dp_degree * micro_batch_size)
        self.epoch = self.consumed_samples = 0
        self.current: _Lookahead | None = None  # the pass the loop is reading

    @property
    def num_global_batches(self) -> float:
        """Global batches per epoch: ``len(dataset) // G``, or infinity for a stream without
        a length (its passes end when it does)."""
        length = stream_length(self.dataset)
        return math.inf if length is None else length // self.global_batch_size

    def epoch_done(self) -> bool:
        if self.consumed_samples >= self.num_global_batches * self.global_batch_size:
            return True
        return self.current is not None and self.current.ended()

    def rank_slices(self) -> _RankSlices:
        return _RankSlices(self.dataset, epoch=self.epoch, start=self.consumed_samples,
                           global_batch_size=self.global_batch_size,
                           micro_batch_size=self.micro_batch_size, dp_rank=self.dp_rank,
                           dp_degree=self.dp_degree, piece_size=self.piece_size)

    def set_epoch(self, epoch: int) -> None:
        self.epoch, self.consumed_samples, self.current = epoch, 0, None

    def advance(self, num_global_batches: int = 1) -> None:
        self.consumed_samples += num_global_batches * self.global_batch_size

    def state_dict(self) -> dict:
        return {"kind": "stream", "epoch": self.epoch, "consumed_samples": self.consumed_samples,
                "global_batch_size": self.global_batch_size}

    def load_state_dict(self, state: dict) -> None:
        if state.get("kind") != "stream":
            raise ConfigError(
                "the checkpoint was trained on a map-style dataset, and this run streams an "
                "IterableDataset; resume with the same kind of training data")
        if state["consumed_samples"] % self.global_batch_size:
            raise ConfigError(
                f"the checkpoint consumed {state['consumed_samples']} items of the stream, not "
                f"a multiple of global_batch_size={self.global_batch_size}; resume with the "
                f"global_batch_size it was trained with ({state['global_batch_size']})")
        self.epoch, self.consumed_samples = state["epoch"], state["consumed_samples"]
        self.current = None


class StreamLoader:
    """``iter(loader)`` starts reading the sampler's pass at its current position."""

    def __init__(self, sampler: StreamSampler, make) -> None:
        self.sampler, self.make = sampler, make  # make(iterable) -> DataLoader

    def __iter__(self) -> _Lookahead:
        self.sampler.current = _Lookahead(iter(self.make(self.sampler.rank_slices())),
                                          self.sampler)
        return self.sampler.current


def stream_loaders(dataset, original, *, global_batch_size, micro_batch_size, dp_rank,
                   dp_degree, num_workers, seed, pin_memory, piece_size=None):
    """(sampler, loader) for training on a stream."""
    collate = original.collate_fn if isinstance(original, DataLoader) else None
    workers = original.num_workers if isinstance(original, DataLoader) else num_workers

    def make(iterable):
        import torch

        return DataLoader(iterable, batch_size=micro_batch_size, collate_fn=collate,
                          num_workers=workers, pin_memory=pin_memory,
                          generator=torch.Generator().manual_seed(seed))

    sampler = StreamSampler(dataset, global_batch_size=global_batch_size,
                            micro_batch_size=micro_batch_size, dp_rank=dp_rank,
                            dp_degree=dp_degree, piece_size=piece_size)
    return sampler, StreamLoader(sampler, make)


def stream_eval_loader(dataset, original, *, micro_batch_size, dp_rank, dp_degree,
                       num_workers, seed, pin_memory, max_samples=None) -> DataLoader:
    """This rank's evaluation micro-batches of a stream (already batched: each item is a list
    of samples, collated by the DataLoader), of its first ``max_samples`` items when given."""
    import torch
    from torch.utils.data import default_collate

    collate = original.collate_fn if isinstance(original, DataLoader) else default_collate
    workers = original.num_workers if isinstance(original, DataLoader) else num_workers
    return DataLoader(_EvalSlices(dataset, micro_batch_size=micro_batch_size, dp_rank=dp_rank,
                                  dp_degree=dp_degree, max_samples=max_samples),
                      batch_size=None, collate_fn=collate, num_workers=workers,
                      pin_memory=pin_memory, generator=torch.Generator().manual_seed(seed))
