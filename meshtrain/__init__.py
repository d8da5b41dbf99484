"""meshtrain: PyTorch-native distributed training. One Trainer, any layout over a device mesh."""

__version__ = "0.1.0"

from meshtrain.callbacks import (
    EMA, SWA, Callback, EarlyStopping, LearningRateMonitor, ModelCheckpoint,
)
from meshtrain.errors import ConfigError, LayoutError, MeshtrainError, WorkerFailed
from meshtrain import losses
from meshtrain.losses import GlobalMeanLoss
from meshtrain.module import TrainingModule
from meshtrain.parallel.data.batch_gather import gather_batch
from meshtrain.parallel.layout import Layout
from meshtrain.trainer import Trainer

__all__ = [
    "EMA", "Callback", "ConfigError", "EarlyStopping", "GlobalMeanLoss", "Layout", "LayoutError",
    "LearningRateMonitor", "MeshtrainError", "ModelCheckpoint", "SWA", "Trainer",
    "TrainingModule",
    "WorkerFailed",
    "__version__", "gather_batch", "losses",
]
