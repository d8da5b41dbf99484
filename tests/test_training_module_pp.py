"""A research module (meshtrain.TrainingModule) under a pipeline: its training_step and
validation_step split around the stages (meshtrain/parallel/pipeline/step_split.py), trained under
pp=2 to one process's weights, every step's logged values on every rank."""

from __future__ import annotations

import pytest
import torch
from conftest import quiet_trainer, state_of
from test_training_module import BATCH, STEPS, MNISTLike, images

import meshtrain
from meshtrain.launch.spawn import run_workers


class BlockMNIST(MNISTLike):
    """The same research code with its layers as pipeline blocks (model.layers, a head), so
    that pp can cut it; the step flattens the images before calling the model (work the
    pipeline's first stage must not skip) and logs accuracy on the output."""

    def __init__(self):
        super().__init__()
        del self.fc1, self.fc2
        self.layers = torch.nn.ModuleList([
            torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU()),
            torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU())])
        self.head = torch.nn.Linear(32, 10)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.head(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return super().training_step((x.flatten(1), y), batch_idx)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        return super().validation_step((x.flatten(1), y), batch_idx)


def _block_fit(run_dir, layout=None):
    torch.set_num_threads(1)
    torch.manual_seed(0)
    kwargs = dict(max_steps=STEPS, global_batch_size=BATCH, log_every_n_steps=1,
                  val_every_n_steps=3, limit_val_batches=None, shuffle=False)
    steps = StepMetrics()
    trainer = quiet_trainer(run_dir, **({"layout": layout} if layout else {}), **kwargs,
                            callbacks=[steps])
    trainer.fit(BlockMNIST, images(), images(64, seed=1))
    whole = trainer.whole_model()
    return state_of(whole), {**trainer.callback_metrics, "steps": steps.seen}


class StepMetrics(meshtrain.Callback):
    """Every step's logged metrics (log_every_n_steps=1)."""

    def __init__(self):
        self.seen = []

    def on_train_step_end(self, trainer, metrics):
        self.seen.append({k: metrics[k] for k in ("train/loss", "train_acc") if k in metrics})


@pytest.mark.timeout(200)
def test_the_module_trains_under_pp_like_one_process(tmp_path):
    """Its training_step split around the pipeline: the first stage runs the step up to
    self(x), the last runs the rest on the pipeline's output; logged values reach rank 0."""
    reference, reference_metrics = _block_fit(tmp_path / "one")
    for rank, (state, metrics) in enumerate(run_workers(
            _block_fit, 2, (tmp_path / "pp", "pp=2"), timeout=150)):
        assert set(state) == set(reference)
        for name, value in reference.items():
            torch.testing.assert_close(state[name], value, atol=1e-6, rtol=0)
        for name in ("train_acc", "val/loss", "val_acc", "train/loss"):
            assert metrics[name] == pytest.approx(reference_metrics[name], abs=1e-6), (rank, name)
        assert len(metrics["steps"]) == STEPS  # every step's loss and accuracy, on every rank
        for step, (got, want) in enumerate(zip(metrics["steps"], reference_metrics["steps"])):
            assert got.keys() == want.keys() == {"train/loss", "train_acc"}, (rank, step)
            assert got == pytest.approx(want, abs=1e-6), (rank, step + 1)
