"""Values logged with ``trainer.log(name, value, reduce="mean", prog_bar=False, on_step=True,
on_epoch=False)`` / ``self.log``, reduced over the ranks that see different samples when they
are written out, under ``name`` and in ``callback_metrics`` (a callback's ``monitor``);
``prog_bar``: shown in the progress bar.

Each value joins a window (the steps since the last logging interval, or one evaluation) and,
with ``on_epoch``, the epoch: "mean" averages every value logged in it on every rank (each
micro-batch's mean loss or accuracy gives the global batch's when micro-batches are equal;
weighted by ``weight``: Lightning's ``batch_size``), "sum" adds them, "max" / "min" take the
largest / smallest. In validation and test the window is the whole
evaluation; at an epoch's end the epoch's values go out as ``name`` (``name_epoch`` when also
logged per step).
The names are gathered from every rank first, so a rank that logged nothing still takes part
in the same collectives. Under pp a module's steps run on the last stage only: its values reach
the other stages (rank 0 writes them) through ``stages``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from meshtrain.errors import ConfigError
from meshtrain.metrics import is_torchmetric

REDUCTIONS = ("mean", "sum", "max", "min")


class LogBuffer:
    def __init__(self):
        self.window: dict[str, list] = {}  # name -> [total, count, reduce]
        self.epoch: dict[str, list] = {}
        self.prog_bar: set[str] = set()
        self.both: set[str] = set()  # logged per step and per epoch: the epoch's is name_epoch
        self.unlogged: set[str] = set()  # logger=False: callback_metrics and progress bar only
        self.at_epoch_end = False  # a module's on_train_epoch_end: on_epoch by default
        self.evaluation = False  # an evaluation's buffer: its window is the whole evaluation
        # torchmetrics objects logged as themselves: computed from their states summed over
        # the ranks when the window (in evaluation) or the epoch goes out, then reset
        self.metrics: dict[str, dict] = {"window": {}, "epoch": {}}

    def for_loggers(self, metrics: dict) -> dict:
        """``metrics`` less the values logged with ``logger=False``."""
        return {k: v for k, v in metrics.items()
                if k not in self.unlogged and k.removesuffix("_epoch") not in self.unlogged}

    def whole(self) -> None:
        """An evaluation's values: its window and its "epoch" are the same span (the whole
        evaluation), so what was logged ``on_epoch`` only joins the window."""
        for name, entry in self.epoch.items():
            self.window.setdefault(name, entry)
        self.epoch.clear()
        self.both.clear()

    def log(self, name: str, value, *, reduce: str = "mean", prog_bar: bool = False,
            on_step: bool | None = None, on_epoch: bool | None = None, logger: bool = True,
            reduce_fx=None, batch_size: int | None = None, sync_dist: bool = True,
            sync_dist_group=None, rank_zero_only: bool = False, enable_graph: bool = False,
            add_dataloader_idx: bool = True, metric_attribute=None) -> None:
        """``trainer.log`` / ``self.log``: meshtrain's options and Lightning's. ``reduce_fx``
        (Lightning's name for ``reduce``: "mean", "sum", "max", "min" or torch.mean, ...);
        ``batch_size``: the value's weight in a mean; ``logger=False``: not written to the
        loggers. Values are always reduced over the ranks, so ``sync_dist`` changes nothing
        (nor do ``sync_dist_group``, ``rank_zero_only``, ``enable_graph``,
        ``add_dataloader_idx``, ``metric_attribute``)."""
        if reduce_fx is not None:
            reduce = _reduction(name, reduce_fx)
        if batch_size is not None and not (isinstance(batch_size, int) and batch_size > 0):
            raise ConfigError(f"log({name!r}): batch_size must be a positive integer, got "
                              f"{batch_size!r}")
        on_step = not self.at_epoch_end if on_step is None else on_step
        on_epoch = self.at_epoch_end if on_epoch is None else on_epoch
        if is_torchmetric(value):  # Lightning's self.log("acc", self.accuracy)
            value = self._metric(name, value, on_step, on_epoch)
            if value is None:
                self.prog_bar.update([name] if prog_bar else [])
                self.unlogged.update([] if logger else [name])
                return
            if on_epoch:  # (the epoch's value is the metric's own: name_epoch)
                self.both.add(name)
            on_epoch = False
        self.add(name, value, reduce=reduce, prog_bar=prog_bar, on_step=on_step,
                 on_epoch=on_epoch, weight=batch_size or 1, logger=logger)

    def _metric(self, name: str, metric, on_step: bool, on_epoch: bool):
        """Keep a torchmetrics object for the evaluation or the epoch (its states gathered over
        the ranks then); in a training step with ``on_step``, its value on this batch (the
        last call's, as Lightning logs it) is returned to log as a number."""
        if not hasattr(metric, "_reductions"):  # a MetricCollection: Lightning refuses it too
            raise ConfigError(f"log({name!r}, {type(metric).__name__}): a collection of "
                              "metrics is logged with self.log_dict(collection)")
        if self.evaluation or on_epoch:
            self.metrics["window" if self.evaluation else "epoch"][name] = metric
        if self.evaluation or not on_step:
            return None
        if getattr(metric, "_forward_cache", None) is None:
            raise ConfigError(f"log({name!r}, {type(metric).__name__}): per step, a metric's "
                              "value is that of its last call: call it on the batch "
                              "(metric(preds, target)), not only update()")
        return metric._forward_cache

    def add(self, name: str, value, *, reduce: str, prog_bar: bool, on_step: bool,
            on_epoch: bool, weight: float = 1.0, logger: bool = True) -> None:
        if not isinstance(name, str) or not name:
            raise ConfigError(f"log: the name must be a non-empty string, got {name!r}")
        if reduce not in REDUCTIONS:
            raise ConfigError(f"log({name!r}): reduce={reduce!r}; choose one of "
                              + ", ".join(REDUCTIONS))
        try:
            value = float(value.detach().reshape(()) if isinstance(value, torch.Tensor) else value)
        except (TypeError, ValueError, RuntimeError):
            raise ConfigError(f"log({name!r}): the value must be a number or a one-element "
                              f"tensor, got {type(value).__name__}") from None
        targets = ([self.window] if on_step else []) + ([self.epoch] if on_epoch else [])
        start = {"max": -float("inf"), "min": float("inf")}.get(reduce, 0.0)
        for target in targets:
            total, count, kind = target.get(name, [start, 0, reduce])
            if kind != reduce:
                raise ConfigError(f"log({name!r}) was called with reduce={kind!r} and then "
                                  f"reduce={reduce!r}; use one reduction per name")
            total = max(total, value) if reduce == "max" else min(total, value) \
                if reduce == "min" else total + value * (weight if reduce == "mean" else 1)
            target[name] = [total, count + (weight if reduce == "mean" else 1), reduce]
        if prog_bar:
            self.prog_bar.add(name)
        if not logger:
            self.unlogged.add(name)
        if on_step and on_epoch:
            self.both.add(name)

    def take(self, which: str, group, device, stages=None) -> dict[str, float]:
        """The window's (or epoch's) values reduced over ``group`` (None: this process alone);
        empties it. Collective over ``group``, and over ``stages`` (the pipeline's group), where
        each name takes the value of the last stage that logged it (a module's steps run on the
        last stage; a callback's values are the same on every stage)."""
        out = self._reduce(which, group, device)
        if stages is None:
            return out
        gathered = [None] * dist.get_world_size(stages)
        dist.all_gather_object(gathered, (out, sorted(self.prog_bar)), group=stages)
        merged = {}
        for values, prog_bar in gathered:  # in stage order: the last one's win
            merged.update(values)
            self.prog_bar.update(prog_bar)
        return merged

    def _reduce(self, which: str, group, device) -> dict[str, float]:
        values = self.window if which == "window" else self.epoch
        metrics = self.metrics[which]
        mine = sorted(values)
        names = mine
        kinds = {n: values[n][2] for n in mine}
        if group is not None:
            gathered = [None] * dist.get_world_size(group)
            dist.all_gather_object(gathered, (kinds, sorted(metrics)), group=group)
            kinds = {k: v for part, _ in gathered for k, v in part.items()}
            names = sorted(kinds)
            metric_names = sorted({n for _, part in gathered for n in part})
        else:
            metric_names = sorted(metrics)
        out = {name + ("_epoch" if which == "epoch" and name in self.both else ""): value
               for name, value in _computed(metrics, metric_names, group, device).items()}
        if not names:
            return out
        sums = torch.zeros(2 * len(names), dtype=torch.float64, device=device)
        maxima = torch.full((len(names),), -float("inf"), dtype=torch.float64, device=device)
        for i, name in enumerate(names):
            if name in values:
                total, count, kind = values[name]
                if kind in ("max", "min"):  # min: the largest of the negated values
                    maxima[i] = total if kind == "max" else -total
                else:
                    sums[2 * i], sums[2 * i + 1] = total, count
        if group is not None:
            dist.all_reduce(sums, group=group)
            dist.all_reduce(maxima, op=dist.ReduceOp.MAX, group=group)
        values.clear()
        for i, name in enumerate(names):
            kind = kinds[name]
            suffix = "_epoch" if which == "epoch" and name in self.both else ""
            if kind in ("max", "min"):
                out[name + suffix] = float(maxima[i]) * (1 if kind == "max" else -1)
            elif kind == "sum":
                out[name + suffix] = float(sums[2 * i])
            else:
                out[name + suffix] = float(sums[2 * i] / sums[2 * i + 1].clamp(min=1))
        return out


def _computed(metrics: dict, names: list[str], group, device) -> dict[str, float]:
    """Each logged torchmetrics object's value over every rank's updates, then reset; ``names``:
    the same on every rank. Its states are gathered over ``group`` (the ranks that see
    different batches) and reduced as the metric declares (sums, maxima, the predictions an
    AUROC keeps: torchmetrics' own sync, given the group: its default, the whole world, would
    count the ranks of one batch shard, tp's or cp's, more than once)."""
    out = {}
    for name in names:
        if name not in metrics:
            raise ConfigError(f"log({name!r}, <metric>) was called on some ranks only; log it "
                              "on every rank")
        metric = metrics.pop(name)
        if group is not None:
            metric.to(device)  # where the group's backend reads it (NCCL: the GPU)
            metric._update_count = max(1, metric._update_count)  # (a rank that saw no batch)
        own = metric.process_group, metric._to_sync
        metric.process_group, metric._to_sync = group, group is not None
        try:  # (its compute gathers, computes, then gives the metric its own states back)
            value = metric.compute()
        finally:
            metric.process_group, metric._to_sync = own
        try:
            out[name] = float(value)
        except (TypeError, ValueError, RuntimeError):
            raise ConfigError(f"log({name!r}, {type(metric).__name__}): its compute() gives "
                              f"{type(value).__name__} of shape "
                              f"{tuple(getattr(value, 'shape', ()))}, not one number; log a "
                              "metric that computes a scalar (e.g. average=\"macro\")") from None
        metric.reset()
    return out


def _reduction(name: str, fx) -> str:
    """Lightning's ``reduce_fx`` (a name or torch's function) as meshtrain's ``reduce``."""
    names = {"mean": "mean", "avg": "mean", "sum": "sum", "max": "max", "min": "min",
             torch.mean: "mean", torch.sum: "sum", torch.max: "max", torch.min: "min"}
    try:
        return names[fx.lower() if isinstance(fx, str) else fx]
    except (KeyError, TypeError):
        raise ConfigError(f"log({name!r}): reduce_fx={fx!r}; choose 'mean', 'sum', 'max' or "
                          "'min' (or torch.mean, torch.sum, torch.max, torch.min)") from None
