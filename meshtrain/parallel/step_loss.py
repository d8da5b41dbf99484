"""What one micro-batch's loss is: ``loss_fn(model(inputs), targets)``, the loss the model
returns itself, or what its ``training_step(batch, batch_idx)`` returns (a research module,
meshtrain/module/); and how a global-mean loss counts a micro-batch's items. An error at this
boundary keeps torch's message and gains a note of what meshtrain fed and expected."""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch

from meshtrain.data.batch import describe
from meshtrain.errors import ConfigError


def compute_loss(module: torch.nn.Module, batch, loss_fn: Callable | None,
                 summed: bool = False, with_output: bool = False, call_kwargs=None):
    """``loss_fn(module(inputs), targets)``, or the loss the module returns itself. ``summed``
    (a global-mean loss, meshtrain.losses): the micro-batch's sum (``loss_fn``'s, or the
    model's own with ``num_items_in_batch=1``); ``with_output``: (loss, the model's output);
    ``call_kwargs``: more keyword arguments for a model returning its own loss (its router loss
    meshtrain adds itself, meshtrain.moe). An error at this boundary keeps torch's message and
    gains a note of what meshtrain fed and expected."""
    if loss_fn is not None:
        if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
            raise ConfigError(
                "with loss_fn set, each batch must be (inputs, targets); got "
                f"{type(batch).__name__}. Return such pairs from the dataset, or drop "
                "loss_fn and let the model compute the loss")
        inputs, targets = batch
        with _noted(lambda: f"meshtrain called model(inputs) with inputs {describe(inputs)} "
                    "(the first element of each (inputs, targets) sample, batched)"):
            output = module(inputs)
        with _noted(lambda: f"meshtrain called loss_fn(output, targets) with output "
                    f"{describe(output)} and targets {describe(targets)}"):
            loss = loss_fn(output, targets)
        if not (isinstance(loss, torch.Tensor) and loss.numel() == 1):
            raise ConfigError(
                f"loss_fn returned {describe(loss)}, but meshtrain needs one number per "
                "micro-batch (a scalar tensor: the mean loss over its samples); reduce it, e.g. "
                "reduction='mean' or loss.mean()")
        return (loss, output) if with_output else loss
    extra = {**({"num_items_in_batch": 1} if summed else {}), **(call_kwargs or {})}
    with _noted(lambda: "without loss_fn meshtrain calls the model with the whole batch "
                f"{describe(batch)} (model(*batch), or model(**batch) for a dict) and expects "
                "the loss back; if the model returns predictions, pass loss_fn="):
        out = module(**{**batch, **extra}) if isinstance(batch, dict) else (
            module(*batch, **extra) if isinstance(batch, (tuple, list)) else module(batch, **extra))
    loss = out.get("loss") if isinstance(out, dict) else getattr(out, "loss", out)
    if not (isinstance(loss, torch.Tensor) and loss.numel() == 1):
        got = describe(loss) if isinstance(loss, torch.Tensor) else type(out).__name__
        raise ConfigError(
            "without loss_fn the model must return the loss (a scalar tensor, or an object "
            f"with .loss / ['loss']); it returned {got}. Pass loss_fn=")
    return (loss, out) if with_output else loss


def loss_counter(model: torch.nn.Module, loss_fn, adapt: Callable | None = None):
    """How to count a micro-batch's loss items before its forward (meshtrain.losses), or None
    for a mean loss: ``loss_fn.count(targets)`` for a GlobalMeanLoss; for a model returning its
    own loss, ``model.count_loss_items(batch)``, or what ``adapt(model)`` gives (a Hugging
    Face causal LM)."""
    from meshtrain.losses import is_global_mean

    if loss_fn is not None:
        return (lambda batch: loss_fn.count(batch[1])) if is_global_mean(loss_fn) else None
    own = getattr(model, "count_loss_items", None)
    if callable(own):
        return own
    return adapt(model) if adapt is not None else None


@contextlib.contextmanager
def _noted(note: Callable[[], str]):
    """Add ``note()`` to a TypeError/ValueError/IndexError/RuntimeError raised inside (its type
    and torch's message unchanged: fault handling still sees what happened). A function, so
    that the text is built only on an error, not every micro-batch."""
    try:
        yield
    except (TypeError, ValueError, IndexError, RuntimeError) as error:
        error.add_note(f"meshtrain: {note()}.")
        raise


class StepItems:
    """A step's item count being summed over the batch ranks (an all-reduce in flight)."""

    def __init__(self, total: torch.Tensor, work, loss_degree: int):
        self.total, self.work, self.loss_degree, self._divisor = total, work, loss_degree, None

    def divisor(self) -> torch.Tensor:
        """What each loss rank divides its sums by: the step's items over the ranks whose
        gradients are averaged, so that the average is the global sum over the items."""
        if self._divisor is None:
            if self.work is not None:
                self.work.wait()
            self._divisor = self.total.clamp(min=1).to(torch.float32) / self.loss_degree
        return self._divisor
