"""Lightning's data hooks without Lightning (meshtrain/module/data_hooks.py): `fit(model,
datamodule=dm)` and a model's own `train_dataloader()`. The DataModule's `prepare_data` runs once
per job while the other rank waits, `setup(stage)` on every rank before its loaders, and the
training under dp=2 equals one process given the same data directly."""

import os

import pytest
import torch
import torch.nn.functional as F
from conftest import state_of, trainer_kwargs
from parity import adamw, mlp, regression_data
from torch.utils.data import DataLoader

import meshtrain
from meshtrain import Trainer
from meshtrain.errors import ConfigError
from meshtrain.launch.spawn import run_workers

STEPS = 6


class Regression:
    """A DataModule as a plain class: prepare_data writes a file (once per job), setup reads
    it, the loaders serve from what setup built."""

    def __init__(self, folder):
        self.folder = folder

    def prepare_data(self):
        with open(os.path.join(self.folder, "prepared.count"), "a") as f:
            f.write("x")  # (one character per call: the calls of the whole job)
        torch.save(regression_data().tensors, os.path.join(self.folder, "data.pt"))

    def setup(self, stage):
        self.stages = [*getattr(self, "stages", []), stage]
        x, y = torch.load(os.path.join(self.folder, "data.pt"))
        self.train, self.val = torch.utils.data.TensorDataset(x, y), \
            torch.utils.data.TensorDataset(x[:32], y[:32])

    def train_dataloader(self):
        return DataLoader(self.train, batch_size=16, shuffle=True)

    def val_dataloader(self):
        return DataLoader(self.val, batch_size=8)


def _settings(run_dir, **more):
    settings = trainer_kwargs(run_dir, max_steps=STEPS, val_every_n_steps=3)
    del settings["global_batch_size"]  # (the loader's is taken)
    return {**settings, **more}


def _with_datamodule(folder, layout):
    trainer, data = Trainer(**_settings(os.path.join(folder, "run"), layout=layout)), \
        Regression(folder)
    model = trainer.fit(mlp, datamodule=data, optimizer=adamw, loss_fn=F.mse_loss)
    return state_of(trainer.whole_model()), trainer.validate()["val/loss"], data.stages, \
        trainer.global_batch_size, trainer.shuffle, model is trainer.model


@pytest.mark.timeout(120)
def test_a_datamodule_under_dp_2_trains_as_one_process_given_its_data(tmp_path):
    results = run_workers(_with_datamodule, 2, args=(str(tmp_path), "dp=2"))
    assert (tmp_path / "prepared.count").read_text() == "x"  # once per job, not per rank
    reference_trainer = Trainer(**_settings(tmp_path / "reference", global_batch_size=16))
    reference = state_of(reference_trainer.fit(
        mlp, regression_data(), torch.utils.data.Subset(regression_data(), range(32)),
        optimizer=adamw, loss_fn=F.mse_loss))
    val_loss = reference_trainer.validate()["val/loss"]
    for state, val, stages, global_batch, shuffle, same in results:
        assert stages == ["fit"] and (global_batch, shuffle) == (16, True) and same
        for name, value in reference.items():
            torch.testing.assert_close(state[name], value, rtol=0, atol=1e-6, msg=name)
        assert val == pytest.approx(val_loss, rel=1e-6)


class OwnData(meshtrain.TrainingModule):
    """A research module with its own loaders, Lightning's older style."""

    def __init__(self):
        super().__init__()
        self.net = mlp()

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        return F.mse_loss(self(batch[0]), batch[1])

    def configure_optimizers(self):
        return adamw(self.parameters())

    def train_dataloader(self):
        return DataLoader(regression_data(), batch_size=16, shuffle=True)

    def predict_dataloader(self):
        return DataLoader(torch.utils.data.TensorDataset(regression_data().tensors[0][:5]))


def test_a_model_with_its_own_loaders_needs_no_data(tmp_path):
    torch.manual_seed(0)
    model = OwnData()
    trainer = Trainer(**_settings(tmp_path / "own"))
    trainer.fit(model)
    torch.manual_seed(0)
    again = Trainer(**_settings(tmp_path / "given", global_batch_size=16))
    reference = again.fit(OwnData(), regression_data())
    for name, value in state_of(reference).items():
        torch.testing.assert_close(state_of(model)[name], value, rtol=0, atol=0, msg=name)
    predictions = trainer.predict()  # its predict_dataloader()
    torch.testing.assert_close(torch.cat(predictions) if isinstance(predictions, list)
                               else predictions, model(regression_data().tensors[0][:5]))


def test_missing_or_doubled_data_is_refused_before_start(tmp_path):
    trainer = Trainer(**_settings(tmp_path))
    with pytest.raises(ConfigError, match="fit needs training data.*given as a function"):
        trainer.fit(mlp, optimizer=adamw, loss_fn=F.mse_loss)
    with pytest.raises(ConfigError, match="both train_data and a datamodule"):
        trainer.fit(mlp, regression_data(), datamodule=Regression(str(tmp_path)),
                    optimizer=adamw, loss_fn=F.mse_loss)
    with pytest.raises(ConfigError, match="has no train_dataloader"):
        trainer.fit(mlp, datamodule=object(), optimizer=adamw, loss_fn=F.mse_loss)
    assert trainer.run_dir is None


class SetUp(OwnData):
    """Lightning's module-as-its-own-datamodule: the datasets made in setup(stage)."""

    def setup(self, stage):
        self.stages = [*getattr(self, "stages", []), stage]
        self.train_set = regression_data()

    def train_dataloader(self):
        return DataLoader(self.train_set, batch_size=16, shuffle=True)  # (set by setup)

    def test_dataloader(self):
        return DataLoader(regression_data(3), batch_size=16)

    def test_step(self, batch, batch_idx):
        return self.training_step(batch, batch_idx)


def test_a_modules_own_setup_runs_before_its_loaders(tmp_path):
    torch.manual_seed(0)
    trainer = Trainer(**_settings(tmp_path / "own"))
    model = trainer.fit(SetUp())
    assert model.stages == ["fit"]
    torch.manual_seed(0)
    reference = Trainer(**_settings(tmp_path / "given", global_batch_size=16)).fit(
        OwnData(), regression_data())
    for name, value in state_of(reference).items():
        torch.testing.assert_close(state_of(model)[name], value, rtol=0, atol=0, msg=name)
    trainer.test()  # its test_dataloader(), after setup("test")
    assert model.stages == ["fit", "test"]
    with pytest.raises(ConfigError, match="setup\\(stage\\) runs before the module's own"):
        Trainer(**_settings(tmp_path / "x")).fit(SetUp(), regression_data())
    with pytest.raises(ConfigError, match="would not run on a model fit builds from a function"):
        Trainer(**_settings(tmp_path / "y")).fit(SetUp, regression_data())
