"""A Lightning ``LightningModule`` given to meshtrain's Trainer as it is.

Its ``self.log``, ``self.trainer``, ``self.optimizers()``, ``self.manual_backward`` and the rest
are Lightning's, which need Lightning's Trainer: under meshtrain its ``self.log`` only warned
("the self.trainer reference is not registered") and dropped the value, ``self.trainer`` raised.
When a Trainer takes such a module (:func:`adopt`), its class becomes a subclass with
meshtrain's side of that API first (:class:`MeshtrainAPI`, the same methods as
``meshtrain.TrainingModule``'s): the research code runs as under Lightning, logging included.
Everything else stays the module's and Lightning's (``save_hyperparameters``, ``hparams``,
the hooks, ``device``); a step the module leaves to Lightning's placeholder is absent. A
pickle of the module names its own class: it loads back as the plain LightningModule, without
the Trainer (as Lightning drops its trainer in a pickle). ``LitModel.load_from_checkpoint`` is
Lightning's classmethod, which reads Lightning's files, not a meshtrain checkpoint folder:
``meshtrain export`` gives a state dict to load.

Lightning is not imported here: a module is recognised by the classes it derives from.
"""

from __future__ import annotations

import copy
import functools

from meshtrain.module.core import TrainingModule

_LIGHTNING = ("lightning.pytorch", "pytorch_lightning")


def is_lightning_module(model) -> bool:
    """Is ``model`` a Lightning ``LightningModule`` (either package)?"""
    return any(c.__name__ == "LightningModule" and c.__module__.startswith(_LIGHTNING)
               for c in type(model).__mro__)


class MeshtrainAPI:
    """What a LightningModule's research code calls on itself, answered by the meshtrain
    Trainer fitting it: ``TrainingModule``'s own methods and properties."""

    trainer = TrainingModule.trainer
    global_step = TrainingModule.global_step
    current_epoch = TrainingModule.current_epoch
    log = TrainingModule.log
    log_dict = TrainingModule.log_dict
    print = TrainingModule.print
    optimizers = TrainingModule.optimizers
    lr_schedulers = TrainingModule.lr_schedulers
    manual_backward = TrainingModule.manual_backward
    clip_gradients = TrainingModule.clip_gradients
    toggle_optimizer = TrainingModule.toggle_optimizer
    untoggle_optimizer = TrainingModule.untoggle_optimizer
    toggled_optimizer = TrainingModule.toggled_optimizer

    def __reduce_ex__(self, protocol):
        # a pickle names the user's class (the adopted one has no importable name);
        # Lightning's __getstate__ drops its trainer, meshtrain's link drops itself
        cls = type(self)
        if cls.__bases__[0] is not MeshtrainAPI:  # (FSDP2's class over it: torch's way)
            return super().__reduce_ex__(protocol)
        return _new, (cls.__bases__[1],), self.__getstate__()

    def __deepcopy__(self, memo):
        # a copy (a pipeline stage, a meta copy for the checks) keeps meshtrain's side
        new = object.__new__(type(self))
        memo[id(self)] = new
        new.__setstate__(copy.deepcopy(self.__getstate__(), memo))
        return new


def _new(cls: type):
    return cls.__new__(cls)


class _Absent:
    """A step the module does not define itself, only Lightning's placeholder (a warning, or
    None: Lightning skips what is not overridden): absent, as from any module without it, so
    that meshtrain's checks see it missing (a validation_step for val_data, a training_step
    with loss_fn) instead of calling it."""

    def __init__(self, name: str):
        self.name = name

    def __get__(self, obj, owner=None):
        raise AttributeError(self.name)


_PLACEHOLDERS = ("training_step", "validation_step", "test_step", "predict_step")


@functools.cache
def _adopted(cls: type) -> type:
    attrs = {"__module__": cls.__module__, "__qualname__": cls.__qualname__}
    for name in _PLACEHOLDERS:
        if getattr(getattr(cls, name, None), "__qualname__", "").startswith("LightningModule."):
            attrs[name] = _Absent(name)
    return type(cls.__name__, (MeshtrainAPI, cls), attrs)


def adopt(model) -> None:
    """Give a LightningModule meshtrain's side of the API (a no-op for any other model and
    for one adopted already)."""
    if is_lightning_module(model) and not isinstance(model, MeshtrainAPI):
        model.__class__ = _adopted(type(model))
