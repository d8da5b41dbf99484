"""Metric loggers used by the Trainer on global rank zero only.

A logger receives hyperparameters once and scalar metrics by step. ``Logger`` itself does nothing,
so a Trainer can hold one on every rank and call it unconditionally. ``CSVLogger`` keeps a plain
``metrics.csv`` that survives a crash (every row is flushed); ``TensorBoardLogger`` writes event
files for ``tensorboard --logdir``. MLflow and Weights & Biases loggers (optional extras) are in
``external.py``; what every logger is, ``base.py``; those writing files, ``local.py``. Nothing
here touches ``torch.distributed``.
"""

from __future__ import annotations

from pathlib import Path

from meshtrain.errors import ConfigError
from meshtrain.observe.loggers import external
from meshtrain.observe.loggers.base import Logger, flatten_params
from meshtrain.observe.loggers.local import CSVLogger, TensorBoardLogger, read_metrics_csv

__all__ = [
    "EXTERNAL_LOGGERS",
    "CSVLogger",
    "Logger",
    "TensorBoardLogger",
    "flatten_params",
    "make_loggers",
    "read_metrics_csv",
]


LOGGERS = {"csv": CSVLogger, "tensorboard": TensorBoardLogger}
# optional extras (pip install 'meshtrain[loggers]'), in external.py
EXTERNAL_LOGGERS = tuple(external.EXTERNAL_LOGGERS)


def make_loggers(names, run_dir: Path, hparams: dict, *, record: bool = True) -> list[Logger]:
    """The loggers named in ``names`` (``"csv"``, ``"tensorboard"``, ``"mlflow"``, ``"wandb"``),
    each given ``hparams``; MLflow's experiment and W&B's project are the job's name
    (``hparams["name"]``). ``record=False``: loggers opened again on a run that recorded its
    hparams already (metrics.csv appended, a new TensorBoard event file in the same folder, the
    same MLflow or W&B run continued)."""
    names = [names] if isinstance(names, str) else list(names)
    loggers: list[Logger] = []
    try:
        for name in names:
            if name in LOGGERS:
                loggers.append(LOGGERS[name](run_dir))
            elif name in EXTERNAL_LOGGERS:
                loggers.append(external.make_external_logger(name, run_dir, hparams.get("name")))
            else:
                raise ConfigError(f"unknown logger {name!r} in loggers; choose from "
                                  + ", ".join(repr(n) for n in (*LOGGERS, *EXTERNAL_LOGGERS)))
        for logger in loggers:
            if record:
                logger.log_hparams(hparams)
    except BaseException:
        for logger in loggers:  # close what was opened (an MLflow / W&B run ends)
            logger.finalize()
        raise
    return loggers
