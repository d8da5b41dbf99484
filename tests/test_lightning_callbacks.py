"""Lightning's callbacks' options on meshtrain's (``EarlyStopping``'s thresholds,
``ModelCheckpoint``'s names, ``LearningRateMonitor``'s intervals) and Lightning's
``limit_train_batches``: each epoch's first batches, a new order each epoch, the same samples
under dp=2. The module is tests/test_lightning_module_api.py's."""

import pytest
import torch
from conftest import trainer_kwargs
from parity import regression_data
from test_lightning_module_api import Regressor

import meshtrain
from meshtrain import LearningRateMonitor, ModelCheckpoint, Trainer
from meshtrain.errors import ConfigError


@pytest.mark.parametrize("options, stop_step", [
    ({"stopping_threshold": 10.0}, 3),  # the first validation's value is that good
    ({"divergence_threshold": 1e-6}, 3),  # ... and worse than that
    ({"monitor": "val_nan"}, 3),  # check_finite
    ({"monitor": "val_nan", "check_finite": False}, None),
    ({"monitor": "absent", "strict": False}, None),
])
def test_early_stopping_takes_lightnings_options(tmp_path, options, stop_step):
    class WithNaN(Regressor):
        def validation_step(self, batch, batch_idx):
            super().validation_step(batch, batch_idx)
            self.log("val_nan", float("nan"))

    stopper = meshtrain.EarlyStopping(**{"monitor": "val_mse", "patience": 5, "verbose": True,
                                         **options})
    trainer = Trainer(**trainer_kwargs(tmp_path, max_epochs=3, global_batch_size=32,
                                       val_every_n_epochs=1, callbacks=[stopper]))
    trainer.fit(WithNaN(), regression_data(), regression_data(7))
    assert stopper.stopped_at_step == stop_step
    assert trainer.global_step == (stop_step or 9)


def test_model_checkpoint_takes_lightnings_names(tmp_path):
    saver = ModelCheckpoint(every_n_train_steps=2, verbose=True, every_n_epochs=1)
    trainer = Trainer(**trainer_kwargs(tmp_path, max_steps=4, global_batch_size=32,
                                       callbacks=[saver]))
    trainer.fit(Regressor(), regression_data())
    assert {"step_00000002", "step_00000004"} <= {
        p.name for p in (trainer.run_dir / "checkpoints").iterdir()}
    for options, says in [({"filename": "{epoch}"}, "names its folders itself"),
                          ({"save_weights_only": True}, "whole training state"),
                          ({"every_n_epochs": 2}, "checkpoint_every_n_epochs")]:
        with pytest.raises(ConfigError, match=says):
            ModelCheckpoint(**options)


def test_learning_rate_monitor_takes_lightnings_options(tmp_path):
    class Momentum(Regressor):
        def configure_optimizers(self):
            optimizer = torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9,
                                        weight_decay=0.01)
            return [optimizer], [torch.optim.lr_scheduler.StepLR(optimizer, 1, 0.5)]

    monitor = LearningRateMonitor(logging_interval="epoch", log_momentum=True,
                                  log_weight_decay=True)
    trainer = Trainer(**trainer_kwargs(tmp_path, max_epochs=2, global_batch_size=32,
                                       callbacks=[monitor]))
    trainer.fit(Momentum(), regression_data())
    got = {k: trainer.callback_metrics[k] for k in ("lr", "momentum", "weight_decay")}
    assert got == {"lr": 0.05 / 2, "momentum": 0.9, "weight_decay": 0.01}  # at the 2nd epoch's end
    with pytest.raises(ConfigError, match="logging_interval must be"):
        LearningRateMonitor(logging_interval="batch")


def _limited(run_dir, layout=None, max_steps=6):
    seen = []

    class Recording(Regressor):
        def training_step(self, batch, batch_idx):
            seen.append(sorted(batch[0].sum(1).tolist()))
            return super().training_step(batch, batch_idx)

    trainer = Trainer(**trainer_kwargs(run_dir, max_steps=max_steps, global_batch_size=16,
                                       limit_train_batches=2, layout=layout))
    model = trainer.fit(Recording(), regression_data())
    return seen, trainer.current_epoch, {k: v.clone() for k, v in model.state_dict().items()}


def test_limit_train_batches_takes_each_epochs_first_batches(tmp_path):
    from meshtrain.launch.spawn import run_workers

    seen, epoch, state = _limited(tmp_path / "one")
    assert epoch == 2 and len(seen) == 6  # 3 epochs of 2 steps (96 samples: 6 batches each)
    assert len({tuple(step) for step in seen}) == 6  # a new order each epoch
    ranks = run_workers(_limited, 2, args=(tmp_path / "dp", "dp=2"), timeout=120)
    for rank_seen, rank_epoch, rank_state in ranks:
        assert rank_epoch == 2
        for name, value in state.items():
            torch.testing.assert_close(rank_state[name], value, rtol=1e-5, atol=1e-6)
    together = [sorted(a + b) for a, b in zip(ranks[0][0], ranks[1][0])]
    assert together == [sorted(step) for step in seen]  # the same samples each step
