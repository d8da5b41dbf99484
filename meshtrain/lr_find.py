"""Learning-rate range test (Smith, "Cyclical Learning Rates for Training Neural Networks", 2017).

Train for a few steps while the learning rate grows exponentially from ``min_lr`` to ``max_lr``,
record the (smoothed) loss, stop when it diverges, and suggest the rate where the loss falls
fastest. The model and optimizer are put back as they were afterwards.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from meshtrain.data.sampler import release_workers
from meshtrain.errors import ConfigError


@dataclass
class LRFindResult:
    lrs: list[float]
    losses: list[float]  # smoothed
    suggested_lr: float | None
    plot_path: Path | None = None


def suggest_lr(lrs: list[float], losses: list[float], skip_start: int = 2) -> float | None:
    """The rate at the steepest descent of loss against log(lr)."""
    if len(lrs) < skip_start + 3:
        return None
    log_lrs = np.log10(np.asarray(lrs[skip_start:]))
    slope = np.gradient(np.asarray(losses[skip_start:]), log_lrs)
    return float(10 ** log_lrs[int(np.argmin(slope))])


def lr_find(trainer, model, train_data, *, optimizer, loss_fn=None, min_lr: float = 1e-6,
            max_lr: float = 1.0, num_steps: int = 100, smoothing: float = 0.9,
            diverge_factor: float = 4.0) -> LRFindResult:
    """Run the range test with ``trainer``'s layout and batch settings (collective)."""
    if not 0 < min_lr < max_lr:
        raise ConfigError(f"need 0 < min_lr < max_lr, got min_lr={min_lr}, max_lr={max_lr}")
    if num_steps < 5:
        raise ConfigError(f"num_steps must be at least 5 for a useful curve, got {num_steps}")
    # a range test starts from scratch, and its loss is meant to blow up at the end
    trainer.resume, trainer.nan_policy = None, None
    trainer.prepare(model, train_data, optimizer=optimizer, loss_fn=loss_fn)
    model_state = copy.deepcopy(trainer.model.state_dict())
    optim_state = copy.deepcopy(trainer.optimizer.state_dict())
    sampler, loader = trainer.state.sampler, trainer.train_loader

    lrs, losses = [], []
    best, average = math.inf, 0.0
    batches = iter(loader)
    for i in range(num_steps):
        lr = min_lr * (max_lr / min_lr) ** (i / (num_steps - 1))
        for group in trainer.optimizer.param_groups:
            group["lr"] = lr
        if sampler.epoch_done():
            sampler.set_epoch(sampler.epoch + 1)
            batches = iter(loader)
        loss, _, _ = trainer.train_step(batches)
        sampler.advance()
        value = trainer.mesh.mean_loss(loss)
        average = smoothing * average + (1 - smoothing) * value
        smoothed = average / (1 - smoothing ** (i + 1))
        if not math.isfinite(smoothed) or (i > 0 and smoothed > diverge_factor * best):
            break
        best = min(best, smoothed)
        lrs.append(lr)
        losses.append(smoothed)

    trainer.model.load_state_dict(model_state)
    trainer.optimizer.load_state_dict(optim_state)
    sampler.set_epoch(0)
    release_workers(loader)
    result = LRFindResult(lrs, losses, suggest_lr(lrs, losses))
    if trainer.is_global_zero:
        from meshtrain.observe.plots import plot_lr_find

        result.plot_path = plot_lr_find(lrs, losses, result.suggested_lr,
                                        trainer.run_dir / "lr_find.png")
        shown = f"{result.suggested_lr:.2e}" if result.suggested_lr else "none (too few points)"
        trainer.print(f"lr-find: suggested learning rate {shown}; plot: {result.plot_path}")
    return result
