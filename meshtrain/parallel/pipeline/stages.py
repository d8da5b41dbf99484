"""Cutting a model made of blocks into pipeline stages, and which rank holds which stage.

A model is a run of repeated blocks (``model.layers``, or the children of an ``nn.Sequential``)
with an optional pre part (``model.embed(x)``) and post part (``model.norm``, ``model.head``).
:func:`split_model` builds one stage: a pruned deep copy whose parameter names equal the full
model's, so checkpoints and optimizer state line up with one-process training. The first stage
takes the model's input (token ids), later ones the hidden state.

Stage layout with ``v = stages_per_rank`` stages per rank on ``pp`` ranks: rank ``r`` holds
stages ``r, r + pp, r + 2pp, ...`` ("loop"); the V schedules (zbv, dualpipev) need ``v = 2`` and
give rank ``r`` the stages ``r`` and ``2pp - 1 - r``.
"""

from __future__ import annotations

import copy
import types

import torch
import torch.nn as nn
from torch.distributed.pipelining import (
    Schedule1F1B, ScheduleDualPipeV, ScheduleGPipe, ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble, ScheduleLoopedBFS, ScheduleZBVZeroBubble,
)

from meshtrain.errors import ConfigError

SCHEDULES = {
    "gpipe": ScheduleGPipe,
    "1f1b": Schedule1F1B,
    "interleaved-1f1b": ScheduleInterleaved1F1B,
    "looped-bfs": ScheduleLoopedBFS,
    "zero-bubble": ScheduleInterleavedZeroBubble,
    "zbv": ScheduleZBVZeroBubble,
    "dualpipev": ScheduleDualPipeV,
}
SINGLE_STAGE = ("gpipe", "1f1b")  # one stage per rank
V_SHAPED = ("zbv", "dualpipev")  # exactly two stages per rank, V layout
_POST = ("norm", "head")


def check_pipeline(num_blocks: int, pp_degree: int, *, schedule: str, num_microbatches: int,
                   stages_per_rank: int = 1, batch_size: int) -> None:
    """Refuse a pipeline set-up that cannot run, before any process group exists.

    ``batch_size`` is the batch one pipeline sees per optimizer step (the per-dp-rank batch)."""
    if schedule not in SCHEDULES:
        raise ConfigError(f"unknown pipeline schedule {schedule!r}; choose one of "
                          f"{', '.join(SCHEDULES)}")
    for name, value in (("pp degree", pp_degree), ("num_microbatches", num_microbatches),
                        ("stages_per_rank", stages_per_rank), ("batch_size", batch_size)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"{name} must be a positive integer, got {value!r}")
    p, m, v = pp_degree, num_microbatches, stages_per_rank
    if p * v > num_blocks:
        raise ConfigError(f"pp={p} x stages_per_rank={v} = {p * v} stages but the model has only "
                          f"{num_blocks} blocks; use fewer stages")
    if batch_size % m:
        raise ConfigError(f"num_microbatches={m} does not divide the batch of {batch_size} "
                          f"samples per pipeline; pick a divisor of {batch_size}")
    if schedule in SINGLE_STAGE and v > 1:
        raise ConfigError(f"schedule {schedule!r} runs one stage per rank, got stages_per_rank="
                          f"{v}; use 'interleaved-1f1b' (or another multi-stage schedule)")
    if schedule in V_SHAPED and v != 2:
        raise ConfigError(f"schedule {schedule!r} needs stages_per_rank=2 (V layout), got {v}")
    if schedule == "1f1b" and m < p:
        raise ConfigError(f"1f1b needs num_microbatches >= pp ({m} < {p}); raise it")
    if schedule == "dualpipev" and m < 2 * p:
        raise ConfigError(f"dualpipev needs num_microbatches >= {2 * p} stages, got {m}")
    if schedule not in SINGLE_STAGE + V_SHAPED and m % p:
        raise ConfigError(f"schedule {schedule!r} needs num_microbatches to be a multiple of "
                          f"pp={p}, got {m}")


def rank_stages(pp_rank: int, pp_degree: int, stages_per_rank: int, schedule: str) -> list[int]:
    """The stage indices held by ``pp_rank`` (loop layout, or V layout for zbv/dualpipev)."""
    if schedule in V_SHAPED:
        return [pp_rank, 2 * pp_degree - 1 - pp_rank]
    return [pp_rank + k * pp_degree for k in range(stages_per_rank)]


def pipeline_blocks(model: nn.Module) -> list[nn.Module]:
    """The blocks that stages are cut from: ``model.layers``, or a Sequential's children. On a
    stage from :func:`split_model`, its own blocks (for per-block FSDP or checkpointing)."""
    if isinstance(model, nn.Sequential):
        return list(model)
    layers = getattr(model, "layers", None)
    if isinstance(layers, (nn.ModuleList, nn.Sequential, nn.ModuleDict)):
        return list(layers.values() if isinstance(layers, nn.ModuleDict) else layers)
    nested = next((name for name, m in model.named_modules() if name and isinstance(
        m, nn.ModuleList) and len(m) >= 2 and len({type(c) for c in m}) == 1), None)
    where = (f"; it has repeated modules at model.{nested}: if those are its blocks, keep them "
             "as model.layers and call them in a loop in forward (the parts before them as "
             "model.embed(x), after them as model.norm / model.head), as a pipeline stage runs "
             "them") if nested else ""
    raise ConfigError(f"cannot pipeline {type(model).__name__}: it needs its blocks in "
                      f"model.layers (an nn.ModuleList) or to be an nn.Sequential{where}")


def split_model(model: nn.Module, split_points: list[int], stage_index: int) -> nn.Module:
    """Stage ``stage_index`` of ``model`` cut before each block index in ``split_points``
    (``[2]`` splits 4 blocks into ``[0, 2)`` and ``[2, 4)``): a deep copy keeping only that
    stage's parameters, under their full-model names (``layers.2.attn.wq.weight``). Its
    forward is the conventional one (embed, its blocks, norm, head), not the model's own:
    pipeline_check.py checks before any process starts that they compose to the same."""
    n = len(pipeline_blocks(model))
    bounds = [0, *split_points, n]
    if any(not isinstance(b, int) or isinstance(b, bool) for b in split_points) or any(
            a >= b for a, b in zip(bounds, bounds[1:])):
        raise ConfigError(f"split_points {list(split_points)} must be strictly increasing block "
                          f"indices in 1..{n - 1} (the first block of stages 1, 2, ...)")
    if not 0 <= stage_index < len(bounds) - 1:
        raise ConfigError(f"stage_index {stage_index} is outside 0..{len(bounds) - 2}")
    keep = range(bounds[stage_index], bounds[stage_index + 1])
    first, last = stage_index == 0, stage_index == len(bounds) - 2
    stage = copy.deepcopy(model)
    if isinstance(stage, nn.Sequential):  # Sequential.forward runs whatever children are left
        for i, name in enumerate(list(stage._modules)):
            if i not in keep:
                del stage._modules[name]
        return stage
    names = list(stage.layers._modules)
    kept = {name: child for name, child in stage.named_children()
            if name == "layers" or (name in _POST and last) or (name not in _POST and first)}
    dropped = {name: child for name, child in stage.named_children() if name not in kept}
    kept_ids = {id(p) for child in kept.values() for p in child.parameters()}
    shared = {id(p) for child in dropped.values() for p in child.parameters()} & kept_ids
    if shared and not (first or last):
        raise ConfigError("the model ties parameters of its blocks to modules outside them; "
                          "pipeline stages cannot share them, untie the weights")
    pre_modules = [name for name in kept if name not in ("layers", *_POST)]
    if first and pre_modules and not callable(getattr(stage, "embed", None)):
        raise ConfigError(f"{type(model).__name__} has modules {pre_modules} besides layers, "
                          f"norm and head; define model.embed(x) so the first stage knows "
                          f"how to run them")
    for name in list(stage._modules):
        if name not in kept:  # (a weight tied to a kept module stays, under its own name)
            setattr(stage, name, _holding(dropped[name], shared) if name in dropped else None)
    if not first:
        for name in list(stage._parameters):
            stage.register_parameter(name, None)
    stage.layers = nn.ModuleDict({names[i]: stage.layers[i] for i in keep})
    stage._pp_first, stage._pp_last = first, last
    stage.forward = types.MethodType(_stage_forward, stage)
    return stage


def _holding(module: nn.Module, ids: set[int]) -> nn.Module | None:
    """A bare module holding only ``module``'s parameters whose ids are in ``ids``, at their
    paths (a first or last stage's copy of a tied weight keeps the name one process gives it:
    pipeline/tied.py), or None when it holds none."""
    if not any(id(p) in ids for p in module.parameters()):
        return None
    holder = nn.Module()
    for name, param in module.named_parameters(recurse=False):
        if id(param) in ids:
            holder.register_parameter(name, param)
    for name, child in module.named_children():
        held = _holding(child, ids)
        if held is not None:
            holder.add_module(name, held)
    return holder


def _stage_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    side = getattr(self, "_pp_side", None)  # the model's pipeline_side_inputs (runner.py)
    extra = side[self._pp_chunk] if side else {}
    if self._pp_first and callable(getattr(self, "embed", None)):
        x = self.embed(x, **extra)
    for block in self.layers.values():
        x = block(x, **extra)
    if self._pp_last:
        for name in _POST:
            if getattr(self, name, None) is not None:
                x = getattr(self, name)(x)
    return x
