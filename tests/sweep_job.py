"""A recipe of a user's own for tests/test_sweep.py (``[job] recipe = "sweep_job"``, importable
from tests/): a linear model fitted to y = x . 1 by SGD, a second or so per trial. It does not
say which metrics it logs (no ``metrics(config)``), so a sweep checks its objective inside the
first trial; and its optimizer factory reads the rank: ``[quirk] rank1_lr`` (0: unused) is the
learning rate rank 1 trains with, a job whose ranks do not train the same model."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import TensorDataset

from meshtrain import settings
from meshtrain.trainer import Trainer

DEFAULTS = {"job": {"recipe": "sweep_job"}, "optimizer": {"lr": 0.05},
            "quirk": {"rank1_lr": 0.0}, **settings.config_sections()}


def _data(n: int, seed: int) -> TensorDataset:
    x = torch.randn(n, 4, generator=torch.Generator().manual_seed(seed))
    return TensorDataset(x, x.sum(1, keepdim=True))


def run(config: dict, mode: str = "train"):
    lr, rank1_lr = config["optimizer"]["lr"], config["quirk"]["rank1_lr"]

    def optimizer(params):
        rank = dist.get_rank() if dist.is_initialized() else 0
        return torch.optim.SGD(params, lr=rank1_lr if rank == 1 and rank1_lr else lr)

    trainer = Trainer(**settings.flatten(config))
    trainer.fit(lambda: torch.nn.Linear(4, 1), _data(64, 0), _data(16, 1), optimizer=optimizer,
                loss_fn=F.mse_loss)
    return {"run_dir": trainer.run_dir}
