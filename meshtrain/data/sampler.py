"""A batch sampler whose global batches do not depend on the data-parallel degree.

Policy
------
Each epoch has ONE global sample order, a function of ``(seed, epoch)`` only (or ``0..N-1``
without shuffling). The order is cut into global batches of ``global_batch_size`` (G) samples.
Global batch ``b`` is ``order[b*G:(b+1)*G]``; inside it, micro-step ``k`` of data-parallel rank
``r`` takes the ``(k*dp_degree + r)``-th slice of ``micro_batch_size`` (M) samples. Training on
1, 2 or 8 ranks therefore consumes the same global batches in the same order, and a run can be
resumed on another world size at the exact sample.

Last batch:

* ``last_batch="drop"`` (training): the trailing ``N % G`` samples of the epoch's order are not
  used, so every optimizer step sees a full global batch. With shuffling, a different set is
  dropped each epoch.
* ``last_batch="partial"`` (evaluation): nothing is dropped or repeated. The trailing ``R < G``
  samples are split over the ranks contiguously, sizes differing by at most one sample (rank
  ``r`` of ``D`` gets ``R // D + (r < R % D)``), and each rank yields its part in micro-batches
  of at most M. A rank may get fewer micro-batches than another, or none.

Position: ``consumed_samples`` counts the samples of this epoch consumed by completed optimizer
steps. The trainer calls ``advance()`` after each optimizer step; ``__iter__`` never advances,
because a DataLoader prefetches ahead of the step that uses a batch.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch.utils.data import Sampler

from meshtrain.errors import ConfigError

LAST_BATCH_POLICIES = ("drop", "partial")


def _check_positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{name} must be a positive integer, got {value!r}; pass e.g. {name}=1.")


def _check_non_negative_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(f"{name} must be an integer >= 0, got {value!r}.")


def _epoch_seed(seed: int, epoch: int) -> int:
    """Seed of the epoch's permutation: distinct (seed, epoch) pairs rarely collide."""
    return (seed * 1_000_003 + epoch) % (2**63)


class GlobalBatchSampler(Sampler[list[int]]):
    """Yields this data-parallel rank's micro-batches (lists of dataset indices) for one epoch.

    Use it as ``DataLoader(dataset, batch_sampler=sampler)``. Each global batch produces
    ``grad_accum_steps`` micro-batches on every rank (except the partial last batch).
    """

    def __init__(
        self,
        num_samples: int,
        *,
        global_batch_size: int,
        micro_batch_size: int,
        dp_rank: int = 0,
        dp_degree: int = 1,
        shuffle: bool = True,
        seed: int = 0,
        last_batch: str = "drop",
        piece_size: int | None = None,
        max_batches: int | None = None,
    ) -> None:
        _check_positive_int("num_samples", num_samples)
        _check_positive_int("global_batch_size", global_batch_size)
        _check_positive_int("micro_batch_size", micro_batch_size)
        _check_positive_int("dp_degree", dp_degree)
        _check_non_negative_int("dp_rank", dp_rank)
        if dp_rank >= dp_degree:
            raise ConfigError(
                f"dp_rank={dp_rank} is out of range for dp_degree={dp_degree}; "
                f"it must satisfy 0 <= dp_rank < dp_degree."
            )
        per_step = dp_degree * micro_batch_size
        if global_batch_size % per_step != 0:
            lower = max(per_step, global_batch_size // per_step * per_step)
            raise ConfigError(
                f"global_batch_size={global_batch_size} is not divisible by "
                f"dp_degree * micro_batch_size = {dp_degree} * {micro_batch_size} = {per_step}; "
                f"use a multiple of {per_step} (e.g. global_batch_size={lower} or "
                f"{lower + per_step}) or change micro_batch_size."
            )
        if last_batch not in LAST_BATCH_POLICIES:
            raise ConfigError(
                f"last_batch={last_batch!r} is unknown; use 'drop' (training) or "
                f"'partial' (evaluation)."
            )
        if last_batch == "drop" and num_samples < global_batch_size:
            raise ConfigError(
                f"num_samples={num_samples} is smaller than global_batch_size="
                f"{global_batch_size}, so with last_batch='drop' every epoch would be empty; "
                f"lower global_batch_size or use last_batch='partial'."
            )
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ConfigError(f"seed must be an integer, got {seed!r}.")

        self.num_samples = num_samples
        self.global_batch_size = global_batch_size
        self.micro_batch_size = micro_batch_size
        self.dp_rank = dp_rank
        self.dp_degree = dp_degree
        self.shuffle = bool(shuffle)
        self.seed = seed
        self.last_batch = last_batch
        self.grad_accum_steps = global_batch_size // per_step
        # a pipeline's draws: a rank's whole step, made of the pieces (its pipeline micro-
        # batches) it would read as accumulation micro-batches of that size, so that piece i
        # of every rank together is the global micro-step i of one process with that size
        self.piece_size = micro_batch_size if piece_size is None else piece_size
        assert micro_batch_size % self.piece_size == 0, (micro_batch_size, piece_size)
        self.max_batches = max_batches  # an epoch: its order's first global batches only
        self.epoch = 0
        self.consumed_samples = 0

    # ---------------------------------------------------------------- sizes

    @property
    def num_global_batches(self) -> int:
        """Global batches per epoch: full ones for 'drop', plus the partial one for 'partial'
        (at most ``max_batches``)."""
        full, tail = divmod(self.num_samples, self.global_batch_size)
        whole = full + (1 if tail and self.last_batch == "partial" else 0)
        return min(whole, self.max_batches or whole)

    @property
    def _num_full_batches(self) -> int:
        full = self.num_samples // self.global_batch_size
        return min(full, self.max_batches or full)

    def _tail_bounds(self) -> tuple[int, int]:
        """[start, stop) of this rank's part of the partial last batch, relative to its start."""
        tail = self.num_samples % self.global_batch_size
        base, extra = divmod(tail, self.dp_degree)
        start = self.dp_rank * base + min(self.dp_rank, extra)
        return start, start + base + (1 if self.dp_rank < extra else 0)

    def _num_tail_micro_batches(self) -> int:
        start, stop = self._tail_bounds()
        return -(-(stop - start) // self.micro_batch_size)

    def __len__(self) -> int:
        """Micro-batches this rank yields from the current position to the end of the epoch."""
        first = self.consumed_samples // self.global_batch_size
        full_left = max(0, self._num_full_batches - first)
        count = full_left * self.grad_accum_steps
        if self.num_global_batches > self._num_full_batches and first <= self._num_full_batches:
            count += self._num_tail_micro_batches()
        return count

    # ---------------------------------------------------------------- order

    def epoch_order(self, epoch: int | None = None) -> list[int]:
        """The global sample order of ``epoch`` (default: the current one); same on all ranks."""
        epoch = self.epoch if epoch is None else epoch
        if not self.shuffle:
            return list(range(self.num_samples))
        generator = torch.Generator()
        generator.manual_seed(_epoch_seed(self.seed, epoch))
        return torch.randperm(self.num_samples, generator=generator).tolist()

    def __iter__(self) -> Iterator[list[int]]:
        order = self.epoch_order()
        size = self.global_batch_size
        micro = self.micro_batch_size
        first = self.consumed_samples // size
        for b in range(first, self._num_full_batches):
            batch = order[b * size : (b + 1) * size]
            piece, pieces = self.piece_size, micro // self.piece_size
            for k in range(self.grad_accum_steps):
                slots = [(k * pieces + j) * self.dp_degree + self.dp_rank for j in range(pieces)]
                yield [i for slot in slots for i in batch[slot * piece : (slot + 1) * piece]]
        if self.num_global_batches > self._num_full_batches and first <= self._num_full_batches:
            tail = order[self._num_full_batches * size :]
            start, stop = self._tail_bounds()
            for lo in range(start, stop, micro):
                yield tail[lo : min(lo + micro, stop)]

    # ---------------------------------------------------------------- position

    def epoch_done(self) -> bool:
        """Whether this epoch's last global batch has been consumed."""
        return self.consumed_samples >= self.num_global_batches * self.global_batch_size

    def set_epoch(self, epoch: int) -> None:
        """Move to the start of ``epoch``."""
        _check_non_negative_int("epoch", epoch)
        self.epoch = epoch
        self.consumed_samples = 0

    def advance(self, num_global_batches: int = 1) -> None:
        """Record that ``num_global_batches`` optimizer steps of this epoch have completed."""
        _check_positive_int("num_global_batches", num_global_batches)
        consumed = self.consumed_samples + num_global_batches * self.global_batch_size
        end = self.num_global_batches * self.global_batch_size
        if consumed > end:
            raise ConfigError(
                f"advance({num_global_batches}) goes past the end of epoch {self.epoch} "
                f"({self.num_global_batches} global batches); call set_epoch(epoch + 1) to "
                f"start the next epoch."
            )
        self.consumed_samples = consumed

    def state_dict(self) -> dict[str, int | bool]:
        """Position and the settings that determine the sample order."""
        return {
            "epoch": self.epoch,
            "consumed_samples": self.consumed_samples,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "num_samples": self.num_samples,
        }

    def load_state_dict(self, state: dict) -> None:
        """Resume at a saved position; the dp degree and micro batch size may differ."""
        if state.get("kind") == "stream":
            raise ConfigError(
                "the checkpoint was trained on a stream (an IterableDataset), and this run has "
                "a map-style dataset; resume with the same kind of training data")
        missing = {"epoch", "consumed_samples", "seed", "shuffle", "num_samples"} - set(state)
        if missing:
            raise ConfigError(
                f"sampler state is missing {sorted(missing)}; pass a dict from state_dict()."
            )
        for key in ("num_samples", "seed", "shuffle"):
            if state[key] != getattr(self, key):
                raise ConfigError(
                    f"sampler state has {key}={state[key]!r} but this sampler has "
                    f"{key}={getattr(self, key)!r}, so the sample order would differ; build the "
                    f"sampler with {key}={state[key]!r} to resume."
                )
        _check_non_negative_int("epoch", state["epoch"])
        consumed = state["consumed_samples"]
        _check_non_negative_int("consumed_samples", consumed)
        if consumed % self.global_batch_size != 0:
            raise ConfigError(
                f"consumed_samples={consumed} is not a multiple of global_batch_size="
                f"{self.global_batch_size}, so resuming would split a global batch; resume "
                f"with the global_batch_size the checkpoint was trained with."
            )
        if consumed > self.num_global_batches * self.global_batch_size:
            raise ConfigError(
                f"consumed_samples={consumed} is past the end of an epoch of "
                f"{self.num_global_batches} global batches of {self.global_batch_size}; "
                f"check that the checkpoint belongs to this dataset."
            )
        self.epoch = state["epoch"]
        self.consumed_samples = consumed


def make_loader(dataset, original, batch_sampler, *, num_workers: int, seed: int,
                pin_memory: bool = False, persistent: bool = True):
    """A DataLoader over ``dataset`` drawing ``batch_sampler``'s batches; ``original`` (what the
    user passed) lends its collate_fn and num_workers when it is a DataLoader. ``persistent``:
    worker processes live on between epochs (until :func:`release_workers`); else they end with
    each pass (one evaluation)."""
    import torch
    from torch.utils.data import DataLoader

    collate = original.collate_fn if isinstance(original, DataLoader) else None
    workers = original.num_workers if isinstance(original, DataLoader) else num_workers
    # Every iter(loader) draws a worker seed from this generator; from the global one it would
    # shift the stream that dropout uses, so a resumed (or validated) run would diverge.
    return DataLoader(dataset, batch_sampler=batch_sampler, collate_fn=collate,
                      num_workers=workers, pin_memory=pin_memory,
                      persistent_workers=persistent and workers > 0,
                      generator=torch.Generator().manual_seed(seed))


def train_loaders(dataset, original, *, global_batch_size: int, micro_batch_size: int,
                  dp_rank: int, dp_degree: int, shuffle: bool, seed: int, num_workers: int,
                  loader_seed: int, pin_memory: bool, piece_size: int | None = None,
                  max_batches: int | None = None):
    """(sampler, loader) over the training data: a GlobalBatchSampler for a map-style dataset,
    a StreamSampler (meshtrain.data.stream) for an IterableDataset; both keep the position
    that checkpoints save. ``piece_size``: a pipeline's micro-batch size (each draw a whole
    step of such pieces, laid out as accumulation would read them); ``max_batches``: an
    epoch's first global batches only (``limit_train_batches``; map-style data)."""
    from meshtrain.data.stream import is_stream, stream_loaders

    if is_stream(dataset):
        return stream_loaders(dataset, original, global_batch_size=global_batch_size,
                              micro_batch_size=micro_batch_size, dp_rank=dp_rank,
                              dp_degree=dp_degree, num_workers=num_workers, seed=loader_seed,
                              pin_memory=pin_memory, piece_size=piece_size)
    sampler = GlobalBatchSampler(len(dataset), global_batch_size=global_batch_size,
                                 micro_batch_size=micro_batch_size, dp_rank=dp_rank,
                                 dp_degree=dp_degree, shuffle=shuffle, seed=seed,
                                 piece_size=piece_size, max_batches=max_batches)
    return sampler, make_loader(dataset, original, sampler, num_workers=num_workers,
                                seed=loader_seed, pin_memory=pin_memory)


def eval_loader(dataset, original, *, micro_batch_size: int, dp_rank: int, dp_degree: int,
                num_workers: int, loader_seed: int, pin_memory: bool,
                max_samples: int | None = None):
    """This rank's evaluation micro-batches: every sample once over all ranks, none dropped
    (of the first ``max_samples`` samples, when given: the same ones whatever the ranks)."""
    from meshtrain.data.stream import is_stream, stream_eval_loader

    if is_stream(dataset):
        return stream_eval_loader(dataset, original, micro_batch_size=micro_batch_size,
                                  dp_rank=dp_rank, dp_degree=dp_degree,
                                  num_workers=num_workers, seed=loader_seed,
                                  pin_memory=pin_memory, max_samples=max_samples)
    sampler = GlobalBatchSampler(
        min(len(dataset), max_samples or len(dataset)), global_batch_size=dp_degree * micro_batch_size,
        micro_batch_size=micro_batch_size, dp_rank=dp_rank, dp_degree=dp_degree,
        shuffle=False, last_batch="partial")
    return make_loader(dataset, original, sampler, num_workers=num_workers, seed=loader_seed,
                       pin_memory=pin_memory, persistent=False)  # workers end with the pass


def release_workers(loader) -> None:
    """End a DataLoader's persistent worker processes now; left to the garbage collector, they
    end whenever it runs, and joining them may then block (5 s per worker in torch 2.13)."""
    iterator = getattr(loader, "_iterator", None)
    if iterator is not None and hasattr(iterator, "_shutdown_workers"):
        iterator._shutdown_workers()
        loader._iterator = None
