"""Lightning's data hooks: a DataModule (``fit(model, datamodule=dm)``) or the model's own
``train_dataloader()`` / ``val_dataloader()`` / ``test_dataloader()`` / ``predict_dataloader()``
as the data of ``fit``, ``validate``, ``test`` and ``predict``.

Lightning's order is kept: the DataModule's ``prepare_data()`` once per job (global rank 0, or
each node's first rank with ``prepare_data_per_node``; the others wait), then ``setup(stage)`` on
every rank, then the loader; the same for a module's own ``setup`` and loaders (a module with a
``setup`` and data given to ``fit`` is refused: its setup would not run). A loader so built is data like any other (a DataLoader lends its
``batch_size`` and ``shuffle`` where those settings are unset: meshtrain.data.user_loader). A
real ``LightningDataModule`` works as it is: its hooks left undefined are Lightning's
placeholders (``DataHooks``), taken as absent.
"""

from __future__ import annotations

import torch

from meshtrain.errors import ConfigError
from meshtrain.module.lightning_calls import eval_arguments, fit_arguments

LOADER_OF = {"fit": "train_dataloader", "validate": "val_dataloader", "test": "test_dataloader",
             "predict": "predict_dataloader"}


def defines(source, hook: str) -> bool:
    """Does ``source`` define ``hook`` itself (not Lightning's placeholder that raises)?"""
    method = getattr(type(source), hook, None)
    return callable(method) and not getattr(method, "__qualname__", "").startswith("DataHooks.")


def fit_data(trainer, model, train_data, val_data, datamodule, lightning=None):
    """(train_data, val_data) for ``fit``: as given (or as Lightning's keywords ``lightning``
    give them), else the DataModule's loaders, else the model's own; the DataModule is kept on
    the trainer for its ``prepare_data`` / ``setup`` (meshtrain.loop.setup.prepare_data).
    ConfigError when there is none, or both."""
    train_data, val_data = fit_arguments(trainer, train_data, val_data, lightning or {})
    if datamodule is not None:
        if train_data is not None:
            raise ConfigError("fit got both train_data and a datamodule; give one (the "
                              "datamodule's train_dataloader() is the training data)")
        _attach(trainer, datamodule)
        if not defines(datamodule, "train_dataloader"):
            raise ConfigError(f"the datamodule {type(datamodule).__name__} has no "
                              "train_dataloader(); define it, or pass train_data")
        train_data = _built_by(datamodule, "fit")
        if val_data is None and defines(datamodule, "val_dataloader"):
            val_data = _built_by(datamodule, "validate", setup=False)
        return train_data, val_data
    if train_data is not None:
        if isinstance(model, torch.nn.Module) and defines(model, "setup"):
            raise ConfigError(
                f"{type(model).__name__}.setup(stage) runs before the module's own "
                "train_dataloader() (after prepare_data, on every rank), and here the data is "
                "given: it would not run. Move what it does to __init__, or let "
                "train_dataloader() give the data")
        return train_data, val_data
    if isinstance(model, torch.nn.Module) and defines(model, "train_dataloader"):
        if val_data is None and defines(model, "val_dataloader"):
            val_data = _built_by(model, "validate", setup=False)
        return _built_by(model, "fit"), val_data
    raise ConfigError(
        "fit needs training data: pass train_data (a Dataset, a DataLoader, or a function "
        "that builds one), datamodule=, or define train_dataloader() on the model object"
        + (" (the model is given as a function here: its methods are not known before it is "
           "built)" if not isinstance(model, torch.nn.Module) else ""))


def eval_data(trainer, data, datamodule, stage: str, dataloaders=None, ckpt_path=None,
              lightning=None):
    """The data of ``validate`` / ``test`` / ``predict``: as given, else the DataModule's loader
    for ``stage`` (after its ``setup(stage)``), else the trained model's own; None when there
    is none (the caller decides). Lightning's call shapes too: the fitted model first
    (``test(model, dataloaders=...)``), ``ckpt_path`` ("best", "last" or a folder) restored
    before; ``lightning``: Lightning's keywords (``model=``, ``verbose``,
    ``return_predictions``)."""
    data = eval_arguments(trainer, data, dataloaders, ckpt_path, stage, lightning or {})
    hook = LOADER_OF[stage]
    if datamodule is not None:
        if data is not None:
            raise ConfigError(f"{stage} got both data and a datamodule; give one")
        _attach(trainer, datamodule)
        if not defines(datamodule, hook):
            raise ConfigError(f"the datamodule {type(datamodule).__name__} has no {hook}(); "
                              "define it, or pass the data")
        return _built_by(datamodule, stage)()
    if data is not None:
        return data
    model = getattr(trainer, "model", None)
    for source in (model, getattr(model, "module", None)):
        if source is not None and defines(source, hook):
            return _built_by(source, stage)()  # (its setup(stage) first, as Lightning's)
    return None


def needed(data, stage: str):
    """``data``, or ConfigError when ``stage`` found none."""
    if data is None:
        raise ConfigError(f"{stage} needs data: pass it, or datamodule=, or define "
                          f"{LOADER_OF[stage]}() on the model")
    return data


def _attach(trainer, datamodule) -> None:
    trainer.datamodule = datamodule
    try:
        datamodule.trainer = trainer  # (Lightning's DataModule reads self.trainer)
    except AttributeError:
        pass


def _built_by(datamodule, stage: str, setup: bool = True):
    """A function building the loader of ``stage`` (after ``setup(stage)``: once per stage on
    each rank, as Lightning calls it)."""
    def build():
        if setup and defines(datamodule, "setup"):
            datamodule.setup("fit" if stage == "fit" else stage)
        return getattr(datamodule, LOADER_OF[stage])()
    return build
