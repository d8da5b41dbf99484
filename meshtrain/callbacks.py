"""Callbacks: code that runs at fixed points of training without touching the loop.

Hooks run on every rank (so a callback may take part in collectives, e.g. saving a checkpoint);
anything that writes files or prints should check ``trainer.is_global_zero``. Metrics seen by
callbacks (``trainer.callback_metrics``) are already averaged over the data-parallel ranks, so
every rank takes the same decision.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import torch

from meshtrain.errors import ConfigError


class Callback:
    """Base class: override the hooks you need.

    A callback with state to keep across a resume returns it from ``state_dict()`` (tensors as
    this rank holds them, e.g. shards of the parameters: checkpoints save them with the model,
    resharded on load like it) and takes it back in ``load_state_dict``; ``setup`` runs once the
    model is laid out, before a checkpoint is loaded, and builds what the state loads into."""

    def setup(self, trainer) -> None: ...
    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None: ...
    def on_fit_start(self, trainer) -> None: ...
    def on_fit_end(self, trainer) -> None: ...
    def on_train_epoch_start(self, trainer) -> None: ...
    def on_train_epoch_end(self, trainer) -> None: ...
    def on_train_step_start(self, trainer) -> None: ...
    def on_before_optimizer_step(self, trainer) -> None:
        """Gradients are final here (averaged over data-parallel ranks, unscaled when
        clipping or logging their norm), before clipping and the optimizer step."""

    def on_train_step_end(self, trainer, metrics: dict) -> None: ...
    def on_validation_start(self, trainer) -> None: ...
    def on_validation_end(self, trainer, metrics: dict) -> None: ...
    def on_exception(self, trainer, error: BaseException) -> None: ...


def _check_mode(mode: str) -> None:
    if mode not in ("min", "max"):
        raise ConfigError(f"mode must be 'min' or 'max', got {mode!r}")


def _improved(value: float, best: float, mode: str, min_delta: float = 0.0) -> bool:
    return value < best - min_delta if mode == "min" else value > best + min_delta


class EarlyStopping(Callback):
    """Stop when ``monitor`` (a validation metric) has not improved for ``patience`` checks.

    Lightning's options too: ``check_finite`` (stop at a NaN or infinite value),
    ``stopping_threshold`` (stop once the value is that good), ``divergence_threshold`` (stop
    once it is worse than that), ``strict=False`` (a validation without the value is skipped,
    not an error); ``verbose`` changes nothing (the stop is always said). A ``monitor`` the
    run's validation does not log is refused before start, naming the closest it does
    (``meshtrain.checks.check_monitors``)."""

    def __init__(self, monitor: str = "val/loss", patience: int = 3, mode: str = "min",
                 min_delta: float = 0.0, *, check_finite: bool = True,
                 stopping_threshold: float | None = None,
                 divergence_threshold: float | None = None, strict: bool = True,
                 verbose: bool = False):
        _check_mode(mode)
        if patience < 1:
            raise ConfigError(f"EarlyStopping patience must be at least 1, got {patience}")
        self.monitor, self.patience, self.mode, self.min_delta = monitor, patience, mode, min_delta
        self.check_finite, self.strict = check_finite, strict
        self.stopping_threshold, self.divergence_threshold = stopping_threshold, \
            divergence_threshold
        self.best = math.inf if mode == "min" else -math.inf
        self.num_bad_checks = 0
        self.stopped_at_step: int | None = None

    def on_validation_end(self, trainer, metrics: dict) -> None:
        if self.monitor not in metrics:
            if not self.strict:
                return
            raise ConfigError(
                f"EarlyStopping monitors {self.monitor!r} but validation produced "
                f"{sorted(metrics)}; set monitor= to one of those"
            )
        value = float(metrics[self.monitor])
        why = self._why_stop(value)
        if why is None:
            return
        trainer.should_stop = True
        self.stopped_at_step = trainer.global_step
        trainer.print(f"early stopping at step {trainer.global_step}: {self.monitor} {why}")

    def _why_stop(self, value: float) -> str | None:
        better = (lambda a, b: a <= b) if self.mode == "min" else (lambda a, b: a >= b)
        if self.check_finite and not math.isfinite(value):
            return f"is {value}"
        if self.stopping_threshold is not None and better(value, self.stopping_threshold):
            return f"{value:.4f} reached the stopping threshold {self.stopping_threshold}"
        if self.divergence_threshold is not None and \
                not better(value, self.divergence_threshold):
            return f"{value:.4f} is past the divergence threshold {self.divergence_threshold}"
        if _improved(value, self.best, self.mode, self.min_delta):
            self.best, self.num_bad_checks = value, 0
            return None
        self.num_bad_checks += 1
        if self.num_bad_checks >= self.patience:
            return (f"has not improved for {self.patience} validations (best "
                    f"{self.best:.4f})")
        return None


class ModelCheckpoint(Callback):
    """Save checkpoints: the best ``save_top_k`` by ``monitor``, every N steps, and/or the last.

    A policy of the run's one checkpoint writer (``trainer.checkpoints``): it decides when and
    under which name, the writer writes (atomically, never NaN/Inf, never twice).

    Files go to ``dirpath`` (default ``<run folder>/checkpoints``); ``best_model_path`` names the
    best one so far. Every-N-step folders have the periodic checkpoints' names
    (``step_00000012``), so ``resume="auto"`` finds them; best-k folders of a resumed run keep
    counting towards ``save_top_k``; ``last`` is the folder already written at the last step
    (``final``, or a periodic one) when there is one (not a second copy).
    """

    def __init__(self, dirpath: str | Path | None = None, monitor: str | None = None,
                 mode: str = "min", save_top_k: int = 1, save_last: bool = True,
                 every_n_steps: int | None = None, *, every_n_train_steps: int | None = None,
                 filename: str | None = None, save_weights_only: bool = False,
                 every_n_epochs: int | None = None, verbose: bool = False):
        # (Lightning's names: every_n_train_steps is every_n_steps; verbose changes nothing)
        every_n_steps = every_n_train_steps if every_n_steps is None else every_n_steps
        for given, why in ((filename, "meshtrain names its folders itself (best_step_N, "
                                      "step_N, last); leave filename out"),
                           (save_weights_only or None, "a checkpoint holds the whole training "
                            "state; trainer.whole_model() or the Hugging Face export gives the "
                            "weights"),
                           (every_n_epochs not in (None, 1) or None, "Trainer("
                            "checkpoint_every_n_epochs=N) saves at every N-th epoch's end")):
            if given is not None:
                raise ConfigError(f"ModelCheckpoint: {why}")
        _check_mode(mode)
        if save_top_k < 0:
            raise ConfigError(f"save_top_k must be >= 0, got {save_top_k}")
        if every_n_steps is not None and every_n_steps < 1:
            raise ConfigError(f"every_n_steps must be positive, got {every_n_steps}")
        self.dirpath = Path(dirpath) if dirpath else None
        self.monitor, self.mode, self.save_top_k = monitor, mode, save_top_k
        self.save_last, self.every_n_steps = save_last, every_n_steps
        self.best_k: dict[Path, float] = {}
        self.best_model_path: Path | None = None
        self.last_model_path: Path | None = None

    @property
    def best_model_score(self) -> float | None:
        """The monitored value of ``best_model_path`` (Lightning's name; a float here)."""
        return self.best_k.get(self.best_model_path)

    @property
    def best_k_models(self) -> dict[Path, float]:
        """Lightning's name for ``best_k``: {folder: monitored value} of the kept best."""
        return self.best_k

    def _dir(self, trainer) -> Path:
        return self.dirpath or trainer.run_dir / "checkpoints"

    def on_fit_start(self, trainer) -> None:
        """A resumed run's earlier best-k folders still count towards ``save_top_k``."""
        if self.monitor is None:
            return
        for path in sorted(self._dir(trainer).glob("best_step_*")):
            summary = path / "meshtrain.json"
            value = json.loads(summary.read_text()).get("metrics", {}).get(
                self.monitor) if summary.is_file() else None
            if value is not None:
                self.best_k[path] = float(value)
        if self.best_k:
            best = min if self.mode == "min" else max
            self.best_model_path = best(self.best_k, key=self.best_k.get)

    def on_train_step_end(self, trainer, metrics: dict) -> None:
        step, writer = trainer.global_step, trainer.checkpoints
        if self.every_n_steps and step % self.every_n_steps == 0:
            from meshtrain.checkpoint.manager import checkpoint_name

            # the name the periodic checkpoints use: resume="auto" finds these too
            path = self._dir(trainer) / checkpoint_name(step)
            if path.parent == writer.directory and writer.due_by_steps(step):
                return  # the writer's periodic save of this step goes to the same folder
            trainer.save_checkpoint(path)

    def on_validation_end(self, trainer, metrics: dict) -> None:
        if self.monitor is None or self.save_top_k == 0:
            return
        if self.monitor not in metrics:
            raise ConfigError(
                f"ModelCheckpoint monitors {self.monitor!r} but validation produced "
                f"{sorted(metrics)}; set monitor= to one of those"
            )
        value = float(metrics[self.monitor])
        worst = max if self.mode == "min" else min
        if len(self.best_k) >= self.save_top_k:
            worst_path = worst(self.best_k, key=self.best_k.get)
            if not _improved(value, self.best_k[worst_path], self.mode):
                return
            worst_value = self.best_k.pop(worst_path)
            if trainer.is_global_zero:
                shutil.rmtree(worst_path, ignore_errors=True)
            if trainer.monitor is not None:
                trainer.monitor.event(  # the report tells it from a missing checkpoint
                    "removed", f"replaced by a better one: {self.monitor} {worst_value:.4g} "
                    f"no longer among the best {self.save_top_k} (ModelCheckpoint's "
                    "save_top_k)", trainer.global_step, worst_path)
        name = f"best_step_{trainer.global_step:07d}"
        path = trainer.save_checkpoint(self._dir(trainer) / name)
        if path is None:  # not written: the weights hold NaN/Inf
            return
        self.best_k[path] = value
        best = min if self.mode == "min" else max
        self.best_model_path = best(self.best_k, key=self.best_k.get)

    def on_fit_end(self, trainer) -> None:
        if not self.save_last:
            return
        written = trainer.checkpoints.written_at(trainer.global_step)  # final/ or step_*/
        if self.dirpath is None and written is not None and not written.name.startswith("best"):
            self.last_model_path = written  # the same state: not written twice
        else:
            self.last_model_path = trainer.save_checkpoint(self._dir(trainer) / "last")


class LearningRateMonitor(Callback):
    """Log each parameter group's learning rate as ``lr`` (``lr/group{i}`` if several): the rate
    the optimizer step used, read before the step (the scheduler steps at its end).

    Lightning's options: ``logging_interval`` "step" (None: the same) or "epoch" (the rate at
    each epoch's end); ``log_momentum`` (``momentum``: SGD's, or Adam's first beta) and
    ``log_weight_decay`` (``weight_decay``), named like ``lr``."""

    def __init__(self, logging_interval: str | None = None, log_momentum: bool = False,
                 log_weight_decay: bool = False):
        if logging_interval not in (None, "step", "epoch"):
            raise ConfigError(f"LearningRateMonitor logging_interval must be 'step', 'epoch' "
                              f"or None, got {logging_interval!r}")
        self.per_epoch = logging_interval == "epoch"
        self.keys = ["lr"] + ["momentum"] * log_momentum + ["weight_decay"] * log_weight_decay

    def _read(self, trainer) -> dict:
        groups, out = trainer.optimizer.param_groups, {}
        for key in self.keys:
            for i, group in enumerate(groups):
                value = group.get(key) if key != "momentum" else group.get(
                    "momentum", group.get("betas", (None,))[0])
                if value is not None:
                    out[key if len(groups) == 1 else f"{key}/group{i}"] = float(value)
        return out

    def on_train_step_start(self, trainer) -> None:
        self._values = self._read(trainer)

    def on_train_step_end(self, trainer, metrics: dict) -> None:
        if not self.per_epoch:
            metrics.update(self._values)

    def on_train_epoch_end(self, trainer) -> None:
        if self.per_epoch:
            values = self._read(trainer)
            trainer.callback_metrics.update(values)
            trainer.log_metrics(values)


class EMA(Callback):
    """An exponential moving average of the weights: after every optimizer step
    ``ema = decay * ema + (1 - decay) * param``, for every parameter as each rank holds it
    (a shard under zero2/zero3/HSDP, a DTensor under tp, its stages under pp): no gather, the
    same memory as the parameters. ``use_for_validation``: validation inside fit runs with the
    averaged weights (swapped in and back). ``weights()``: the averages by parameter name.
    Checkpoints hold the average, so a resumed run (on any layout) continues it."""

    def __init__(self, decay: float = 0.999, use_for_validation: bool = False):
        if not 0.0 < decay < 1.0:
            raise ConfigError(f"EMA decay must be between 0 and 1 (exclusive), got {decay}")
        self.decay, self.use_for_validation = decay, use_for_validation
        self.shadow: dict[str, torch.Tensor] = {}
        self._saved: dict[str, torch.Tensor] | None = None

    def _params(self, trainer):
        return [(n, p) for n, p in trainer.model.named_parameters() if p.requires_grad]

    @torch.no_grad()
    def setup(self, trainer) -> None:
        self.shadow = {n: p.detach().clone() for n, p in self._params(trainer)}

    def state_dict(self) -> dict:
        return {"shadow": self.shadow}

    def load_state_dict(self, state: dict) -> None:
        self.shadow = state["shadow"]

    @torch.no_grad()
    def on_train_step_end(self, trainer, metrics: dict) -> None:
        for name, p in self._params(trainer):
            self.shadow[name].lerp_(p.detach(), 1.0 - self.decay)

    def weights(self) -> dict[str, torch.Tensor]:
        return dict(self.shadow)

    @torch.no_grad()
    def on_validation_start(self, trainer) -> None:
        if self.use_for_validation and self.shadow:
            self._saved = {}
            for name, p in self._params(trainer):
                self._saved[name] = p.detach().clone()
                p.copy_(self.shadow[name])

    @torch.no_grad()
    def on_validation_end(self, trainer, metrics: dict) -> None:
        if self._saved is not None:
            for name, p in self._params(trainer):
                p.copy_(self._saved[name])
            self._saved = None


class SWA(Callback):
    """Stochastic weight averaging (Izmailov et al. 2018): from optimizer step ``start_step`` on,
    an equal-weight average of the weights after every step, updated with
    ``torch.optim.swa_utils.get_swa_avg_fn()`` on each parameter as its rank holds it (a shard
    under zero2/zero3, a DTensor under tp, its stages under pp; ``AveragedModel`` itself
    deep-copies the model, which FSDP2 refuses). ``swap_at_end``: the model ``fit`` returns
    holds the average (its final checkpoint, written before, the last weights). Models with
    BatchNorm need their statistics recomputed for the averaged weights
    (``torch.optim.swa_utils.update_bn``): they are refused. Checkpoints hold the average and
    its count, so a resumed run continues it."""

    def __init__(self, start_step: int = 1, swap_at_end: bool = True):
        if not isinstance(start_step, int) or start_step < 1:
            raise ConfigError(f"SWA start_step must be an integer >= 1, got {start_step!r}")
        self.start_step, self.swap_at_end = start_step, swap_at_end
        self.averaged: dict[str, torch.Tensor] = {}
        self.num_averaged = 0

    @torch.no_grad()
    def setup(self, trainer) -> None:
        if any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm)
               for m in trainer.model.modules()):
            raise ConfigError("SWA: the model has BatchNorm layers, whose running statistics "
                              "do not match averaged weights; recompute them with "
                              "torch.optim.swa_utils.update_bn after fit, without this callback")
        # laid out like the parameters (what a checkpoint loads into); filled at start_step
        self.averaged = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
        self.num_averaged = 0

    def state_dict(self) -> dict:
        return {"averaged": self.averaged, "num_averaged": torch.tensor(self.num_averaged)}

    def load_state_dict(self, state: dict) -> None:
        self.averaged, self.num_averaged = state["averaged"], int(state["num_averaged"])

    @torch.no_grad()
    def on_train_step_end(self, trainer, metrics: dict) -> None:
        if trainer.global_step < self.start_step:
            return
        from torch.optim.swa_utils import get_swa_avg_fn

        average = get_swa_avg_fn()
        count = torch.tensor(self.num_averaged)
        for name, p in trainer.model.named_parameters():
            if not self.num_averaged:
                self.averaged[name].copy_(p.detach())
            else:
                self.averaged[name].copy_(average(self.averaged[name], p.detach(), count))
        self.num_averaged += 1

    def weights(self) -> dict[str, torch.Tensor]:
        """The averaged parameters by name (empty before ``start_step``)."""
        return dict(self.averaged) if self.num_averaged else {}

    @torch.no_grad()
    def on_fit_end(self, trainer) -> None:
        if self.swap_at_end and self.num_averaged:
            for name, p in trainer.model.named_parameters():
                p.copy_(self.averaged[name])
