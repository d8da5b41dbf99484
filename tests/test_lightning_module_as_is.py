"""A Lightning ``LightningModule`` given to meshtrain's Trainer as it is, without changing its
base class (meshtrain/module/lightning_module.py): its hooks run and its ``self.log`` values
arrive as under Lightning's own Trainer (test_training_module_lightning.py's hooked module,
given as it is), in one process and under zero3=2; the trained module
copies and pickles; a GAN with Lightning's toggled optimizers equals the hand-written loop. (Before, ``self.log`` only warned and dropped every value.)"""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
import torch.nn.functional as F
from conftest import state_of, trainer_kwargs
from torch.utils.data import DataLoader

import meshtrain
from meshtrain import Trainer

lightning = pytest.importorskip("lightning", reason="pip install -e '.[test]' installs it")

from test_manual_optimization import GAN, gan_data, hand_loop  # noqa: E402
from test_training_module_lightning import (  # noqa: E402 (after the skip)
    BATCH, STEPS, LitHooked, LitModel, images,
)

pytestmark = pytest.mark.timeout(180)


def test_the_trained_module_copies_and_pickles(tmp_path):
    torch.set_num_threads(1)
    trainer = Trainer(**trainer_kwargs(tmp_path, max_steps=2, global_batch_size=BATCH))
    model = trainer.fit(LitModel(), images())
    assert model.trainer is trainer and "train_acc" in trainer.callback_metrics
    again = pickle.loads(pickle.dumps(model))  # the user's own class, without the Trainer
    assert type(again) is LitModel and again._trainer is None
    twin = copy.deepcopy(model)  # keeps meshtrain's side, without the Trainer
    assert isinstance(twin, LitModel) and twin.trainer is None
    with pytest.raises(meshtrain.ConfigError, match="outside fit"):
        twin.log("x", 1.0)
    for name, value in state_of(model).items():
        assert torch.equal(state_of(again)[name], value) and torch.equal(state_of(twin)[name],
                                                                          value)


def _fit(run_dir, layout):
    torch.set_num_threads(1)
    trainer = Trainer(**trainer_kwargs(run_dir, max_steps=STEPS, global_batch_size=BATCH,
                                       shuffle=False, layout=layout,
                                       devices=2 if layout else 1))
    model = trainer.fit(LitModel(), images())
    return float(trainer.callback_metrics["train_acc"]), state_of(trainer.whole_model())


def test_under_zero3_it_trains_and_logs_as_one_process(tmp_path):
    from meshtrain.launch.spawn import run_workers

    acc, weights = _fit(tmp_path / "one", None)
    for rank_acc, rank_weights in run_workers(_fit, 2, args=(tmp_path / "z3", "zero3=2"),
                                              timeout=150):
        assert rank_acc == pytest.approx(acc, abs=1e-6)
        for name, value in weights.items():
            assert torch.allclose(rank_weights[name], value, atol=1e-5, rtol=0), name


class LitGAN(lightning.LightningModule):
    """test_manual_optimization's GAN written as Lightning's documentation writes one: a
    LightningModule, each optimizer's part between toggle_optimizer and untoggle_optimizer
    (the generator's backward then computes no gradient for the discriminator)."""

    clip = None

    def __init__(self):
        super().__init__()
        self.automatic_optimization = False
        torch.manual_seed(0)
        reference = GAN()
        self.generator, self.discriminator = reference.generator, reference.discriminator

    configure_optimizers = GAN.configure_optimizers

    def training_step(self, batch, batch_idx):
        real, noise = batch
        opt_g, opt_d = self.optimizers()
        fake = self.generator(noise)
        self.toggle_optimizer(opt_d)
        loss_d = (F.softplus(-self.discriminator(real))
                  + F.softplus(self.discriminator(fake.detach()))).mean()
        opt_d.zero_grad()
        self.manual_backward(loss_d)
        opt_d.step()
        self.untoggle_optimizer(opt_d)
        with self.toggled_optimizer(opt_g):
            loss_g = F.softplus(-self.discriminator(fake)).mean()
            opt_g.zero_grad()
            before = [p.grad.clone() for p in self.discriminator.parameters()]
            self.manual_backward(loss_g)
            skipped = all(torch.equal(p.grad, was)
                          for p, was in zip(self.discriminator.parameters(), before))
            opt_g.step()
        self.log("discriminator_skipped", float(skipped), reduce="min")
        self.log("loss_d", loss_d)


def _gan(run_dir, layout):
    torch.set_num_threads(1)
    trainer = Trainer(**trainer_kwargs(run_dir, layout=layout, max_steps=5,
                                       global_batch_size=16, shuffle=False))
    trainer.fit(LitGAN(), gan_data())
    assert all(p.requires_grad for p in trainer.model.parameters())  # untoggled
    return trainer.callback_metrics["discriminator_skipped"], state_of(trainer.whole_model())


def test_a_lightning_gan_with_toggled_optimizers_equals_the_hand_loop(tmp_path):
    from meshtrain.launch.spawn import run_workers

    reference = GAN()
    hand_loop(reference)
    for skipped, state in run_workers(_gan, 2, args=(tmp_path, "dp=2"), timeout=150):
        assert skipped == 1.0
        for name, value in state_of(reference).items():
            assert torch.allclose(state[name], value, atol=1e-5, rtol=0), name
    # under FSDP2 the toggle would not reach the gathered copies: refused, saying so
    with pytest.raises(meshtrain.WorkerFailed, match="toggle_optimizer under dp_shard=2"):
        run_workers(_gan, 2, args=(tmp_path / "z3", "zero3=2"), timeout=150)


class LitPlain(lightning.LightningModule):
    """A LightningModule used as a plain model: no steps of its own (Lightning's base class
    has placeholders for them), the loss given to fit."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc = torch.nn.Linear(64, 10)

    def forward(self, x):
        return self.fc(x.flatten(1))


class LitTrainsOnly(LitPlain):
    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self(x), y)


def test_the_steps_it_leaves_to_lightnings_placeholders_are_absent(tmp_path):
    """Lightning's placeholders are not called: the module trains with loss_fn, predicts with
    its forward, and val_data without a validation_step is refused as for any module."""
    torch.set_num_threads(1)
    settings = trainer_kwargs(tmp_path, max_steps=3, global_batch_size=BATCH, shuffle=False)
    sgd = lambda params: torch.optim.SGD(params, lr=0.1)  # noqa: E731
    trainer = Trainer(**settings)
    ours = trainer.fit(LitPlain(), images(), optimizer=sgd, loss_fn=F.cross_entropy)
    plain = torch.nn.Sequential(torch.nn.Flatten(), LitPlain().fc)
    Trainer(**dict(settings, run_dir=tmp_path / "plain")).fit(
        plain, images(), optimizer=sgd, loss_fn=F.cross_entropy)
    assert torch.equal(ours.fc.weight, plain[1].weight)
    x = images(5).tensors[0]
    assert torch.allclose(trainer.predict(torch.utils.data.TensorDataset(x)), ours(x))
    with pytest.raises(meshtrain.ConfigError, match="needs a validation_step"):
        Trainer(**dict(settings, run_dir=tmp_path / "val")).fit(
            LitTrainsOnly(), images(), images(64), optimizer=sgd)


def test_lightnings_call_shapes_of_the_trainers_methods(tmp_path):
    """Lightning's quickstart calls, keywords included, on meshtrain's Trainer."""
    torch.set_num_threads(1)
    trainer = Trainer(**trainer_kwargs(tmp_path, max_steps=3, global_batch_size=BATCH))
    model, loader = LitHooked(), DataLoader(images(64), batch_size=BATCH)
    trainer.fit(model=model, train_dataloaders=DataLoader(images(), batch_size=BATCH),
                val_dataloaders=loader)
    val = trainer.validate(model=model, dataloaders=loader, verbose=False)
    assert val["val_loss"] == pytest.approx(trainer.validate(images(64))["val_loss"])
    assert trainer.test(model=model, dataloaders=loader)["test/loss"] > 0
    assert trainer.predict(model=model, dataloaders=loader).shape == (64, 10)
    assert trainer.predict(model=model, dataloaders=loader, return_predictions=False) is None
    with pytest.raises(meshtrain.ConfigError, match="unexpected keyword.*weights_only"):
        trainer.test(model=model, dataloaders=loader, weights_only=True)
    with pytest.raises(meshtrain.ConfigError, match="evaluates the model it fitted"):
        trainer.test(model=LitHooked(), dataloaders=loader)


def _ranks():
    trainer = Trainer(devices=2, loggers=(), report=False)
    return (trainer.global_rank, trainer.local_rank, trainer.num_devices, trainer.num_nodes,
            trainer.world_size)


def test_lightnings_names_of_what_the_trainer_knows(tmp_path):
    from meshtrain.launch.spawn import run_workers

    checkpoint = meshtrain.ModelCheckpoint(monitor="train/loss")
    stop = meshtrain.EarlyStopping("train/loss")
    trainer = Trainer(**trainer_kwargs(tmp_path, max_steps=2, global_batch_size=BATCH,
                                       callbacks=[checkpoint, stop], root_dir=str(tmp_path)))
    assert trainer.optimizers == [] and trainer.log_dir is None
    trainer.fit(LitModel(), images())
    assert trainer.optimizers == [trainer.optimizer] and trainer.log_dir == str(trainer.run_dir)
    assert trainer.checkpoint_callback is checkpoint and trainer.checkpoint_callbacks == [checkpoint]
    assert trainer.early_stopping_callback is stop and trainer.default_root_dir == str(tmp_path)
    assert (trainer.global_rank, trainer.local_rank, trainer.num_devices, trainer.num_nodes) == \
        (0, 0, 1, 1)
    assert run_workers(_ranks, 2, timeout=60) == [(0, 0, 2, 1, 2), (1, 1, 2, 1, 2)]
    with pytest.raises(AttributeError, match="logger"):  # Lightning's logger objects: none
        trainer.logger  # noqa: B018
