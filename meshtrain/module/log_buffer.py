"""Values logged with ``trainer.log(name, value, reduce="mean", prog_bar=False, on_step=True,
on_epoch=False)`` / ``self.log``, reduced over the ranks that see different samples when they
are written out, under ``name`` and in ``callback_metrics`` (a callback's ``monitor``);
``prog_bar``: shown in the progress bar.

Each value joins a window (the steps since the last logging interval, or one evaluation) and,
with ``on_epoch``, the epoch: "mean" averages every value logged in it on every rank (each
micro-batch's mean loss or accuracy gives the global batch's when micro-batches are equal),
"sum" adds them, "max" takes the largest. In validation and test the window is the whole
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

REDUCTIONS = ("mean", "sum", "max")


class LogBuffer:
    def __init__(self):
        self.window: dict[str, list] = {}  # name -> [total, count, reduce]
        self.epoch: dict[str, list] = {}
        self.prog_bar: set[str] = set()
        self.both: set[str] = set()  # logged per step and per epoch: the epoch's is name_epoch

    def add(self, name: str, value, *, reduce: str, prog_bar: bool, on_step: bool,
            on_epoch: bool) -> None:
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
        for target in targets:
            total, count, kind = target.get(name, [0.0 if reduce != "max" else -float("inf"),
                                                   0, reduce])
            if kind != reduce:
                raise ConfigError(f"log({name!r}) was called with reduce={kind!r} and then "
                                  f"reduce={reduce!r}; use one reduction per name")
            total = max(total, value) if reduce == "max" else total + value
            target[name] = [total, count + 1, reduce]
        if prog_bar:
            self.prog_bar.add(name)
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
        mine = sorted(values)
        names = mine
        if group is not None:
            gathered = [None] * dist.get_world_size(group)
            dist.all_gather_object(gathered, {n: values[n][2] for n in mine}, group=group)
            kinds = {k: v for part in gathered for k, v in part.items()}
            names = sorted(kinds)
        else:
            kinds = {n: values[n][2] for n in mine}
        if not names:
            return {}
        sums = torch.zeros(2 * len(names), dtype=torch.float64, device=device)
        maxima = torch.full((len(names),), -float("inf"), dtype=torch.float64, device=device)
        for i, name in enumerate(names):
            if name in values:
                total, count, kind = values[name]
                if kind == "max":
                    maxima[i] = total
                else:
                    sums[2 * i], sums[2 * i + 1] = total, count
        if group is not None:
            dist.all_reduce(sums, group=group)
            dist.all_reduce(maxima, op=dist.ReduceOp.MAX, group=group)
        values.clear()
        out = {}
        for i, name in enumerate(names):
            kind = kinds[name]
            suffix = "_epoch" if which == "epoch" and name in self.both else ""
            if kind == "max":
                out[name + suffix] = float(maxima[i])
            elif kind == "sum":
                out[name + suffix] = float(sums[2 * i])
            else:
                out[name + suffix] = float(sums[2 * i] / sums[2 * i + 1].clamp(min=1))
        return out
