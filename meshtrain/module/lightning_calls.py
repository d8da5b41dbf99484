"""Lightning's call shapes of the Trainer's methods: ``fit(model, train_dataloaders=...,
val_dataloaders=..., ckpt_path=...)`` and ``test(model, dataloaders=..., ckpt_path="best")``
(the same for ``validate`` and ``predict``), read as meshtrain's arguments and settings."""

from __future__ import annotations

import torch

from meshtrain.errors import ConfigError

FIT_KEYWORDS = ("train_dataloaders", "val_dataloaders", "ckpt_path")


def fit_arguments(trainer, train_data, val_data, keywords: dict):
    """(train_data, val_data) with Lightning's ``train_dataloaders`` / ``val_dataloaders``;
    ``ckpt_path`` is the ``resume`` of this fit ("last": this job's newest checkpoint)."""
    unknown = sorted(set(keywords) - set(FIT_KEYWORDS))
    if unknown:
        raise ConfigError(f"fit got unexpected keyword(s) {', '.join(unknown)}; it takes "
                          "train_data, val_data, datamodule, optimizer, loss_fn, lr_scheduler "
                          f"and Lightning's {', '.join(FIT_KEYWORDS)}")
    for name, given in (("train_dataloaders", train_data), ("val_dataloaders", val_data)):
        if name in keywords and given is not None:
            raise ConfigError(f"fit got both {name}= and the data it names; give one")
    if "ckpt_path" in keywords and keywords["ckpt_path"] is not None:
        from meshtrain.settings import SETTINGS

        resume = "auto" if keywords["ckpt_path"] == "last" else str(keywords["ckpt_path"])
        SETTINGS["resume"].validate(resume)
        trainer._settings["resume"] = resume
    return (keywords.get("train_dataloaders", train_data),
            keywords.get("val_dataloaders", val_data))


EVAL_KEYWORDS = {"validate": ("model", "verbose"), "test": ("model", "verbose"),
                 "predict": ("model", "return_predictions")}


def eval_arguments(trainer, data, dataloaders, ckpt_path, stage: str, keywords: dict):
    """The data of ``validate`` / ``test`` / ``predict`` from Lightning's call shapes (the
    fitted model first or as ``model=``, ``dataloaders=``), with ``ckpt_path``'s checkpoint
    restored. ``verbose`` is taken (meshtrain prints no table of the results);
    ``return_predictions=False``: predict returns None."""
    unknown = sorted(set(keywords) - set(EVAL_KEYWORDS[stage]))
    if unknown:
        raise ConfigError(f"{stage} got unexpected keyword(s) {', '.join(unknown)}; it takes "
                          "the data, dataloaders, datamodule, ckpt_path and Lightning's "
                          f"{', '.join(EVAL_KEYWORDS[stage])}")
    for given in (data, keywords.get("model")):
        if isinstance(given, torch.nn.Module):  # Lightning's test(model, ...): the fitted one
            _check_fitted(trainer, given, stage)
    if isinstance(data, torch.nn.Module):
        data = None
    if dataloaders is not None:
        if data is not None:
            raise ConfigError(f"{stage} got both data and dataloaders=; give one")
        data = dataloaders
    if ckpt_path is not None:
        trainer.load_checkpoint(_checkpoint(trainer, ckpt_path, stage))
    return data


def _check_fitted(trainer, model, stage: str) -> None:
    link = model.__dict__.get("_meshtrain_trainer")
    if link is None or link.trainer is not trainer:
        raise ConfigError(
            f"{stage}({type(model).__name__}, ...): this Trainer evaluates the model it "
            "fitted (the object given to fit or the one fit returned); give only the data, "
            "or fit this model with this Trainer first")


def _checkpoint(trainer, ckpt_path, stage: str):
    """The folder ``ckpt_path`` names: "best" (a ModelCheckpoint's), "last" (the newest)."""
    from meshtrain.callbacks import ModelCheckpoint

    if ckpt_path == "best":
        best = [c.best_model_path for c in trainer.callbacks
                if isinstance(c, ModelCheckpoint) and c.best_model_path is not None]
        if not best:
            raise ConfigError(f"{stage}(ckpt_path='best'): no ModelCheckpoint(monitor=...) "
                              "among the callbacks has saved a best checkpoint")
        return best[0]
    if ckpt_path == "last":
        from meshtrain.checkpoint.manager import latest_complete

        last = latest_complete(trainer.run_dir / "checkpoints") if trainer.run_dir else None
        if last is None:
            raise ConfigError(f"{stage}(ckpt_path='last'): this run saved no checkpoint")
        return last
    return ckpt_path
