"""`Trainer.lr_find(...)`, the learning-rate range test of the Python API (README), in one process:
the rates grow geometrically from min_lr to max_lr, the loss falls then diverges, the suggestion
lies on the falling part, and the model and optimizer are put back as they were."""

import copy
import math

import numpy as np
import pytest
import torch
from torch.utils.data import TensorDataset

from meshtrain import Trainer
from meshtrain.errors import ConfigError

MIN_LR, MAX_LR, NUM_STEPS = 1e-4, 10.0, 50
START_LR = 0.123  # the optimizer factory's own rate, to be restored afterwards


def regression_data() -> TensorDataset:
    """y = x @ w + noise: plain SGD on MSE diverges once lr > 2 / (largest Hessian eigenvalue),
    well below MAX_LR, and barely moves the loss at MIN_LR."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(512, 8, generator=gen)
    w = torch.randn(8, 1, generator=gen)
    return TensorDataset(x, x @ w + 0.1 * torch.randn(512, 1, generator=gen))


class Recorder:
    """Optimizer factory: SGD with momentum (so there is state to restore), recording the rate
    each step actually runs with."""

    def __init__(self):
        self.step_lrs: list[float] = []

    def __call__(self, params):
        opt = torch.optim.SGD(params, lr=START_LR, momentum=0.9)
        opt.register_step_pre_hook(
            lambda o, args, kwargs: self.step_lrs.append(o.param_groups[0]["lr"]))
        return opt


def _lr_find(tmp_path, model, recorder, **kwargs):
    trainer = Trainer(max_steps=1, global_batch_size=32, accelerator="cpu", loggers=(),
                      progress_bar=False, run_dir=tmp_path / "run")
    result = trainer.lr_find(model, regression_data(), optimizer=recorder,
                             loss_fn=torch.nn.functional.mse_loss, **kwargs)
    return trainer, result


def test_lr_find_sweeps_geometrically_suggests_a_rate_and_restores_the_model(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    before = copy.deepcopy(model.state_dict())
    recorder = Recorder()
    trainer, result = _lr_find(tmp_path, model, recorder, min_lr=MIN_LR, max_lr=MAX_LR,
                               num_steps=NUM_STEPS)
    lrs, losses = np.asarray(result.lrs), np.asarray(result.losses)

    # geometric rates from min_lr with the ratio that reaches max_lr at step num_steps - 1,
    # and those are the rates the optimizer really stepped with
    ratio = (MAX_LR / MIN_LR) ** (1 / (NUM_STEPS - 1))
    assert lrs[0] == pytest.approx(MIN_LR, rel=1e-12)
    assert lrs[1:] / lrs[:-1] == pytest.approx(np.full(len(lrs) - 1, ratio), rel=1e-9)
    assert recorder.step_lrs[:len(lrs)] == pytest.approx(result.lrs, rel=1e-12)
    # the loss diverged before max_lr, so the sweep stopped early (one step past the last point)
    assert 10 < len(lrs) < NUM_STEPS
    assert len(recorder.step_lrs) == len(lrs) + 1
    assert len(losses) == len(lrs) and np.isfinite(losses).all()
    # it stops at the first (smoothed) loss above 4x the best so far (lr_find's diverge_factor)
    assert all(losses[i] <= 4 * losses[:i].min() for i in range(1, len(losses)))

    # shape: falls from the start to a minimum, then rises steeply towards max_lr
    lowest = int(np.argmin(losses))
    assert 0 < lowest < len(losses) - 1
    assert losses[lowest] < 0.5 * losses[0]
    assert losses[-1] > 2 * losses[lowest]
    assert lrs[-1] > 10 * lrs[lowest]

    # the suggestion: inside the swept range, one of the swept rates, on the falling part
    suggested = result.suggested_lr
    assert suggested is not None and MIN_LR <= suggested <= MAX_LR
    at = int(np.argmin(np.abs(np.log(lrs) - math.log(suggested))))
    assert suggested == pytest.approx(lrs[at], rel=1e-9)
    assert 0 < at < lowest
    assert losses[at] < 0.9 * losses[0]  # already falling there
    assert losses[lowest] < 0.9 * losses[at]  # and still falling after it

    # put back as they were: the module passed in (the trainer trained it in place) holds its
    # initial weights again, the optimizer has no momentum and its own rate
    assert trainer.model is model
    after = model.state_dict()
    assert after.keys() == before.keys()
    for name, tensor in before.items():
        assert torch.equal(after[name], tensor), name
    assert trainer.optimizer.state_dict()["state"] == {}
    assert [g["lr"] for g in trainer.optimizer.param_groups] == [START_LR]

    assert result.plot_path == tmp_path / "run" / "lr_find.png"
    assert result.plot_path.stat().st_size > 0


def test_lr_find_without_divergence_runs_every_step_up_to_max_lr(tmp_path):
    torch.manual_seed(0)
    recorder = Recorder()
    _, result = _lr_find(tmp_path, torch.nn.Linear(8, 1), recorder, min_lr=1e-4, max_lr=1e-2,
                         num_steps=12)
    assert len(result.lrs) == len(recorder.step_lrs) == 12
    assert result.lrs[0] == pytest.approx(1e-4, rel=1e-12)
    assert result.lrs[-1] == pytest.approx(1e-2, rel=1e-12)
    assert np.diff(np.log(result.lrs)) == pytest.approx(np.full(11, math.log(100) / 11), rel=1e-9)
    assert recorder.step_lrs == pytest.approx(result.lrs, rel=1e-12)
    assert 1e-4 <= result.suggested_lr <= 1e-2


def test_lr_find_rejects_bad_ranges(tmp_path):
    with pytest.raises(ConfigError, match="min_lr < max_lr"):
        _lr_find(tmp_path, torch.nn.Linear(8, 1), Recorder(), min_lr=1.0, max_lr=0.1)
    with pytest.raises(ConfigError, match="at least 5"):
        _lr_find(tmp_path, torch.nn.Linear(8, 1), Recorder(), num_steps=4)
