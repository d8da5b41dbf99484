"""Callbacks in a real (one-process) fit: early stopping, checkpoints, learning-rate logging,
exceptions."""

import json

import pytest
import torch
import torch.nn.functional as F
from conftest import LossRecorder, quiet_trainer
from parity import adamw, mlp, regression_data
from torch.utils.data import TensorDataset

from meshtrain import Callback, EarlyStopping, LearningRateMonitor, ModelCheckpoint
from meshtrain.checkpoint.state import load_model_weights
from meshtrain.observe.loggers import read_metrics_csv

# single-process checkpoints: DCP says it saves/loads without a process group, as intended
pytestmark = [pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning"),
              pytest.mark.usefixtures("one_thread")]


def _fit(trainer, val=None, **kwargs):
    return trainer.fit(mlp, regression_data(), val, optimizer=kwargs.pop("optimizer", adamw),
                       loss_fn=kwargs.pop("loss_fn", F.mse_loss), **kwargs)


def _val_set():
    x, y = regression_data(seed=7).tensors
    return TensorDataset(x[:32], y[:32])


class ScriptedValidation(Callback):
    """Replaces the measured val/loss with scripted values (put it first in the callback list,
    so the callbacks after it see them); records the step and parameters of each validation."""

    def __init__(self, values):
        self.values, self.steps, self.params = list(values), [], {}

    def on_validation_end(self, trainer, metrics):
        assert "val/loss" in metrics  # the real metric was there
        metrics["val/loss"] = self.values[len(self.steps)]
        self.steps.append(trainer.global_step)
        self.params[trainer.global_step] = {
            k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


# ---- EarlyStopping ------------------------------------------------------------------------------
def test_early_stopping_on_scripted_metric(tmp_path):
    # validations every 2 steps; best 0.8 at step 4, then two checks without improvement
    script = ScriptedValidation([1.0, 0.8, 0.9, 0.85, 0.1, 0.1])
    stop = EarlyStopping(monitor="val/loss", patience=2)
    steps = LossRecorder()
    trainer = quiet_trainer(tmp_path, max_steps=20, val_every_n_steps=2, loggers=("csv",),
                            callbacks=[script, stop, steps])
    _fit(trainer, _val_set())

    assert stop.stopped_at_step == 8
    assert trainer.global_step == 8 and steps.steps == list(range(1, 9))
    assert stop.best == 0.8
    # no second validation of the same weights after the stop
    assert script.steps == [2, 4, 6, 8]
    val_steps = [r["step"] for r in read_metrics_csv(tmp_path / "metrics.csv")
                 if r.get("val/loss") is not None]
    assert val_steps == [2, 4, 6, 8]


def test_early_stopping_when_validation_loss_rises(tmp_path):
    # The validation targets are the negated training targets: the better the model fits the
    # training data, the worse it does on validation, so val/loss rises from the first check.
    x, y = regression_data().tensors
    anti = TensorDataset(x, -y)

    class Record(Callback):
        def __init__(self):
            self.values = []

        def on_validation_end(self, trainer, metrics):
            self.values.append((trainer.global_step, metrics["val/loss"]))

    record = Record()
    stop = EarlyStopping(patience=2)
    trainer = quiet_trainer(tmp_path, max_steps=40, val_every_n_steps=2, callbacks=[record, stop])
    _fit(trainer, anti)

    losses = [v for _, v in record.values]
    assert losses == sorted(losses), f"val/loss did not rise: {losses}"
    # first check sets the best; the next two are worse: stop at the third check, step 6
    assert [s for s, _ in record.values] == [2, 4, 6]
    assert stop.stopped_at_step == 6 == trainer.global_step


def test_early_stopping_with_unknown_metric(tmp_path):
    trainer = quiet_trainer(tmp_path, max_steps=4, val_every_n_steps=2,
                            callbacks=[EarlyStopping(monitor="val/acc")])
    with pytest.raises(ValueError, match="monitors 'val/acc'.*val/loss"):
        _fit(trainer, _val_set())


# ---- ModelCheckpoint ----------------------------------------------------------------------------
def test_model_checkpoint_keeps_the_best_k(tmp_path):
    # validations at steps 2, 4, 6, 8 and the final one at 10
    script = ScriptedValidation([0.5, 0.3, 0.4, 0.2, 0.6])
    checkpoint = ModelCheckpoint(monitor="val/loss", save_top_k=2, save_last=False)
    trainer = quiet_trainer(tmp_path, max_steps=10, val_every_n_steps=2,
                            callbacks=[script, checkpoint])
    _fit(trainer, _val_set())

    assert script.steps == [2, 4, 6, 8, 10]
    folders = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert folders == ["best_step_0000004", "best_step_0000008"]
    assert checkpoint.best_model_path == tmp_path / "checkpoints" / "best_step_0000008"
    assert sorted(checkpoint.best_k.values()) == [0.2, 0.3]
    assert checkpoint.best_model_score == 0.2 and checkpoint.best_k_models is checkpoint.best_k
    # the best checkpoint holds the weights of step 8
    model = mlp()
    load_model_weights(checkpoint.best_model_path, model)
    for name, value in model.state_dict().items():
        assert torch.equal(value, script.params[8][name]), name
    summary = json.loads((checkpoint.best_model_path / "meshtrain.json").read_text())
    assert summary["step"] == 8


def test_model_checkpoint_max_mode(tmp_path):
    script = ScriptedValidation([0.5, 0.3, 0.4, 0.2, 0.6])
    checkpoint = ModelCheckpoint(monitor="val/loss", mode="max", save_top_k=1, save_last=False)
    trainer = quiet_trainer(tmp_path, max_steps=10, val_every_n_steps=2,
                            callbacks=[script, checkpoint])
    _fit(trainer, _val_set())
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["best_step_0000010"]
    assert checkpoint.best_model_path.name == "best_step_0000010"


def test_model_checkpoint_every_n_steps_and_last(tmp_path):
    steps = LossRecorder()
    checkpoint = ModelCheckpoint(every_n_steps=3, save_last=True)
    trainer = quiet_trainer(tmp_path, max_steps=7, callbacks=[checkpoint, steps])
    model = _fit(trainer)

    folders = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert folders == ["last", "step_00000003", "step_00000006"]
    for name, step in (("step_00000003", 3), ("step_00000006", 6), ("last", 7)):
        state = torch.load(tmp_path / "checkpoints" / name / "trainer_state.pt",
                           weights_only=True)
        assert state["global_step"] == step
    assert checkpoint.last_model_path == tmp_path / "checkpoints" / "last"
    fresh = mlp()
    load_model_weights(checkpoint.last_model_path, fresh)
    for name, value in model.state_dict().items():
        assert torch.equal(value, fresh.state_dict()[name]), name


def test_model_checkpoint_to_its_own_folder(tmp_path):
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "mine", every_n_steps=2, save_last=False)
    _fit(quiet_trainer(tmp_path / "run", max_steps=4, callbacks=[checkpoint]))
    assert sorted(p.name for p in (tmp_path / "mine").iterdir()) == ["step_00000002",
                                                                     "step_00000004"]
    assert not (tmp_path / "run" / "checkpoints").exists()


# ---- LearningRateMonitor ------------------------------------------------------------------------
def test_learning_rate_monitor_logs_the_rate_of_each_step(tmp_path):
    def schedule(optimizer):
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5 ** step)

    trainer = quiet_trainer(tmp_path, max_steps=4, log_every_n_steps=2, loggers=("csv",),
                            callbacks=[LearningRateMonitor()])
    _fit(trainer, optimizer=lambda p: torch.optim.SGD(p, lr=0.1), lr_scheduler=schedule)

    rows = read_metrics_csv(tmp_path / "metrics.csv")
    lrs = {r["step"]: r["lr"] for r in rows if r.get("lr") is not None}
    # the rate the optimizer used in step s (the scheduler steps after it): 0.1 * 0.5**(s-1)
    assert lrs == pytest.approx({s: 0.1 * 0.5 ** (s - 1) for s in range(1, 5)})
    assert [r["step"] for r in rows if r.get("train/loss") is not None] == [2, 4]


def test_learning_rate_monitor_with_two_groups(tmp_path):
    def two_groups(params):
        params = list(params)
        return torch.optim.SGD([{"params": params[:2]}, {"params": params[2:], "lr": 0.01}],
                               lr=0.1)

    trainer = quiet_trainer(tmp_path, max_steps=2, loggers=("csv",),
                            callbacks=[LearningRateMonitor()])
    _fit(trainer, optimizer=two_groups)
    rows = read_metrics_csv(tmp_path / "metrics.csv")
    assert [(r["lr/group0"], r["lr/group1"]) for r in rows] == [(0.1, 0.01), (0.1, 0.01)]


# ---- on_exception -------------------------------------------------------------------------------
def test_on_exception_sees_the_error_of_the_loss_function(tmp_path):
    class Seen(Callback):
        def __init__(self):
            self.errors, self.step = [], None

        def on_exception(self, trainer, error):
            self.errors.append(error)
            self.step = trainer.global_step

    calls = []

    def loss_fn(output, target):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("loss exploded on purpose")
        return F.mse_loss(output, target)

    seen = Seen()
    trainer = quiet_trainer(tmp_path, max_steps=10, callbacks=[seen])
    with pytest.raises(RuntimeError, match="loss exploded on purpose") as info:
        _fit(trainer, loss_fn=loss_fn)
    assert seen.errors == [info.value]  # called once, with the very error fit raised
    assert seen.step == 2
