"""meshtrain: PyTorch-native distributed training. One Trainer, any layout over a device mesh."""

from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING

from meshtrain import _graveyard

__version__ = "0.1.0"

# Where each public name lives. They are imported on first use (PEP 562), so that `import
# meshtrain` and the commands that train nothing (`meshtrain --help`, `--version`,
# `report`) do not import torch and the Trainer's parts: 0.07 s instead of 4.6 s here.
_EXPORTS = {
    "EMA": "meshtrain.callbacks", "SWA": "meshtrain.callbacks",
    "Callback": "meshtrain.callbacks", "EarlyStopping": "meshtrain.callbacks",
    "LearningRateMonitor": "meshtrain.callbacks", "ModelCheckpoint": "meshtrain.callbacks",
    "ConfigError": "meshtrain.errors", "LayoutError": "meshtrain.errors",
    "MeshtrainError": "meshtrain.errors", "WorkerFailed": "meshtrain.errors",
    "GlobalMeanLoss": "meshtrain.losses", "TrainingModule": "meshtrain.module",
    "gather_batch": "meshtrain.parallel.data.batch_gather", "Layout": "meshtrain.parallel.layout",
    "Trainer": "meshtrain.trainer",
}

__all__ = sorted([*_EXPORTS, "__version__", "losses"])

if TYPE_CHECKING:  # what the names are, for type checkers and editors
    from meshtrain import losses
    from meshtrain.callbacks import (
        EMA, SWA, Callback, EarlyStopping, LearningRateMonitor, ModelCheckpoint,
    )
    from meshtrain.errors import ConfigError, LayoutError, MeshtrainError, WorkerFailed
    from meshtrain.losses import GlobalMeanLoss
    from meshtrain.module import TrainingModule
    from meshtrain.parallel.data.batch_gather import gather_batch
    from meshtrain.parallel.layout import Layout
    from meshtrain.trainer import Trainer


# Modules that moved keep their old import paths, warning (meshtrain/_graveyard.py)
_graveyard.install()


def __getattr__(name: str):
    if name not in _EXPORTS:  # a subpackage or module (meshtrain.losses, meshtrain.optim, ...)
        if not name.startswith("_") and importlib.util.find_spec(f"meshtrain.{name}"):
            return importlib.import_module(f"meshtrain.{name}")
        raise AttributeError(f"module 'meshtrain' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
