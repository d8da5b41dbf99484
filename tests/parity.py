"""Parity harness: the same model, data and seed trained by one process on the full global batch
and by N processes under a layout; the parameters must agree. Every strategy's tests reuse it."""

from __future__ import annotations

import tempfile

import torch
from torch.utils.data import TensorDataset

from meshtrain import Trainer
from meshtrain.launch.spawn import run_workers

NUM_SAMPLES, IN_FEATURES, OUT_FEATURES = 96, 12, 3


def regression_data(seed: int = 1234) -> TensorDataset:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(NUM_SAMPLES, IN_FEATURES, generator=gen)
    w = torch.randn(IN_FEATURES, OUT_FEATURES, generator=gen)
    y = torch.tanh(x @ w) + 0.1 * torch.randn(NUM_SAMPLES, OUT_FEATURES, generator=gen)
    return TensorDataset(x, y)


def mlp() -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Linear(IN_FEATURES, 32), torch.nn.GELU(),
        torch.nn.Linear(32, 32), torch.nn.GELU(),
        torch.nn.Linear(32, OUT_FEATURES),
    )


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01)


def train_state(trainer_kwargs: dict, model_fn=mlp, data_fn=regression_data,
                optimizer_fn=adamw, loss_fn=torch.nn.functional.mse_loss) -> dict:
    """Train in this process (or as one rank of a job) and return the parameters (rank 0)."""
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as run_dir:
        kwargs = dict(loggers=(), progress_bar=False, save_final_checkpoint=False,
                      run_dir=run_dir, seed=0)
        kwargs.update(trainer_kwargs)
        trainer = Trainer(**kwargs)
        model = trainer.fit(model_fn, data_fn(), optimizer=optimizer_fn, loss_fn=loss_fn)
        return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}


def run_layout(trainer_kwargs: dict, num_procs: int, timeout: float = 120, **fns) -> dict:
    if num_procs == 1:
        return train_state(trainer_kwargs, **fns)
    return run_workers(_train_rank, num_procs, (trainer_kwargs, fns), timeout=timeout)[0]


def _train_rank(trainer_kwargs, fns):
    return train_state(trainer_kwargs, **fns)


def max_param_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


def assert_parity(layout: str, num_procs: int, *, tol: float = 1e-5, steps: int = 20,
                  global_batch_size: int = 16, micro_batch_size: int | None = None, **kwargs):
    """Compare ``layout`` on ``num_procs`` ranks against one process; return the difference."""
    common = dict(max_steps=steps, global_batch_size=global_batch_size, **kwargs)
    reference = run_layout(dict(common), 1)
    parallel = run_layout(dict(common, layout=layout, micro_batch_size=micro_batch_size), num_procs)
    diff = max_param_diff(reference, parallel)
    moved = max_param_diff(reference, run_layout(dict(common, max_steps=1), 1))
    assert moved > 100 * tol, "training barely moved the parameters: the test would prove nothing"
    assert diff <= tol, f"{layout} on {num_procs} ranks differs from one process by {diff:.3e}"
    return diff
