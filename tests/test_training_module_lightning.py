"""The same research code trained by Lightning 2.6 and by meshtrain in one process: one class
holds training_step and configure_optimizers, mixed into a LightningModule and into a
meshtrain.TrainingModule; the final weights agree (fp32, 1e-5)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import quiet_trainer, state_of, trainer_kwargs
from torch.utils.data import DataLoader, TensorDataset

import meshtrain
from meshtrain import Trainer

lightning = pytest.importorskip("lightning", reason="pip install -e '.[test]' installs it")

STEPS, BATCH = 8, 16


class Research:
    """The seed notes' LitMNIST, written once."""

    def build(self):
        self.fc1, self.fc2 = torch.nn.Linear(64, 32), torch.nn.Linear(32, 10)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x.flatten(1))))

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        self.log("train_acc", (logits.argmax(1) == y).float().mean(), prog_bar=True)
        return F.cross_entropy(logits, y)

    def test_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self(x), y)

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler,
                                                          "interval": "step"}}


class MeshModel(Research, meshtrain.TrainingModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.build()


class LitModel(Research, lightning.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.build()


def images(n=256):
    x = torch.rand(n, 1, 8, 8, generator=torch.Generator().manual_seed(0))
    return TensorDataset(x, (x.flatten(1)[:, :10] * 3).argmax(1))


@pytest.mark.timeout(120)
def test_lightning_and_meshtrain_train_the_same_module_to_the_same_weights(tmp_path):
    torch.set_num_threads(1)
    ours = quiet_trainer(tmp_path / "meshtrain", max_steps=STEPS, global_batch_size=BATCH,
                         shuffle=False).fit(MeshModel(), images())
    theirs = LitModel()
    lightning.Trainer(accelerator="cpu", devices=1, max_steps=STEPS, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, default_root_dir=tmp_path / "lightning",
                      ).fit(theirs, DataLoader(images(), batch_size=BATCH, shuffle=False))
    # the Lightning user's own DataLoader, as given to Lightning: its batch size and order
    # are taken (no global_batch_size or shuffle set)
    settings = trainer_kwargs(tmp_path / "loader", max_steps=STEPS)
    del settings["global_batch_size"]
    from_loader = Trainer(**settings).fit(
        MeshModel(), DataLoader(images(), batch_size=BATCH, shuffle=False))
    reference = state_of(theirs)
    for mine in (state_of(ours), state_of(from_loader)):
        assert set(mine) == set(reference)
        for name, value in reference.items():
            assert torch.allclose(mine[name], value, atol=1e-5, rtol=0), name
    assert not torch.allclose(mine["fc1.weight"], state_of(MeshModel())["fc1.weight"])


# a Lightning user's Trainer arguments, given as they are to both Trainers
LIGHTNING_ARGS = dict(accelerator="cpu", devices=1, strategy="auto", precision="32-true",
                      max_steps=STEPS, gradient_clip_val=0.3, gradient_clip_algorithm="norm",
                      max_time={"minutes": 10}, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False,
                      num_sanity_val_steps=0, accumulate_grad_batches=1, deterministic=False)


@pytest.mark.timeout(120)
def test_lightnings_trainer_arguments_train_as_under_lightning(tmp_path):
    torch.set_num_threads(1)
    theirs = LitModel()
    lightning.Trainer(**LIGHTNING_ARGS, default_root_dir=tmp_path / "lightning").fit(
        theirs, DataLoader(images(), batch_size=BATCH, shuffle=False))
    trainer = Trainer(**LIGHTNING_ARGS, default_root_dir=tmp_path / "meshtrain")
    ours = trainer.fit(MeshModel(), DataLoader(images(), batch_size=BATCH, shuffle=False))
    assert trainer.grad_norm > LIGHTNING_ARGS["gradient_clip_val"]  # the clipping bites
    reference = state_of(theirs)
    for name, value in state_of(ours).items():
        assert torch.allclose(value, reference[name], atol=1e-5, rtol=0), name
    assert tmp_path / "meshtrain" in trainer.run_dir.parents  # default_root_dir: its runs


class Scheduled(Research):
    """Lightning's epoch schedulers, its hyper-parameters and per-epoch validation."""

    def __init__(self, lr=0.1, form="steplr"):
        super().__init__()
        self.save_hyperparameters()
        torch.manual_seed(0)
        self.build()

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.cross_entropy(self(x), y))

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)
        if self.hparams.form == "steplr":  # Lightning's two lists: stepped once an epoch
            return [optimizer], [torch.optim.lr_scheduler.StepLR(optimizer, 1, gamma=0.5)]
        # loss falling, so under mode="max" it halves the rate at every epoch's end but the first
        plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, mode="max", patience=0)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": plateau,
                                                         "monitor": "val_loss"}}


class OneCycle(Scheduled):
    """OneCycleLR over the run's steps, as Lightning users size it."""

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)
        total = self.trainer.estimated_stepping_batches
        scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=self.hparams.lr,
                                                        total_steps=total)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler,
                                                         "interval": "step"}}


class MeshOneCycle(OneCycle, meshtrain.TrainingModule):
    pass


class LitOneCycle(OneCycle, lightning.LightningModule):
    pass


class MeshScheduled(Scheduled, meshtrain.TrainingModule):
    pass


class LitScheduled(Scheduled, lightning.LightningModule):
    pass


@pytest.mark.timeout(120)
@pytest.mark.parametrize("form", ["steplr", "plateau", "onecycle"])
def test_epoch_schedulers_and_validation_as_under_lightning(tmp_path, form):
    torch.set_num_threads(1)
    args = dict(LIGHTNING_ARGS, max_steps=-1, max_epochs=3, check_val_every_n_epoch=1,
                gradient_clip_val=None)
    loaders = [DataLoader(images(), batch_size=BATCH), DataLoader(images(64), batch_size=BATCH)]
    kinds = (LitOneCycle, MeshOneCycle) if form == "onecycle" else (LitScheduled, MeshScheduled)
    theirs = kinds[0](lr=0.2, form=form)
    lit = lightning.Trainer(**args, default_root_dir=tmp_path / "lightning")
    lit.fit(theirs, *loaders)
    del args["max_steps"]  # (Lightning's -1: no limit)
    trainer = Trainer(**args, default_root_dir=tmp_path / "meshtrain")
    ours = trainer.fit(kinds[1](lr=0.2, form=form), *loaders)
    assert trainer.estimated_stepping_batches == lit.estimated_stepping_batches == 48
    assert ours.hparams.lr == 0.2 and dict(ours.hparams) == dict(theirs.hparams)
    lrs = [group["lr"] for group in trainer.optimizer.param_groups]
    assert lrs == [group["lr"] for group in lit.optimizers[0].param_groups]
    assert lrs[0] < 0.2 / 2 - 1e-9  # stepped at two epochs' ends at least (one cycle: ended)
    reference = state_of(theirs)
    for name, value in state_of(ours).items():
        assert torch.allclose(value, reference[name], atol=1e-5, rtol=0), name
    # Lightning's test(model, dataloaders=...) on the fitted model: its loss over the data
    x, y = images(64).tensors
    with torch.no_grad():
        want = F.cross_entropy(theirs(x), y).item()
    got = trainer.test(ours, dataloaders=DataLoader(images(64), batch_size=BATCH))
    assert got["test/loss"] == pytest.approx(want, abs=1e-5)


class Hooked(Research):
    """Lightning's module hooks and logging options: called in the same order, logging the
    same values."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.build()
        self.calls, self.correct = [], []

    def on_fit_start(self):
        self.calls.append("fit_start")

    def on_train_epoch_start(self):
        self.calls.append(f"epoch_start {self.current_epoch} at {self.global_step}")

    def on_validation_epoch_start(self):
        self.calls.append("val_start")

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.correct.append((self(x).argmax(1) == y).float())
        self.log("val_loss", F.cross_entropy(self(x), y), on_step=False, on_epoch=True,
                 sync_dist=True)
        self.log("val_worst", F.cross_entropy(self(x), y), reduce_fx="max")

    def on_validation_epoch_end(self):
        self.log("val_acc", torch.cat(self.correct).mean())
        self.correct.clear()
        self.calls.append("val_end")

    def on_before_optimizer_step(self, optimizer):
        self.log("lr_seen", optimizer.param_groups[0]["lr"], reduce_fx=torch.min,
                 on_step=False, on_epoch=True)

    def on_train_epoch_end(self):
        self.log("steps_done", float(self.global_step))
        self.log_dict({"epoch_twice": 2.0 * self.current_epoch})
        self.calls.append(f"epoch_end {self.current_epoch}")

    def on_fit_end(self):
        self.calls.append("fit_end")


class MeshHooked(Hooked, meshtrain.TrainingModule):
    pass


class LitHooked(Hooked, lightning.LightningModule):
    pass


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mine", [MeshHooked, LitHooked],
                         ids=["TrainingModule", "LightningModule-as-it-is"])
def test_module_hooks_and_logging_options_as_under_lightning(tmp_path, mine):
    """(LitHooked itself to meshtrain's Trainer: tests/test_lightning_module_as_is.py)"""
    torch.set_num_threads(1)
    args = dict(LIGHTNING_ARGS, max_steps=-1, max_epochs=2, check_val_every_n_epoch=1)
    loaders = [DataLoader(images(), batch_size=BATCH), DataLoader(images(64), batch_size=BATCH)]
    theirs, lit = LitHooked(), lightning.Trainer(**args, default_root_dir=tmp_path / "lightning")
    lit.fit(theirs, *loaders)
    del args["max_steps"]
    trainer = Trainer(**args, default_root_dir=tmp_path / "meshtrain")
    ours = trainer.fit(mine(), *loaders)
    assert isinstance(ours, mine) and ours.calls == theirs.calls
    for name in ("val_loss", "val_worst", "val_acc", "lr_seen", "steps_done", "epoch_twice"):
        assert trainer.callback_metrics[name] == pytest.approx(
            float(lit.callback_metrics[name]), abs=1e-5), name


class ImagesData(lightning.LightningDataModule):
    """A LightningDataModule as Lightning users write it (only what they need defined)."""

    def setup(self, stage):
        self.stages = [*getattr(self, "stages", []), stage]
        self.train = images()

    def train_dataloader(self):
        return DataLoader(self.train, batch_size=BATCH, shuffle=False)

    def test_dataloader(self):
        return DataLoader(images(64), batch_size=BATCH)


@pytest.mark.timeout(120)
def test_a_lightning_datamodule_trains_as_under_lightning(tmp_path):
    torch.set_num_threads(1)
    settings = trainer_kwargs(tmp_path / "meshtrain", max_steps=STEPS)
    del settings["global_batch_size"]  # (the loader's is taken)
    trainer, data = Trainer(**settings), ImagesData()
    ours = trainer.fit(MeshModel(), datamodule=data)
    assert trainer.datamodule is data and data.trainer is trainer and data.stages == ["fit"]
    theirs = LitModel()
    lightning.Trainer(accelerator="cpu", devices=1, max_steps=STEPS, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, default_root_dir=tmp_path / "lightning",
                      ).fit(theirs, datamodule=ImagesData())
    reference = state_of(theirs)
    for name, value in state_of(ours).items():
        assert torch.allclose(value, reference[name], atol=1e-5, rtol=0), name
    # test(datamodule=...) sets it up for "test" and reads its test_dataloader
    result = trainer.test(datamodule=data)["test/loss"]
    assert data.stages == ["fit", "test"]
    assert result == pytest.approx(trainer.test(images(64))["test/loss"], rel=1e-6)
    with pytest.raises(meshtrain.ConfigError, match="has no val_dataloader"):
        trainer.validate(datamodule=data)


def test_a_lightning_callback_object_is_refused_naming_meshtrains():
    with pytest.raises(meshtrain.ConfigError, match="use meshtrain.ModelCheckpoint, which takes "
                                                    "Lightning's arguments"):
        Trainer(callbacks=[lightning.pytorch.callbacks.ModelCheckpoint(monitor="val_loss")])
    with pytest.raises(meshtrain.ConfigError, match="write it as a meshtrain.Callback"):
        Trainer(callbacks=[lightning.pytorch.callbacks.RichProgressBar()])


class Measured(Research):
    """torchmetrics objects logged as themselves, as Lightning users log them."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.build()
        import torchmetrics

        self.train_acc = torchmetrics.classification.MulticlassAccuracy(num_classes=10)
        self.val_acc = torchmetrics.classification.MulticlassAccuracy(num_classes=10)
        self.val_mse = torchmetrics.MeanSquaredError()
        self.val_auroc = torchmetrics.classification.MulticlassAUROC(num_classes=10)  # (keeps
        # every prediction: its states are lists, not sums)

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        self.train_acc(logits, y)
        self.log("train_acc_tm", self.train_acc, on_step=True, on_epoch=True)
        return F.cross_entropy(logits, y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        self.val_acc.update(logits, y)
        self.val_mse.update(logits.softmax(-1)[:, 0], (y == 0).float())
        self.log("val_acc_tm", self.val_acc)
        self.log("val_mse_tm", self.val_mse, on_epoch=True, on_step=False)
        self.val_auroc.update(logits.softmax(-1), y)
        self.log("val_auroc", self.val_auroc)


class MeshMeasured(Measured, meshtrain.TrainingModule):
    pass


class LitMeasured(Measured, lightning.LightningModule):
    pass


@pytest.mark.timeout(120)
def test_torchmetrics_objects_logged_as_under_lightning(tmp_path):
    pytest.importorskip("torchmetrics")
    torch.set_num_threads(1)
    args = dict(LIGHTNING_ARGS, max_steps=-1, max_epochs=2, check_val_every_n_epoch=1)
    loaders = [DataLoader(images(), batch_size=BATCH), DataLoader(images(64), batch_size=BATCH)]
    lit = lightning.Trainer(**args, default_root_dir=tmp_path / "lightning")
    lit.fit(LitMeasured(), *loaders)
    del args["max_steps"]
    trainer = Trainer(**args, default_root_dir=tmp_path / "meshtrain")
    trainer.fit(MeshMeasured(), *loaders)
    for name in ("val_acc_tm", "val_mse_tm", "val_auroc", "train_acc_tm_epoch"):
        assert trainer.callback_metrics[name] == pytest.approx(
            float(lit.callback_metrics[name]), abs=1e-5), name
