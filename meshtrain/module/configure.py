"""What a module's ``configure_optimizers()`` returns, read as Lightning reads it: the optimizer,
and its scheduler with when to step it (after every optimizer step, or at the end of every
``frequency``-th epoch, ReduceLROnPlateau with the monitored value).

The forms: an optimizer; ``[optimizer]``; ``([optimizer], [scheduler])``; ``{"optimizer": ...,
"lr_scheduler": scheduler or {"scheduler": ..., "interval": ..., "frequency": ..., "monitor":
...}}`` (a scheduler without its interval steps per epoch, as in Lightning); and meshtrain's own
``(optimizer, scheduler)``, stepped after every optimizer step (as ``fit(lr_scheduler=...)``).
"""

from __future__ import annotations

import dataclasses

import torch

from meshtrain.errors import ConfigError

_MANY = ("configure_optimizers returned several optimizers: with automatic optimisation "
         "meshtrain steps one; return one (and optionally its scheduler), or set "
         "automatic_optimization = False and step them in training_step")


@dataclasses.dataclass(frozen=True)
class Schedule:
    """When the Trainer steps the scheduler: ``interval`` "step" (after every optimizer step)
    or "epoch" (at the end of every ``frequency``-th training epoch); ``monitor``: the value
    ReduceLROnPlateau reads (a name in ``trainer.callback_metrics``)."""

    interval: str = "step"
    frequency: int = 1
    monitor: str | None = None


def read(made) -> tuple[torch.optim.Optimizer, object, Schedule]:
    """(optimizer, scheduler or None, its Schedule) from what configure_optimizers returned
    (automatic optimisation: one optimizer)."""
    scheduler, monitor = None, None
    if isinstance(made, dict):
        optimizer, scheduler, monitor = made.get("optimizer"), made.get("lr_scheduler"), \
            made.get("monitor")
        lightning = True
    elif isinstance(made, (tuple, list)) and len(made) == 2 and isinstance(made[0], list):
        optimizers, schedulers = made  # Lightning's ([optimizer], [scheduler])
        if len(optimizers) != 1 or len(schedulers) > 1:
            raise ConfigError(_MANY if len(optimizers) != 1 else
                              "configure_optimizers returned several schedulers; return one")
        optimizer, scheduler, lightning = optimizers[0], (schedulers or [None])[0], True
    elif isinstance(made, (tuple, list)) and len(made) == 1:
        optimizer, lightning = made[0], True
    elif isinstance(made, (tuple, list)):
        if len(made) != 2 or isinstance(made[1], torch.optim.Optimizer):
            raise ConfigError(_MANY)
        optimizer, scheduler, lightning = made[0], made[1], False
    else:
        optimizer, lightning = made, True
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ConfigError(f"configure_optimizers must return a torch.optim.Optimizer (or "
                          f"(optimizer, scheduler), or Lightning's forms), got "
                          f"{type(optimizer).__name__}")
    if scheduler is None:
        return optimizer, None, Schedule()
    config = scheduler if isinstance(scheduler, dict) else {"scheduler": scheduler}
    scheduler = config.get("scheduler")
    interval = config.get("interval", "epoch" if lightning else "step")
    frequency = config.get("frequency", 1)
    monitor = config.get("monitor", monitor)
    if interval not in ("step", "epoch"):
        raise ConfigError(f"configure_optimizers: the scheduler's interval must be 'step' or "
                          f"'epoch', got {interval!r}")
    if not isinstance(frequency, int) or isinstance(frequency, bool) or frequency < 1:
        raise ConfigError(f"configure_optimizers: the scheduler's frequency must be a positive "
                          f"integer, got {frequency!r}")
    if interval == "step" and frequency != 1:
        raise ConfigError("configure_optimizers: a scheduler stepped every N optimizer steps "
                          "is not supported; scale its schedule to steps (frequency 1)")
    plateau = isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)
    if plateau and interval == "step":
        raise ConfigError("configure_optimizers: ReduceLROnPlateau steps on a monitored value "
                          "at epoch ends here; leave its interval 'epoch'")
    if plateau and monitor is None:
        raise ConfigError("configure_optimizers: ReduceLROnPlateau needs the value it watches: "
                          "{'scheduler': ..., 'monitor': 'val/loss'} (a logged name)")
    return optimizer, scheduler, Schedule(interval, frequency, monitor if plateau else None)


def check_monitor(schedule: Schedule, val_data, settings: dict) -> None:
    """Before start: a ReduceLROnPlateau watching a validation value needs validation at every
    epoch's end (Lightning validates every epoch; meshtrain when asked)."""
    if not schedule.monitor.startswith("val") or settings["val_every_n_steps"] is not None:
        return
    every = settings["val_every_n_epochs"]
    if val_data is None or not every or schedule.frequency % every:
        raise ConfigError(
            f"ReduceLROnPlateau watches {schedule.monitor!r} at every epoch's end, so "
            "validation must run there: give val_data and val_every_n_epochs=1 (Lightning's "
            "check_val_every_n_epoch=1, its default), or a divisor of the scheduler's "
            "frequency")


def step_at_epoch_end(trainer) -> None:
    """Step a scheduler of interval "epoch" at the end of a training epoch (every
    ``frequency``-th); ReduceLROnPlateau with its monitored value."""
    schedule, scheduler = trainer.lr_schedule, trainer.lr_scheduler
    if scheduler is None or schedule.interval != "epoch" or \
            (trainer.current_epoch + 1) % schedule.frequency:
        return
    if schedule.monitor is None:
        scheduler.step()
        return
    if schedule.monitor not in trainer.callback_metrics:
        raise ConfigError(
            f"ReduceLROnPlateau watches {schedule.monitor!r}, which was not logged by the end "
            f"of epoch {trainer.current_epoch}; logged: "
            f"{', '.join(sorted(trainer.callback_metrics)) or 'nothing'} (validation runs at "
            "the end of fit unless val_every_n_epochs= or val_every_n_steps= is set)")
    scheduler.step(float(trainer.callback_metrics[schedule.monitor]))
