"""A DataLoader given to `fit` lends its batch size and order to the settings the user left at
their default (meshtrain.data.user_loader): training with `DataLoader(data, batch_size=8,
shuffle=False)` is a loop over that loader, in one process and under dp=2. A setting the user
gave wins, said at start; a sampler of the loader's own is refused before anything starts."""

import copy

import pytest
import torch
import torch.nn.functional as F
from conftest import trainer_kwargs
from parity import adamw, mlp, regression_data
from torch.utils.data import DataLoader, WeightedRandomSampler

from meshtrain import Trainer
from meshtrain.errors import ConfigError
from meshtrain.launch.spawn import run_workers

STEPS = 15  # 96 samples in batches of 8: past the end of the first epoch


def _kwargs(run_dir, **settings) -> dict:
    kwargs = trainer_kwargs(run_dir, max_steps=STEPS)
    del kwargs["global_batch_size"]  # (the tests' default; here the loader's is taken)
    return {**kwargs, **settings}


def _loader():
    return DataLoader(regression_data(), batch_size=8, shuffle=False)


def _hand_loop(model: torch.nn.Module) -> dict:
    """What a plain PyTorch loop over the same loader trains."""
    optimizer, steps = adamw(model.parameters()), 0
    while steps < STEPS:
        for x, y in _loader():
            F.mse_loss(model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
            steps += 1
            if steps == STEPS:
                break
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _assert_same(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=1e-6, msg=name)


def test_a_dataloader_trains_as_a_loop_over_it(tmp_path, capsys):
    model = mlp()
    want = _hand_loop(copy.deepcopy(model))
    trainer = Trainer(**_kwargs(tmp_path))
    trained = trainer.fit(model, _loader(), optimizer=adamw, loss_fn=F.mse_loss)
    assert (trainer.global_batch_size, trainer.shuffle) == (8, False)
    _assert_same({k: v.detach() for k, v in trained.state_dict().items()}, want)
    assert "data: global_batch_size=8, shuffle=False from train_data's DataLoader" in \
        capsys.readouterr().out
    # a function that builds the loader (after prepare_data) lends it the same way
    trainer = Trainer(**_kwargs(tmp_path / "factory"))
    trainer.fit(mlp, _loader, optimizer=adamw, loss_fn=F.mse_loss)
    assert (trainer.global_batch_size, trainer.shuffle) == (8, False)


def _dp2(run_dir):
    trainer = Trainer(**_kwargs(run_dir, layout="dp=2"))
    torch.manual_seed(0)
    model = trainer.fit(mlp(), _loader(), optimizer=adamw, loss_fn=F.mse_loss)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, \
        trainer.global_batch_size, trainer.micro_batch_size


@pytest.mark.timeout(120)
def test_the_same_loader_under_dp_2_is_the_same_loop(tmp_path):
    torch.manual_seed(0)
    want = _hand_loop(mlp())
    for state, global_batch, micro in run_workers(_dp2, 2, args=(tmp_path,)):
        assert (global_batch, micro) == (8, 4)  # the loader's batch is one step over all ranks
        _assert_same(state, want)


def test_settings_the_user_gave_win_and_are_said(tmp_path, capsys):
    trainer = Trainer(**_kwargs(tmp_path, global_batch_size=16, shuffle=True))
    trainer.fit(mlp, _loader(), optimizer=adamw, loss_fn=F.mse_loss)
    assert (trainer.global_batch_size, trainer.shuffle) == (16, True)
    out = capsys.readouterr().out
    assert "DataLoader batch_size=8 is not used: global_batch_size=16 as set" in out
    assert "DataLoader shuffle=False (its sampler: SequentialSampler) is not used" in out


@pytest.mark.parametrize("loader", [
    lambda d: DataLoader(d, batch_size=8, sampler=WeightedRandomSampler([1.0] * len(d), len(d))),
    lambda d: DataLoader(d, batch_sampler=[[0, 1], [2, 3]]),
    lambda d: DataLoader(d, batch_size=8, sampler=torch.utils.data.RandomSampler(
        d, replacement=True)),
], ids=["weighted sampler", "batch sampler", "with replacement"])
def test_a_loader_with_its_own_sampler_is_refused_before_start(tmp_path, loader):
    trainer = Trainer(**_kwargs(tmp_path))
    with pytest.raises(ConfigError, match="draws every step's samples itself"):
        trainer.fit(mlp, loader(regression_data()), optimizer=adamw, loss_fn=F.mse_loss)
    assert trainer.run_dir is None  # nothing started, no run folder
