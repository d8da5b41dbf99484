"""A model that carries its own training logic.

Any ``nn.Module`` with a ``training_step(batch, batch_idx)`` method is trained through it: the
step returns the micro-batch's loss (a scalar tensor), or a dict with ``"loss"``. The optional
``validation_step`` / ``test_step`` return a loss the same way (or None, when they only log),
and ``configure_optimizers()`` returns the optimizer and a scheduler in Lightning's forms (a
scheduler steps per epoch unless its ``"interval"`` is ``"step"``; meshtrain's own
``(optimizer, scheduler)`` per optimizer step: meshtrain/module/configure.py); it is called
after the layout is applied, so the
parameters it sees are the ones that train (sharded under zero2/zero3, DTensors under tp).
``prepare_data()`` (download, unpack: once per job) runs on global rank 0 while the others wait,
before the data is read: pass ``fit`` a function that builds the dataset from what it left.
:class:`TrainingModule` adds ``self.log`` and ``self.trainer``; a plain module with these
methods works too (``trainer.log`` logs from it). A loss averaged over the items of the whole
global batch (tokens, with padding and accumulation; meshtrain.losses): define
``count_loss_items(batch)`` and let the steps return the micro-batch's *sum*; meshtrain divides
by the step's items over every rank.

The step runs inside meshtrain's engine: under DDP it is called through the DDP wrapper
(:class:`TrainingStep`), so gradients are reduced as for ``model(inputs)``; FSDP2, tensor and
context parallel hook the model's own ``forward``, which the step calls.
"""

from __future__ import annotations

import contextlib
import inspect

import torch

from meshtrain.errors import ConfigError
from meshtrain.loop.state import NotBuiltYet
from meshtrain.module.configure import Schedule, check_monitor
from meshtrain.module.hooks import check_hooks
from meshtrain.module.manual import ManualOptimization, Optimizers

STEP_OF = {"train": "training_step", "val": "validation_step", "test": "test_step"}


def has_steps(model) -> bool:
    """Does ``model`` train through its own ``training_step``?"""
    return callable(getattr(model, "training_step", None))


def is_manual(model) -> bool:
    """Does ``model``'s step drive its optimizers itself (``automatic_optimization = False``)?"""
    return has_steps(model) and not getattr(model, "automatic_optimization", True)


class TrainingModule(ManualOptimization, torch.nn.Module):
    """Base class for a model with its research code (see the module's docstring).

    ``automatic_optimization = False``: the step drives its optimizers itself (a GAN):
    ``configure_optimizers`` returns several, ``self.optimizers()`` gives them in that order,
    ``self.manual_backward(loss)`` replaces ``loss.backward()`` (gradients are averaged over
    the data-parallel ranks there), and the step calls ``step()``/``zero_grad()`` when it
    wants; what it returns is only logged."""

    automatic_optimization = True
    prepare_data_per_node = False  # True: prepare_data on each node's local rank 0

    def training_step(self, batch, batch_idx: int):
        raise NotImplementedError(f"{type(self).__name__} needs a training_step(batch, batch_idx)"
                                  " that returns the loss")

    def save_hyperparameters(self, *args, ignore=None, frame=None, logger: bool = True) -> None:
        """(Lightning's) Keep the calling ``__init__``'s arguments, or those named in ``args``
        (or one dict given), in ``self.hparams``; ``ignore``: names left out. The loggers
        record them (``hparams/<name>``) with the run's settings unless ``logger=False``."""
        from meshtrain.module.hparams import collect

        self.__dict__["_hparams"] = collect(frame or inspect.currentframe().f_back, args, ignore)
        self.__dict__["_log_hparams"] = logger

    @classmethod
    def load_from_checkpoint(cls, checkpoint_path, map_location=None, strict: bool = True,
                             **kwargs):
        """(Lightning's) The module built from the hyper-parameters its checkpoint saved
        (``kwargs`` add to or replace them) with the checkpoint's weights, whole, in this
        process (a checkpoint of any layout)."""
        from meshtrain.module.hparams import load_from_checkpoint

        return load_from_checkpoint(cls, checkpoint_path, map_location, strict, **kwargs)

    @property
    def hparams(self):
        """What ``save_hyperparameters`` kept (an empty one before), read as attributes."""
        from meshtrain.module.hparams import AttributeDict

        return self.__dict__.setdefault("_hparams", AttributeDict())

    @property
    def trainer(self):
        """The Trainer that fitted this module last (None before, and in a copy of it)."""
        link = self.__dict__.get("_meshtrain_trainer")
        return link.trainer if link is not None else None

    def log(self, name: str, value, **options) -> None:
        """Log ``value`` (a number or one-element tensor) under ``name``; ``options``:
        ``reduce``, ``prog_bar``, ``on_step``, ``on_epoch`` and Lightning's (``reduce_fx``,
        ``batch_size``, ``logger``, ``sync_dist``, ...): meshtrain/module/log_buffer.py."""
        if self.trainer is None:
            raise ConfigError(f"{type(self).__name__}.log({name!r}, ...) was called outside "
                              "fit/validate/test; log from training_step, validation_step or "
                              "a callback")
        self.trainer.log(name, value, **options)

    # Lightning's views of the run, from the Trainer fitting the module
    global_step = property(lambda self: self.trainer.global_step if self.trainer else 0)
    current_epoch = property(lambda self: self.trainer.current_epoch if self.trainer else 0)

    @property
    def device(self) -> torch.device:
        """Where the module's parameters are (the first one's device; CPU with none)."""
        first = next(self.parameters(), None)
        return first.device if first is not None else torch.device("cpu")

    def print(self, *args, **kwargs) -> None:
        """``print`` on global rank zero only (everywhere before a Trainer holds the module)."""
        (self.trainer.print if self.trainer is not None else print)(*args, **kwargs)

    def lr_schedulers(self):
        """The scheduler ``configure_optimizers`` returned (None without one)."""
        return self.trainer.lr_scheduler if self.trainer is not None else None

    def log_dict(self, dictionary: dict, **options) -> None:
        """(Lightning's) ``self.log`` of every item, with the same options."""
        for name, value in dictionary.items():
            self.log(name, value, **options)


class TrainingStep(torch.nn.Module):
    """What DDP wraps for a model with ``training_step``: its forward is the step, so DDP's
    forward and backward hooks run around it (internal to the Engine)."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, batch, batch_idx: int):
        return self.model.training_step(batch, batch_idx)


def step_loss(output, step: str) -> torch.Tensor | None:
    """The loss in what a step returned (a scalar tensor, a dict with "loss", or None)."""
    loss = output.get("loss") if isinstance(output, dict) else output
    if loss is None and step != "training_step":
        return None
    if not (isinstance(loss, torch.Tensor) and loss.numel() == 1):
        raise ConfigError(
            f"{step} must return the loss (a scalar tensor) or a dict with 'loss'; it returned "
            f"{type(output).__name__}" + (" (a dict without 'loss')" if isinstance(output, dict)
                                          else ""))
    return loss


class TrainerLink:
    """How a model holds the Trainer fitting it (``model.trainer``): a copy or a pickle of the
    model holds none (as Lightning's modules drop theirs), so the trained model can be copied,
    saved whole or given to another Trainer (the Trainer holds locks and process groups)."""

    __slots__ = ("trainer",)

    def __init__(self, trainer=None):
        self.trainer = trainer

    def __deepcopy__(self, memo):
        return TrainerLink()

    def __reduce__(self):
        return TrainerLink, ()


def check_not_laid_out(model) -> None:
    """Refuse a module that an earlier fit laid out (sharded, split by tp, cp, ep or into pp
    stages): it is no longer the whole model, and a second layout of it would crash or, worse,
    train part of it. One process, dp, zero1 and ps leave a module whole."""
    link = model.__dict__.get("_meshtrain_trainer") if isinstance(model, torch.nn.Module) \
        else None
    layout = getattr(link.trainer, "layout", None) if link is not None else None
    if layout is None or not (layout.expert_degree > 1 or any(
            layout.degree(axis) > 1 for axis in ("tp", "cp", "pp", "dp_shard"))):
        return
    name = next(c.__name__ for c in type(model).__mro__  # (FSDP2's subclass: the user's)
                if not c.__module__.startswith("torch.distributed"))
    raise ConfigError(
        f"{name} was given to an earlier fit under layout {layout}, which "
        "changes the module (its weights sharded or split; under pp fit returns this rank's "
        "stages), so it is not the whole model any more. Give this fit the trained model "
        "whole, earlier_trainer.whole_model() (call it on every rank), or a new model")


@contextlib.contextmanager
def linked(model, trainer):
    """``model.trainer`` is ``trainer`` for the checks made before start (its
    ``configure_optimizers`` may read ``self.trainer.estimated_stepping_batches``); the link
    it had before is put back."""
    if model is None:
        yield
        return
    before = model.__dict__.get("_meshtrain_trainer")
    attach(model, trainer)
    try:
        yield
    finally:
        if before is None:
            del model.__dict__["_meshtrain_trainer"]
        else:
            model.__dict__["_meshtrain_trainer"] = before


def attach(model: torch.nn.Module, trainer) -> None:
    """``model.trainer`` is ``trainer`` (not a submodule: nothing changes in its state); a
    Lightning ``LightningModule`` gets meshtrain's side of its API (lightning_module.py)."""
    from meshtrain.module.lightning_module import adopt

    adopt(model)
    model.__dict__["_meshtrain_trainer"] = TrainerLink(trainer)


def configured_optimizers(model: torch.nn.Module, zero1: bool):
    """(optimizer factory, scheduler factory or None, its Schedule) from
    ``model.configure_optimizers()`` (the forms: meshtrain/module/configure.py).

    Under ZeRO-1 the optimizer's state is sharded by a wrapper built from a factory: the
    returned optimizer's class and defaults make it (one parameter group only)."""
    from meshtrain.module.configure import Schedule, read

    made = model.configure_optimizers()
    if is_manual(model):  # several optimizers, stepped by the module itself
        made = list(made) if isinstance(made, (tuple, list)) else [made]
        if not made or not all(isinstance(o, torch.optim.Optimizer) for o in made):
            raise ConfigError("configure_optimizers of a module with automatic_optimization = "
                              "False must return optimizers (a list or tuple of them; "
                              "schedulers: step them in the training_step)")
        return (lambda params: Optimizers(made)), None, Schedule()
    optimizer, scheduler, schedule = read(made)
    if not zero1:
        return (lambda params: optimizer), (
            (lambda opt: scheduler) if scheduler is not None else None), schedule
    if len(optimizer.param_groups) != 1 or scheduler is not None:
        raise ConfigError(
            "under zero1 meshtrain builds the sharded optimizer itself from a factory: "
            "configure_optimizers must return one optimizer with one parameter group and no "
            "scheduler there; pass optimizer=lambda params: ... (and lr_scheduler=) to fit "
            "instead, or use zero2")
    from meshtrain.parallel.data.zero1 import constructor_options

    kind = type(optimizer)  # (AdamW's defaults hold decoupled_weight_decay, not an argument)
    defaults = constructor_options(kind, dict(optimizer.defaults))
    return (lambda params: kind(params, **defaults)), None, schedule


def check_module(model, *, optimizer, loss_fn, val_data, pp: int, metrics,
                 zero1: bool = False, layout=None, settings=None) -> None:
    """Before any process starts (``model``: the user's module or a meta-device copy; None
    when a factory cannot build on meta, and this runs again on the built model): what a
    research module needs from ``fit``'s other arguments and the layout."""
    if model is None:
        return
    if optimizer is None and not callable(getattr(model, "configure_optimizers", None)):
        raise ConfigError("fit needs an optimizer: pass optimizer=lambda params: "
                          "torch.optim.AdamW(params, lr=1e-3), or define configure_optimizers() "
                          f"on {type(model).__name__}")
    if optimizer is None:  # what configure_optimizers returns is usable (a throw-away)
        try:
            _, _, schedule = configured_optimizers(model, zero1=zero1)
        except NotBuiltYet:  # it reads the steps of data not built yet: checked once it is
            schedule = Schedule()
        if schedule.monitor is not None and settings is not None:
            check_monitor(schedule, val_data, settings)
    if not has_steps(model):
        return
    check_hooks(model, pp)
    name = type(model).__name__
    if pp > 1 and is_manual(model):
        raise ConfigError(
            f"{name} steps its optimizers itself (automatic_optimization = False), which a "
            "pipeline cannot do: its schedule runs the forward and backward of every "
            "micro-batch on every stage; use dp=N or zero3=N")
    if loss_fn is not None:
        raise ConfigError(f"{name}.training_step computes the loss: drop loss_fn (it would not "
                          "be used)")
    if val_data is not None and not callable(getattr(model, "validation_step", None)):
        raise ConfigError(f"{name} trains through training_step; to validate on val_data it "
                          "needs a validation_step(batch, batch_idx) (or drop val_data)")
    if metrics:
        raise ConfigError(f"the metrics setting reads the model's outputs, which {name}'s steps "
                          "keep to themselves: compute them in validation_step and "
                          "self.log(...) them")
    if is_manual(model) and layout is not None:
        check_manual(name, layout, settings or {})
        if layout.is_sharded and any(True for _ in model.parameters(recurse=False)):
            raise ConfigError(
                f"{name} steps its optimizers itself and holds parameters of its own; under "
                f"{layout} each submodule is sharded on its own (the step calls them, not "
                f"{name}'s forward): move those parameters into a submodule")


def check_manual(name: str, layout, settings: dict) -> None:
    """Manual optimisation (several optimizers, stepped by the module) needs one micro-batch
    per step, dp or FSDP (zero2/zero3/HSDP), and none of the settings that act on one
    optimizer (clipping is per optimizer, in the step; fp16's scaler; skipping an update)."""
    if not (layout.world_size == 1 or layout.uses_ddp or layout.is_sharded) or (
            layout.zero_stage == 1):
        raise ConfigError(
            f"{name} steps its optimizers itself (automatic_optimization = False): meshtrain "
            "supports that in one process, under dp (gradients averaged in manual_backward) "
            f"and under zero2/zero3/HSDP (each submodule sharded on its own), not under {layout}"
            + (" (zero1 shards the state of the one optimizer meshtrain builds)"
               if layout.zero_stage == 1 else "") + "; use dp=N or zero3=N")
    for setting, bad, fix in (
            ("grad_clip_norm", lambda v: v is not None,
             "call self.clip_gradients(optimizer, max_norm) in the step, per optimizer"),
            ("precision", lambda v: v == "fp16-mixed",
             "use bf16-mixed (no loss scaling) or fp32: one grad scaler cannot serve optimizers "
             "that the step steps in its own order"),
            ("nan_policy", lambda v: v == "skip",
             "use 'error' or 'rollback': the step has made its updates when meshtrain sees its "
             "loss, so only a rollback can drop them"),
            ("grad_accum_steps", lambda v: v not in (None, 1),
             "one micro-batch per step: leave micro_batch_size unset")):
        if setting in settings and bad(settings[setting]):
            raise ConfigError(f"{name} steps its optimizers itself (automatic_optimization = "
                              f"False): {setting}={settings[setting]!r} is not applied for it; "
                              f"{fix}")
