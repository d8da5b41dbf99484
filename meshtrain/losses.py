"""Losses averaged over the whole global batch, whatever the layout.

A plain ``loss_fn`` returns the mean over its micro-batch, and meshtrain averages those means
(over gradient-accumulation micro-batches, data-parallel ranks, pipeline micro-batches and
context-parallel shards). That is the mean over the global batch only when every micro-batch
averages over the same number of items. A language-model loss that ignores padding
(``ignore_index=-100``) does not: a micro-batch with few real tokens would weigh as much as one
with many, and the model trained would depend on how the batch is cut (the bug ``transformers``
fixed with ``num_items_in_batch``).

A :class:`GlobalMeanLoss` says how many items it averages over: ``count(targets)`` before the
forward, and ``loss(output, targets)`` returns the *sum* over those items. meshtrain counts the
items of every micro-batch of the step on every rank that shares it, adds them up (one
all-reduce of a number), and divides each micro-batch's sum by that total, so the gradient is
the one of one process on the whole global batch::

    trainer.fit(model, data, loss_fn=meshtrain.losses.cross_entropy(ignore_index=-100))

A model that returns its own loss opts in by accepting ``num_items_in_batch`` (as Hugging Face
models do: the loss is then its sum divided by that number) and saying how to count:
``model.count_loss_items(batch)``. meshtrain adapts Hugging Face causal LMs itself.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

__all__ = ["CrossEntropy", "GlobalMeanLoss", "cross_entropy"]


class GlobalMeanLoss:
    """A loss averaged over the items of the global batch: ``sum_fn(output, targets)`` is the
    sum over the items of a micro-batch, ``count_fn(targets)`` how many there are.

    Both must be picklable when workers are started by ``run_workers`` (module-level
    functions, not lambdas)."""

    def __init__(self, sum_fn: Callable, count_fn: Callable):
        self.sum_fn, self.count_fn = sum_fn, count_fn

    def __call__(self, output, targets) -> torch.Tensor:
        return self.sum_fn(output, targets)

    def count(self, targets) -> torch.Tensor:
        """How many items ``targets`` holds (an integer tensor, or an int)."""
        return torch.as_tensor(self.count_fn(targets))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.sum_fn!r}, {self.count_fn!r})"


class CrossEntropy(GlobalMeanLoss):
    """Cross-entropy averaged over the targets that are not ``ignore_index``, across the
    whole global batch. ``logits``: ``(..., classes)``; ``targets``: the matching ``(...)``."""

    def __init__(self, ignore_index: int = -100, label_smoothing: float = 0.0):
        self.ignore_index, self.label_smoothing = ignore_index, label_smoothing

    def __call__(self, logits, targets) -> torch.Tensor:
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                               ignore_index=self.ignore_index, reduction="sum",
                               label_smoothing=self.label_smoothing)

    def count(self, targets) -> torch.Tensor:
        return (targets != self.ignore_index).sum()

    def __repr__(self) -> str:
        return (f"CrossEntropy(ignore_index={self.ignore_index}, "
                f"label_smoothing={self.label_smoothing})")


def cross_entropy(ignore_index: int = -100, label_smoothing: float = 0.0) -> CrossEntropy:
    """Token-mean cross-entropy over the global batch (the language-model loss)."""
    return CrossEntropy(ignore_index, label_smoothing)


def is_global_mean(loss_fn) -> bool:
    return isinstance(loss_fn, GlobalMeanLoss)


def plain_mean_warning(loss_fn, targets, num_pieces: int) -> str | None:
    """A warning when a plain mean ``loss_fn`` sees ignored targets (-100) in a step cut into
    ``num_pieces`` micro-batches (over ranks and accumulation): its result then depends on how
    the batch is cut. None when nothing is wrong."""
    if num_pieces <= 1 or loss_fn is None or is_global_mean(loss_fn):
        return None
    if not (isinstance(targets, torch.Tensor) and not targets.is_floating_point()
            and bool((targets == -100).any())):
        return None
    return (f"loss_fn averages over each micro-batch, and the targets hold -100 (ignored "
            f"tokens): the step's {num_pieces} micro-batches then weigh their tokens "
            "differently, and the model trained depends on the layout; use "
            "loss_fn=meshtrain.losses.cross_entropy(ignore_index=-100), a mean over the "
            "tokens of the whole global batch (docs/batch_coupled.md)")
