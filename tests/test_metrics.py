"""Validation metrics (meshtrain.metrics): token accuracy and perplexity equal what one process
computes by hand, and every layout reports the same numbers as one process (issue 14, item 4)."""

import math
import tempfile

import pytest
import torch
from parity import adamw_gpt, padded_tokens, tiny_gpt_seq12

from meshtrain import Trainer
from meshtrain.errors import ConfigError
from meshtrain.launch.spawn import run_workers
from meshtrain.losses import cross_entropy
from meshtrain.metrics import Metric, TokenAccuracy, resolve

METRICS = ["perplexity", "token_accuracy"]


class PaddedDicts(torch.utils.data.Dataset):
    """Hugging Face batches ``{"input_ids", "labels"}``, labels -100 after k_i tokens."""

    def __init__(self, num_samples: int = 64, seed: int = 5):
        gen = torch.Generator().manual_seed(seed)
        self.tokens = torch.randint(0, 32, (num_samples, 12), generator=gen)
        self.keep = torch.randint(2, 13, (num_samples,), generator=gen)

    def __len__(self):
        return len(self.tokens)

    def __getitem__(self, i):
        labels = self.tokens[i].clone()
        labels[self.keep[i]:] = -100
        return {"input_ids": self.tokens[i], "labels": labels}


def tiny_llama_4_layers():
    from meshtrain.models.hf import tiny_llama

    return tiny_llama(num_layers=4)


def _validate(layout, model="gpt", **extra):
    """Train 2 steps under ``layout``, then the validation metrics and (in one process) the
    model and the validation data for a hand computation."""
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as run_dir:
        trainer = Trainer(layout=layout, max_steps=2, global_batch_size=8, loggers=(),
                          progress_bar=False, run_dir=run_dir, seed=0,
                          save_final_checkpoint=False, metrics=METRICS, **extra)
        if model == "gpt":
            val = padded_tokens(seed=3)
            fitted = trainer.fit(tiny_gpt_seq12, padded_tokens(), optimizer=adamw_gpt,
                                 loss_fn=cross_entropy())
        else:
            val = PaddedDicts(num_samples=24, seed=6)
            fitted = trainer.fit(tiny_llama_4_layers, PaddedDicts(), optimizer=adamw_gpt)
        metrics = trainer.validate(val)
        return metrics, (fitted, val) if layout is None else None


def test_token_accuracy_and_perplexity_by_hand():
    metrics, (model, val) = _validate(None)
    x, y = val.tensors
    with torch.no_grad():
        logits = model(x)
    counted = y != -100
    accuracy = ((logits.argmax(-1) == y) & counted).sum() / counted.sum()
    assert abs(metrics["val/token_accuracy"] - float(accuracy)) < 1e-9
    assert abs(metrics["val/perplexity"] - math.exp(metrics["val/loss"])) < 1e-9


def test_hugging_face_labels_are_shifted():
    metrics, (model, val) = _validate(None, model="hf")
    batch = {k: torch.stack([val[i][k] for i in range(len(val))]) for k in ("input_ids", "labels")}
    with torch.no_grad():
        logits = model(batch["input_ids"]).logits[:, :-1]
    targets = batch["labels"][:, 1:]
    counted = targets != -100
    accuracy = ((logits.argmax(-1) == targets) & counted).sum() / counted.sum()
    assert abs(metrics["val/token_accuracy"] - float(accuracy)) < 1e-9


@pytest.mark.timeout(200)
@pytest.mark.parametrize("layout, model, extra", [
    ("dp=2", "gpt", {}), ("tp=2", "gpt", {"loss_parallel": True}), ("cp=2", "gpt", {}),
    ("pp=2", "gpt", {}), ("cp=2", "hf", {}), ("pp=2", "hf", {}),
])
def test_layouts_report_what_one_process_does(layout, model, extra):
    alone, _ = _validate(None, model)
    for metrics, _ in run_workers(_validate_with, 2, (layout, model, extra), timeout=150):
        assert metrics.keys() == alone.keys()
        for key, value in alone.items():
            assert abs(metrics[key] - value) <= 1e-5 * max(1.0, abs(value)), (key, metrics[key], value)


def _validate_with(layout, model, extra):
    return _validate(layout, model, **extra)


def test_bad_metrics_are_config_errors():
    with pytest.raises(ConfigError, match="unknown metric 'accuracy'"):
        Trainer(metrics=["accuracy"], max_steps=1)
    with pytest.raises(ConfigError, match="distinct names"):
        resolve([TokenAccuracy(), TokenAccuracy()])
    assert [m.name for m in resolve(METRICS)] == METRICS
    assert isinstance(resolve(["token_accuracy"])[0], Metric)
