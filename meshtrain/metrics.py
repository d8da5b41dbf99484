"""Validation metrics beside the loss, reduced over every rank.

A :class:`Metric` keeps its state as sums (a 1-D float64 tensor) that add over batches and over
ranks: ``update(sums, output, batch)`` adds one batch's share on the rank that computed the
model's output for it (under ``pp`` the last stage, under ``cp`` each rank its shard of the
sequence), meshtrain sums the tensors of every rank with the loss in one all-reduce, and
``compute(sums, loss)`` turns the totals into a number. Every layout then reports what one
process would. Built in (by name, e.g. ``Trainer(metrics=["perplexity", "token_accuracy"])`` or
``[trainer] metrics = [...]`` in a config): ``perplexity`` (exp of the validation loss, for a
token-mean cross-entropy) and ``token_accuracy`` (argmax == target over the targets that
count). Metrics are logged as ``val/<name>`` and ``test/<name>``.
"""

from __future__ import annotations

import math

import torch

from meshtrain.data.batch import plain
from meshtrain.errors import ConfigError


class Metric:
    """Subclass: set ``name`` and ``num_sums``, write ``update`` and ``compute``."""

    name = "metric"
    num_sums = 0

    def update(self, sums: torch.Tensor, output, batch) -> None:
        """Add one batch's share to ``sums`` (in place). ``output``: what the model returned
        (logits, or an object with ``.logits``); ``batch``: as the model saw it."""

    def compute(self, sums: torch.Tensor, loss: float) -> float:
        raise NotImplementedError


class Perplexity(Metric):
    """exp(validation loss): meaningful for a token-mean cross-entropy (meshtrain.losses, a
    Hugging Face causal LM's own loss)."""

    name = "perplexity"

    def compute(self, sums: torch.Tensor, loss: float) -> float:
        return math.exp(min(loss, 700.0))


class TokenAccuracy(Metric):
    """The fraction of targets (not ``ignore_index``) whose most likely token is right.

    Targets: ``(inputs, targets)`` pairs give them aligned with the logits; Hugging Face dict
    batches give ``labels`` that the model shifts (position t predicts labels[t + 1]), or
    ``shift_labels`` already shifted (context parallel)."""

    name = "token_accuracy"
    num_sums = 2  # correct, counted

    def __init__(self, ignore_index: int = -100):
        self.ignore_index = ignore_index

    def update(self, sums: torch.Tensor, output, batch) -> None:
        logits = plain(getattr(output, "logits", output))
        if isinstance(batch, dict):
            if batch.get("shift_labels") is not None:
                targets = batch["shift_labels"]
            else:
                targets, logits = batch["labels"][:, 1:], logits[:, :-1]
        else:
            targets = batch[1]
        counted = targets != self.ignore_index
        right = (logits.argmax(-1) == targets) & counted
        sums[0] += right.sum()
        sums[1] += counted.sum()

    def compute(self, sums: torch.Tensor, loss: float) -> float:
        return float(sums[0] / sums[1].clamp(min=1))


BUILTIN = {"perplexity": Perplexity, "token_accuracy": TokenAccuracy}


def resolve(metrics) -> list[Metric]:
    """Metric objects from names (``BUILTIN``) and objects; ConfigError names a bad item."""
    if isinstance(metrics, (str, Metric)):
        metrics = [metrics]
    out = []
    for item in metrics or ():
        if isinstance(item, str) and item in BUILTIN:
            item = BUILTIN[item]()
        if not isinstance(item, Metric):
            raise ConfigError(f"unknown metric {item!r} in metrics; use {', '.join(BUILTIN)} "
                              "or meshtrain.metrics.Metric objects")
        out.append(item)
    names = [m.name for m in out]
    if len(set(names)) != len(names) or "loss" in names:
        raise ConfigError(f"metrics must have distinct names other than 'loss', got {names}")
    return out


def fit_metric_names(settings: dict, *, unit: str = "tokens",
                     validation: bool = True) -> list[str]:
    """The names ``Trainer.fit`` logs under ``settings`` (Trainer keywords, e.g. a config's
    ``meshtrain.settings.flatten``) when its training data are counted in ``unit`` ("tokens"
    for token ids, else "samples"), with or without validation data. What a model logs itself
    (``self.log``) is not in it. A recipe's ``metrics(config)`` (what ``meshtrain sweep`` checks
    its objective against before any trial) starts from these."""
    names = ["epoch", "train/loss", f"train/{unit}_per_s", "train/tflops", "train/mfu"]
    if settings.get("log_grad_norm"):
        names.append("train/grad_norm")
    if settings.get("nan_policy") in ("skip", "rollback"):  # once a step was skipped
        names.append("train/skipped_steps")
    if validation:
        names += ["val/loss", *(f"val/{m.name}" for m in resolve(settings.get("metrics")))]
    return names
