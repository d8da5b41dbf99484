"""torchmetrics metrics in `metrics=` (meshtrain.metrics.TorchMetric): their sum states reduced
over every rank with the loss, so dp=2 and zero3=2 report what one process does, and one
process what torchmetrics computes over the whole validation set."""

import tempfile

import pytest
import torch
import torchmetrics
from parity import mlp, regression_data, sgd
from torch.utils.data import TensorDataset

from meshtrain import Trainer
from meshtrain.errors import ConfigError
from meshtrain.launch.spawn import run_workers


def classes(seed: int = 1234) -> TensorDataset:
    x, y = regression_data(seed).tensors
    return TensorDataset(x, y.argmax(1))


def _metrics(task: str):
    if task == "classes":
        return [torchmetrics.classification.MulticlassAccuracy(num_classes=3, average="micro"),
                torchmetrics.classification.MulticlassF1Score(num_classes=3, average="macro")]
    return [torchmetrics.MeanSquaredError()]


def _validate(layout, task):
    torch.set_num_threads(1)
    data, loss = ((classes, torch.nn.functional.cross_entropy) if task == "classes" else
                  (regression_data, torch.nn.functional.mse_loss))
    with tempfile.TemporaryDirectory() as run_dir:
        trainer = Trainer(layout=layout, max_steps=3, global_batch_size=16, loggers=(),
                          progress_bar=False, run_dir=run_dir, seed=0, report=False,
                          save_final_checkpoint=False, metrics=_metrics(task))
        model = trainer.fit(mlp, data(), optimizer=sgd, loss_fn=loss)
        val = data(seed=7)
        result = trainer.validate(val)
        if layout is not None:
            return result
        with torch.no_grad():  # torchmetrics itself, over the whole validation set at once
            x, y = val.tensors
            direct = {}
            for metric in _metrics(task):
                metric.update(model(x), y)
                direct[type(metric).__name__.lower()] = float(metric.compute())
        return result, direct


@pytest.mark.timeout(300)
@pytest.mark.parametrize("task", ["classes", "regression"])
def test_torchmetrics_match_one_process_under_dp_and_zero3(task):
    alone, direct = _validate(None, task)
    for name, value in direct.items():
        assert abs(alone[f"val/{name}"] - value) < 1e-6, (name, alone, direct)
    for layout in ("dp=2", "zero3=2"):
        for rank in run_workers(_validate, 2, (layout, task), timeout=200):
            for name in direct:
                assert abs(rank[f"val/{name}"] - alone[f"val/{name}"]) < 1e-6, (layout, rank)


def test_a_metric_that_keeps_predictions_is_refused():
    with pytest.raises(ConfigError, match="not sums"):
        Trainer(metrics=[torchmetrics.classification.MulticlassAUROC(num_classes=3)])
