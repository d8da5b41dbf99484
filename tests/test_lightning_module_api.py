"""What a Lightning user writes on the module and the Trainer besides the steps:
``save_hyperparameters()`` / ``self.hparams`` / ``load_from_checkpoint``,
``configure_optimizers`` in Lightning's forms (a scheduler steps per epoch unless its interval
says "step"; ReduceLROnPlateau on a logged value; ``estimated_stepping_batches``),
``val_every_n_epochs`` (Lightning's ``check_val_every_n_epoch``), the module's hooks and
``self.log``'s options (under dp=2 too), ``fit(..., ckpt_path=)`` and ``test(model,
dataloaders=..., ckpt_path="best")``. Callbacks' options: tests/test_lightning_callbacks.py;
equality with Lightning itself: tests/test_training_module_lightning.py."""

import pytest
import torch
import torch.nn.functional as F
from conftest import trainer_kwargs
from parity import regression_data
from torch.utils.data import DataLoader

import meshtrain
from meshtrain import ModelCheckpoint, Trainer
from meshtrain.errors import ConfigError


class Regressor(meshtrain.TrainingModule):
    def __init__(self, width=16, lr=0.05, scheduler="none", backbone=None, **extra):
        super().__init__()
        self.save_hyperparameters(ignore="backbone")
        self.net = torch.nn.Sequential(torch.nn.Linear(12, width), torch.nn.Tanh(),
                                       torch.nn.Linear(width, 3))

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_mse", F.mse_loss(self(x), y))

    def test_step(self, batch, batch_idx):
        return self.training_step(batch, batch_idx)

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=self.hparams.lr)
        kind = self.hparams.scheduler
        if kind == "bare-dict":  # no interval: Lightning's "epoch"
            return {"optimizer": optimizer,
                    "lr_scheduler": torch.optim.lr_scheduler.StepLR(optimizer, 1, 0.5)}
        if kind == "every-2-epochs":
            return {"optimizer": optimizer, "lr_scheduler": {
                "scheduler": torch.optim.lr_scheduler.StepLR(optimizer, 1, 0.5),
                "frequency": 2}}
        if kind == "plateau-unwatched":
            return {"optimizer": optimizer, "lr_scheduler":
                    torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer)}
        if kind == "plateau-on-val":
            return {"optimizer": optimizer, "monitor": "val_mse", "lr_scheduler":
                    torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer)}
        if kind == "every-2-steps":
            return {"optimizer": optimizer, "lr_scheduler": {
                "scheduler": torch.optim.lr_scheduler.StepLR(optimizer, 1, 0.5),
                "interval": "step", "frequency": 2}}
        return [optimizer]


def test_save_hyperparameters_keeps_the_init_arguments():
    model = Regressor(width=8, backbone=torch.nn.Linear(2, 2), note="x")
    assert dict(model.hparams) == {"width": 8, "lr": 0.05, "scheduler": "none", "note": "x"}
    assert model.hparams.width == 8
    with pytest.raises(AttributeError, match="no hyper-parameter 'depth'; saved: width"):
        model.hparams.depth

    class Named(meshtrain.TrainingModule):
        def __init__(self, a=1, b=2, config=None):
            super().__init__()
            self.save_hyperparameters("a") if config is None else \
                self.save_hyperparameters(config)

    assert dict(Named().hparams) == {"a": 1}
    assert dict(Named(config={"depth": 3}).hparams) == {"depth": 3}
    assert dict(meshtrain.TrainingModule().hparams) == {}


def test_the_loggers_record_the_hyperparameters(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    trainer = Trainer(**trainer_kwargs(tmp_path, max_steps=2, loggers=["tensorboard"]))
    trainer.fit(Regressor(width=8), regression_data())
    events = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"tensors": 0})
    events.Reload()
    text = events.Tensors("hparams/text_summary")[0].tensor_proto.string_val[0].decode()
    assert "| hparams/width | 8 |" in text and "| hparams/lr | 0.05 |" in text


def _fit(tmp_path, scheduler, epochs=4, **settings):
    trainer = Trainer(**trainer_kwargs(tmp_path, max_epochs=epochs, global_batch_size=32,
                                       **settings))
    model = trainer.fit(Regressor(scheduler=scheduler), regression_data(),
                        settings.pop("val", None))
    return trainer, model


@pytest.mark.parametrize("scheduler, epochs, halvings", [
    ("bare-dict", 4, 4),  # 96 samples, 3 steps an epoch: per epoch, not per step (12)
    ("every-2-epochs", 4, 2),
])
def test_lightnings_scheduler_forms_step_at_epoch_ends(tmp_path, scheduler, epochs, halvings):
    trainer, _ = _fit(tmp_path, scheduler, epochs)
    assert trainer.global_step == 3 * epochs
    assert trainer.optimizer.param_groups[0]["lr"] == pytest.approx(0.05 / 2 ** halvings)


def test_plateau_on_a_validation_value_needs_validation_at_epoch_ends(tmp_path, no_processes):
    for scheduler, says in [("plateau-unwatched", "ReduceLROnPlateau needs the value it watches"),
                            ("plateau-on-val", "validation must run there"),
                            ("every-2-steps", "every N optimizer steps is not supported")]:
        trainer = Trainer(**trainer_kwargs(tmp_path, max_epochs=2))
        with pytest.raises(ConfigError, match=says):
            trainer.fit(Regressor(scheduler=scheduler), regression_data(), regression_data(7))
        assert trainer.run_dir is None


def test_plateau_steps_on_the_validation_of_each_epoch(tmp_path):
    seen = []

    class Watch(meshtrain.Callback):
        def on_validation_end(self, trainer, metrics):
            seen.append((trainer.global_step, metrics["val_mse"]))

    trainer = Trainer(**trainer_kwargs(tmp_path, max_epochs=3, global_batch_size=32,
                                       val_every_n_epochs=1, callbacks=[Watch()]))
    trainer.fit(Regressor(scheduler="plateau-on-val"), regression_data(), regression_data(7))
    assert [step for step, _ in seen] == [3, 6, 9]  # each epoch's end (the last: fit's own)
    plateau = trainer.lr_scheduler
    assert plateau.best == pytest.approx(min(v for _, v in seen[:2]))  # fed the epochs' values


def test_test_takes_lightnings_arguments(tmp_path):
    checkpoint = ModelCheckpoint(monitor="val_mse", mode="min")
    trainer = Trainer(**trainer_kwargs(tmp_path, max_epochs=3, global_batch_size=32,
                                       val_every_n_epochs=1, callbacks=[checkpoint]))
    model = trainer.fit(Regressor(), regression_data(), regression_data(7))
    test_data = DataLoader(regression_data(5), batch_size=32)
    last = trainer.test(test_data)["test/loss"]
    assert trainer.test(model, dataloaders=test_data)["test/loss"] == last
    with pytest.raises(ConfigError, match="evaluates the model it fitted"):
        trainer.test(Regressor(), dataloaders=test_data)
    # ckpt_path="best": the weights of the best validation's step, as a run stopped there has
    step = int(checkpoint.best_model_path.name.rsplit("_", 1)[1])
    assert step < trainer.global_step  # (the data makes an earlier epoch the best)
    best = trainer.test(ckpt_path="best", dataloaders=test_data)["test/loss"]
    there = Trainer(**trainer_kwargs(tmp_path / "there", max_steps=step, global_batch_size=32))
    there.fit(Regressor(), regression_data())
    assert best == pytest.approx(there.test(test_data)["test/loss"], rel=1e-12) and best != last
    assert trainer.test(ckpt_path="last", dataloaders=test_data)["test/loss"] == last


class Collecting(Regressor):
    """Lightning's epoch-end pattern: outputs collected per batch, reduced in a hook."""

    def __init__(self):
        super().__init__()
        import torchmetrics

        self.errors, self.mse = [], torchmetrics.MeanSquaredError()
        self.count = torchmetrics.SumMetric()
        # states that are not sums: the predictions (gathered), a maximum
        self.spearman, self.worst = torchmetrics.SpearmanCorrCoef(), torchmetrics.MaxMetric()

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.errors.append((self(x) - y).abs().mean(1))
        self.mse.update(self(x), y)
        self.log("val_mse_tm", self.mse)  # a torchmetrics object: over every rank's updates
        self.count.update(torch.tensor(float(len(x))))
        self.log("val_count", self.count)  # a sum: the samples of the whole evaluation
        self.spearman.update(self(x)[:, 0], y[:, 0])
        self.log("val_spearman", self.spearman)  # over the whole evaluation's predictions
        self.worst.update((self(x) - y).abs().max())
        self.log("val_worst", self.worst)
        self.log("val_mse", F.mse_loss(self(x), y), batch_size=len(x), on_epoch=True,
                 on_step=False)
        self.log("val_hidden", 1.0, logger=False)

    def on_validation_epoch_end(self):
        self.log("val_mae", torch.cat(self.errors).mean())
        self.errors.clear()

    def on_train_epoch_end(self):
        assert self.lr_schedulers() is None  # (configure_optimizers returned none)
        self.log("epoch_lr", self.trainer.optimizer.param_groups[0]["lr"])


def _collecting(run_dir, layout=None):
    trainer = Trainer(**trainer_kwargs(run_dir, max_epochs=2, global_batch_size=32,
                                       val_every_n_epochs=1, layout=layout,
                                       loggers=["csv"]))
    trainer.fit(Collecting(), regression_data(), regression_data(7))
    return dict(trainer.callback_metrics), trainer.run_dir


def test_epoch_end_hooks_under_dp_2_log_what_one_process_logs(tmp_path):
    from meshtrain.launch.spawn import run_workers
    from meshtrain.observe.loggers.local import read_metrics_csv

    one, run_dir = _collecting(tmp_path / "one")
    assert {"val_mse", "val_mae", "val_hidden", "epoch_lr"} <= set(one)
    assert one["val_mse_tm"] == pytest.approx(one["val_mse"], rel=1e-6)  # (equal batches)
    assert one["val_count"] == 96
    columns = {k for row in read_metrics_csv(run_dir / "metrics.csv") for k in row}
    assert "val_mae" in columns and "val_hidden" not in columns  # logger=False
    for metrics, _ in run_workers(_collecting, 2, args=(tmp_path / "dp", "dp=2"), timeout=120):
        for name in ("val_mse", "val_mae", "val_mse_tm", "val_count", "val_spearman",
                     "val_worst", "epoch_lr", "train/loss"):
            assert metrics[name] == pytest.approx(one[name], rel=1e-6), name


def test_a_lightning_hook_meshtrain_would_not_call_is_refused(tmp_path, no_processes):
    class PerBatch(Regressor):
        def on_train_batch_end(self, outputs, batch, batch_idx):
            pass

    class Hooked(Regressor):
        def on_train_epoch_end(self):
            pass

    for model, settings, says in [
            (PerBatch(), {}, "on_train_batch_end is a Lightning hook meshtrain does not call"),
            (Hooked(), {"layout": "pp=2", "devices": 2}, "under pp the module is split")]:
        trainer = Trainer(**trainer_kwargs(tmp_path, max_steps=2, **settings))
        with pytest.raises(ConfigError, match=says):
            trainer.fit(model, regression_data())
        assert trainer.run_dir is None


def test_log_takes_lightnings_options_and_refuses_a_wrong_one(tmp_path):
    seen = {}

    class Weighted(Regressor):
        def training_step(self, batch, batch_idx):
            x, y = batch
            self.log("weighted", 1.0 if batch_idx % 2 == 0 else 0.0,
                     batch_size=3 if batch_idx % 2 == 0 else 1, on_epoch=True)
            self.log("smallest", float(batch_idx), reduce_fx="min", on_epoch=True)
            seen["device"], seen["step"] = self.device, self.global_step
            return super().training_step(batch, batch_idx)

    trainer = Trainer(**trainer_kwargs(tmp_path, max_steps=2, global_batch_size=32,
                                       log_every_n_steps=2))
    trainer.fit(Weighted(), regression_data())
    assert trainer.callback_metrics["weighted"] == pytest.approx(0.75)  # (3 * 1 + 1 * 0) / 4
    assert trainer.callback_metrics["smallest"] == 0.0
    assert seen == {"device": torch.device("cpu"), "step": 1}

    class Wrong(Regressor):
        def training_step(self, batch, batch_idx):
            self.log("x", 1.0, reduce_fx="median")
            return super().training_step(batch, batch_idx)

    with pytest.raises(ConfigError, match="reduce_fx='median'; choose"):
        Trainer(**trainer_kwargs(tmp_path / "wrong", max_steps=1)).fit(Wrong(), regression_data())


def test_fit_takes_lightnings_keywords_and_ckpt_path(tmp_path):
    loader = DataLoader(regression_data(), batch_size=32)
    trainer = Trainer(**trainer_kwargs(tmp_path, max_steps=3, global_batch_size=32,
                                       save_final_checkpoint=True))
    trainer.fit(Regressor(lr=0.2), train_dataloaders=loader, val_dataloaders=regression_data(7))
    assert "val_mse" in trainer.callback_metrics
    final = trainer.run_dir / "checkpoints" / "final"
    # continued from step 3 with the checkpoint's optimizer (lr 0.2): as 6 steps in one go
    again = Trainer(**trainer_kwargs(tmp_path / "again", max_steps=6, global_batch_size=32))
    again.fit(Regressor(lr=0.05), loader, ckpt_path=final)
    straight = Trainer(**trainer_kwargs(tmp_path / "straight", max_steps=6,
                                        global_batch_size=32))
    one_go = straight.fit(Regressor(lr=0.2), loader)
    for name, value in one_go.state_dict().items():
        assert torch.equal(again.model.state_dict()[name], value), name
    with pytest.raises(ConfigError, match="unexpected keyword"):
        Trainer(**trainer_kwargs(tmp_path / "x", max_steps=1)).fit(
            Regressor(), regression_data(), train_dataloader=regression_data())


@pytest.mark.parametrize("settings, loader_function, want", [
    ({"max_epochs": 2, "global_batch_size": 32}, False, 6),  # 96 samples: 3 steps an epoch
    ({"max_epochs": 5, "max_steps": 4, "global_batch_size": 32}, False, 4),
    ({"max_epochs": 2}, True, 12),  # a loader built by a function after the checks: 16 a step
])
def test_estimated_stepping_batches_is_known_to_configure_optimizers(tmp_path, settings,
                                                                       loader_function, want):
    seen = []

    class Sized(Regressor):
        def configure_optimizers(self):
            seen.append(self.trainer.estimated_stepping_batches)
            return super().configure_optimizers()

    kwargs = trainer_kwargs(tmp_path, **settings)
    if "global_batch_size" not in settings:
        del kwargs["global_batch_size"]  # (the loader's)
    data = (lambda: DataLoader(regression_data(), batch_size=16)) if loader_function else \
        regression_data()
    trainer = Trainer(**kwargs)
    trainer.fit(Sized(), data)
    assert seen and set(seen) == {want} and trainer.estimated_stepping_batches == want


def _saved_under_zero3(run_dir):
    trainer = Trainer(**trainer_kwargs(run_dir, max_steps=3, global_batch_size=32,
                                       layout="zero3=2", save_final_checkpoint=True))
    trainer.fit(Regressor(width=8, lr=0.1, scheduler="none", note=[1, "a"],
                          backbone=torch.nn.Linear(1, 1)), regression_data())
    whole = trainer.whole_model()
    return {k: v.clone() for k, v in whole.state_dict().items()}, str(trainer.run_dir)


def test_load_from_checkpoint_builds_the_module_from_its_saved_hyperparameters(tmp_path):
    from meshtrain.launch.spawn import run_workers

    (want, run_dir), _ = run_workers(_saved_under_zero3, 2, args=(tmp_path,), timeout=120)
    model = Regressor.load_from_checkpoint(f"{run_dir}/checkpoints/final")
    assert dict(model.hparams) == {"width": 8, "lr": 0.1, "scheduler": "none", "note": [1, "a"]}
    for name, value in model.state_dict().items():
        assert torch.equal(value, want[name]), name
    with pytest.raises(RuntimeError, match="size mismatch"):  # given keywords replace them
        Regressor.load_from_checkpoint(f"{run_dir}/checkpoints/final", width=4)


def test_one_optimizer_in_manual_optimisation_is_given_as_itself(tmp_path):
    class ManualOne(Regressor):
        automatic_optimization = False

        def training_step(self, batch, batch_idx):
            optimizer = self.optimizers()  # Lightning's: the optimizer, not a list of one
            optimizer.zero_grad()
            loss = super().training_step(batch, batch_idx)
            self.manual_backward(loss)
            optimizer.step()
            return loss

    states = []
    for kind in (ManualOne, Regressor):
        trainer = Trainer(**trainer_kwargs(tmp_path / kind.__name__, max_steps=4,
                                           global_batch_size=32))
        states.append(trainer.fit(kind(), regression_data()).state_dict())
    for name, value in states[1].items():
        torch.testing.assert_close(states[0][name], value, rtol=0, atol=1e-7)


def test_the_trainer_answers_lightnings_questions(tmp_path):
    seen = {}

    class Asking(Regressor):
        def on_validation_epoch_end(self):
            seen["sanity"] = self.trainer.sanity_checking  # Lightning code returns early on it
            seen["rank"] = (self.trainer.global_rank, self.trainer.is_global_zero)

    trainer = Trainer(**trainer_kwargs(tmp_path, max_steps=2, global_batch_size=32))
    trainer.fit(Asking(), regression_data(), regression_data(7))
    assert seen == {"sanity": False, "rank": (0, True)}


def test_a_metric_collection_goes_through_log_dict(tmp_path):
    torchmetrics = pytest.importorskip("torchmetrics")

    class Collected(Regressor):
        def __init__(self, whole: bool):
            super().__init__()
            self.whole = whole
            self.scores = torchmetrics.MetricCollection(
                {"val_mae": torchmetrics.MeanAbsoluteError(), "val_max": torchmetrics.MaxMetric()})

        def validation_step(self, batch, batch_idx):
            x, y = batch
            self.scores["val_mae"].update(self(x), y)
            self.scores["val_max"].update((self(x) - y).abs().max())
            if self.whole:
                self.log("scores", self.scores)
            else:
                self.log_dict(self.scores)

    data = regression_data(7)
    trainer = Trainer(**trainer_kwargs(tmp_path, max_steps=2, val_every_n_steps=2))
    model = trainer.fit(Collected(whole=False), regression_data(), data)
    x, y = data.tensors
    with torch.no_grad():
        errors = (model(x) - y).abs()
    assert trainer.callback_metrics["val_mae"] == pytest.approx(float(errors.mean()), rel=1e-6)
    assert trainer.callback_metrics["val_max"] == pytest.approx(float(errors.max()), rel=1e-6)
    with pytest.raises(ConfigError, match=r"self.log_dict\(collection\)"):
        Trainer(**trainer_kwargs(tmp_path / "b", max_steps=2, val_every_n_steps=2)).fit(
            Collected(whole=True), regression_data(), data)
