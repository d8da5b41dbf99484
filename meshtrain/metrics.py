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

__all__ = ["Metric", "Perplexity", "TokenAccuracy", "TorchMetric", "fit_metric_names"]


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


class TorchMetric(Metric):
    """A ``torchmetrics`` metric (``Accuracy``, ``MeanSquaredError``, ...) as a meshtrain
    metric: each batch updates it from fresh on ``(output, targets)`` of an ``(inputs,
    targets)`` batch, and its states, all sums (``dist_reduce_fx="sum"``), are added into
    meshtrain's sums, reduced over every rank with the loss; ``compute`` puts the totals back
    into its states and calls its own ``compute`` (no sync of its own: the sums are already
    the whole evaluation's). A metric with a state that is not a sum (a list of predictions,
    a max) is refused, naming it (a module's ``self.log(name, metric)`` takes any). Logged
    under ``name`` (default: the class name in lower case, e.g. ``val/multiclassaccuracy``)."""

    def __init__(self, metric, name: str | None = None):
        states = getattr(metric, "_defaults", {})
        reductions = getattr(metric, "_reductions", {})
        odd = [k for k in states if not isinstance(states[k], torch.Tensor)
               or getattr(reductions.get(k), "__name__", reductions.get(k))
               not in ("sum", "dim_zero_sum")]
        if odd:
            raise ConfigError(
                f"the torchmetrics metric {type(metric).__name__} keeps states {odd} that are "
                "not sums (lists, maxima, means), which metrics= does not reduce; log it from "
                "a module's validation_step instead (self.metric.update(preds, target); "
                "self.log(name, self.metric): gathered over the ranks as the metric declares) "
                "or write a meshtrain.metrics.Metric for it")
        self.metric, self.name = metric, name or type(metric).__name__.lower()
        self.shapes = {k: v.shape for k, v in states.items()}
        self.num_sums = sum(v.numel() for v in states.values())

    def update(self, sums: torch.Tensor, output, batch) -> None:
        if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
            raise ConfigError(f"the torchmetrics metric {self.name} is updated with (output, "
                              f"targets) and needs (inputs, targets) batches; got "
                              f"{type(batch).__name__}")
        self.metric.reset()
        self.metric.to(sums.device)
        self.metric.update(plain(getattr(output, "logits", output)).detach(), batch[1])
        sums += torch.cat([getattr(self.metric, k).detach().double().flatten()
                           for k in self.shapes])

    def compute(self, sums: torch.Tensor, loss: float) -> float:
        self.metric.reset()
        for key, part in zip(self.shapes, sums.split([s.numel() for s in self.shapes.values()])):
            state = getattr(self.metric, key)
            setattr(self.metric, key, part.reshape(self.shapes[key]).to(state.dtype))
        self.metric._update_count = 1
        self.metric._computed = None
        # no sync of its own: its compute would all-gather the states over the whole world
        # again (sync_context(should_sync=False) does not stop that; a SumMetric came out
        # twice its value under dp=2), summing what ranks of one batch shard hold twice
        to_sync, self.metric._to_sync = self.metric._to_sync, False
        try:
            return float(self.metric.compute())
        finally:
            self.metric._to_sync = to_sync


def is_torchmetric(item) -> bool:
    """Is ``item`` a torchmetrics metric (told by its classes' modules: no import)?"""
    return type(item).__module__.startswith("torchmetrics") or any(
        c.__module__.startswith("torchmetrics") for c in type(item).__mro__)


BUILTIN = {"perplexity": Perplexity, "token_accuracy": TokenAccuracy}


def resolve(metrics) -> list[Metric]:
    """Metric objects from names (``BUILTIN``) and objects; ConfigError names a bad item."""
    if isinstance(metrics, (str, Metric)):
        metrics = [metrics]
    out = []
    for item in metrics or ():
        if isinstance(item, str) and item in BUILTIN:
            item = BUILTIN[item]()
        elif not isinstance(item, Metric) and is_torchmetric(item):
            item = TorchMetric(item)
        if not isinstance(item, Metric):
            raise ConfigError(f"unknown metric {item!r} in metrics; use {', '.join(BUILTIN)}, "
                              "meshtrain.metrics.Metric or torchmetrics objects")
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
