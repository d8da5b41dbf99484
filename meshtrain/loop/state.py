"""Where a training run stands, as one object that checkpoints save and load.

:class:`LoopState` holds the step, the epoch, the position in the data (the sampler), the
skipped-step count and the logging window; ``state_dict()`` is what ``trainer_state.pt`` holds
besides the scheduler and grad scaler. (Each rank's RNG streams are saved beside it by
:mod:`meshtrain.checkpoint.state`.)
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

import torch

# Trainer.stop_reason values after which the run is to be continued: the time limit
# (max_time_minutes) and a stop signal (stop_on_signal); a final checkpoint is saved and marked
# unfinished, so resume="auto" continues from it.
RESUMABLE_STOPS = ("max_time", "signal")


@dataclass
class MetricWindow:
    """Losses and tokens since the last log line."""

    loss: torch.Tensor
    num_steps: int = 0
    tokens: int = 0
    start: float = field(default_factory=time.perf_counter)

    def add(self, loss: torch.Tensor, tokens: int, counted: bool) -> None:
        if counted:  # skipped steps count their tokens, not their loss
            self.loss += loss
            self.num_steps += 1
        self.tokens += tokens

    def reset(self) -> None:
        self.loss.zero_()
        self.num_steps, self.tokens, self.start = 0, 0, time.perf_counter()

    @contextlib.contextmanager
    def paused(self):
        """Time inside does not count towards the window's throughput (validation)."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.start += time.perf_counter() - start


@dataclass
class LoopState:
    """Step, epoch, data position (``sampler``), skipped steps and rollbacks of one fit."""

    global_step: int = 0
    current_epoch: int = 0
    num_skipped_steps: int = 0
    num_rollbacks: int = 0
    sampler: object | None = None  # a GlobalBatchSampler (or StreamSampler) once fit has data
    window: MetricWindow | None = None

    def epoch_done(self) -> bool:
        return self.sampler.epoch_done()

    def next_epoch(self) -> None:
        self.current_epoch += 1
        self.sampler.set_epoch(self.current_epoch)

    def advance(self) -> None:
        """One optimizer step's batch is consumed."""
        self.sampler.advance()
        self.global_step += 1

    def state_dict(self) -> dict:
        return {
            "global_step": self.global_step, "current_epoch": self.current_epoch,
            # `is not None`: the sampler has a __len__, which is 0 (falsy) at an epoch's end
            "sampler": self.sampler.state_dict() if self.sampler is not None else None,
            "num_skipped_steps": self.num_skipped_steps,
        }

    def load_state_dict(self, state: dict) -> None:
        self.global_step = state["global_step"]
        self.current_epoch = state["current_epoch"]
        self.num_skipped_steps = state.get("num_skipped_steps", 0)
        if state["sampler"] is not None and self.sampler is not None:
            self.sampler.load_state_dict(state["sampler"])


def loader_options(t) -> dict:
    """The DataLoader options of every loader a Trainer ``t`` builds (training, evaluation,
    prediction): workers, pinned memory on CUDA, the workers' seed (alike where the samples
    are)."""
    return {"num_workers": t.num_workers, "pin_memory": t.device_type == "cuda",
            "loader_seed": t.seed + t.dp_rank}


class NotBuiltYet(Exception):
    """The training data is a function not called yet: the steps are known once it is."""


def stepping_batches(t) -> float:
    """Lightning's ``trainer.estimated_stepping_batches``: the optimizer steps ``fit`` takes
    (``max_steps``, or ``max_epochs`` x the epoch's whole global batches), known before the
    loaders exist (a module's ``configure_optimizers`` reads it for OneCycleLR); inf for a
    stream bounded by epochs only."""
    if t.state.sampler is not None:
        return t.total_steps()
    size = getattr(t, "_train_size", None)
    if size == "later" and not t.max_steps:
        raise NotBuiltYet("estimated_stepping_batches: the training data is built later")
    per_epoch = size // t.global_batch_size if isinstance(size, int) else None
    if per_epoch is not None and t.limit_train_batches:
        per_epoch = min(per_epoch, t.limit_train_batches)
    by_epochs = t.max_epochs * per_epoch if t.max_epochs and per_epoch is not None else \
        float("inf")
    return min(t.max_steps or float("inf"), by_epochs)
