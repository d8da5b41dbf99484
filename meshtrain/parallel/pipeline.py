"""Pipeline parallelism: cut a model made of blocks into stages and run them on a schedule.

A model is a run of repeated blocks (``model.layers``, or the children of an ``nn.Sequential``)
with an optional pre part (``model.embed(x)``) and post part (``model.norm``, ``model.head``).
:func:`split_model` builds one stage: a pruned deep copy whose parameter names equal the full
model's, so checkpoints and optimizer state line up with one-process training. The first stage
takes the model's input (token ids), later ones the hidden state.

:class:`PipelineRunner` drives ``torch.distributed.pipelining`` schedules: GPipe (Huang et al.
2019), 1F1B / PipeDream-Flush and interleaved 1F1B (Narayanan et al. 2021), breadth-first looping,
and zero-bubble schedules that split the backward into input (I) and weight (W) parts (Qi et al.
2023). Loss scaling: the backward runs on each micro-batch's ``loss_fn`` (a mean) divided by the
number of micro-batches, so the accumulated gradients equal one process's of the batch mean
(equal-sized micro-batches, the loss averaging over equal counts), as a one-process loop
accumulating gradients does (not torch's ``scale_grads``: a pass over all gradients per step).

Stage layout with ``v = stages_per_rank`` stages per rank on ``pp`` ranks: rank ``r`` holds
stages ``r, r + pp, r + 2pp, ...`` ("loop"); the V schedules (zbv, dualpipev) need ``v = 2`` and
give rank ``r`` the stages ``r`` and ``2pp - 1 - r``.
"""

from __future__ import annotations

import contextlib
import copy
import time
import types
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.pipelining import (
    PipelineStage, Schedule1F1B, ScheduleDualPipeV, ScheduleGPipe, ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble, ScheduleLoopedBFS, ScheduleZBVZeroBubble,
)

from meshtrain.data.batch import describe
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
    raise ConfigError(f"cannot pipeline {type(model).__name__}: it needs its blocks in "
                      f"model.layers (an nn.ModuleList) or to be an nn.Sequential")


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
    dropped = [child for name, child in stage.named_children() if name not in kept]
    kept_ids = {id(p) for child in kept.values() for p in child.parameters()}
    if any(id(p) in kept_ids for child in dropped for p in child.parameters()):
        raise ConfigError("the model ties parameters between its embedding and head (or across "
                          "stages); pipeline stages cannot share them, untie the weights")
    pre_modules = [name for name in kept if name not in ("layers", *_POST)]
    if first and pre_modules and not callable(getattr(stage, "embed", None)):
        raise ConfigError(f"{type(model).__name__} has modules {pre_modules} besides layers, "
                          f"norm and head; define model.embed(x) so the first stage knows "
                          f"how to run them")
    for name in list(stage._modules):
        if name not in kept:
            setattr(stage, name, None)
    if not first:
        for name in list(stage._parameters):
            stage.register_parameter(name, None)
    stage.layers = nn.ModuleDict({names[i]: stage.layers[i] for i in keep})
    stage._pp_first, stage._pp_last = first, last
    stage.forward = types.MethodType(_stage_forward, stage)
    return stage


def _stage_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    if self._pp_first and callable(getattr(self, "embed", None)):
        x = self.embed(x)
    for block in self.layers.values():
        x = block(x)
    if self._pp_last:
        for name in _POST:
            if getattr(self, name, None) is not None:
                x = getattr(self, name)(x)
    return x


@dataclass(frozen=True)
class TimelineEvent:
    """One compute action (F forward, L the loss, B backward, I / W its input- and weight-grad
    halves); times are seconds from a barrier taken at the start of the step."""
    rank: int
    stage: int
    microbatch: int
    kind: str
    start: float
    end: float


class PipelineRunner:
    """This rank's stages run under one schedule on the pipeline process group (or 1-D mesh)."""

    def __init__(self, stage_modules: list[nn.Module], stage_indices: list[int], num_stages: int,
                 pp_group, device: torch.device, *, schedule: str, num_microbatches: int,
                 loss_fn, p2p_group=None):
        self.group = pp_group.get_group() if hasattr(pp_group, "get_group") else pp_group
        pp, rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        if schedule not in SCHEDULES:
            raise ConfigError(f"unknown pipeline schedule {schedule!r}")
        expected = rank_stages(rank, pp, num_stages // pp, schedule)
        if len(stage_modules) != len(stage_indices) or list(stage_indices) != expected or (
                num_stages != pp * len(expected)):
            raise ConfigError(f"pp rank {rank} of {pp} under {schedule!r} with {num_stages} "
                              f"stages must hold stages {expected}, got {list(stage_indices)}")
        self.modules, self.indices, self.num_stages = list(stage_modules), expected, num_stages
        self.loss_fn = loss_fn
        self.scale_loss: Callable = lambda loss: loss  # fp16: times the grad scaler's scale
        self.num_items = None  # a global-mean loss: () -> what each micro-batch's sum is divided by
        self.eval_output = None  # the last stage's output of the last eval_loss
        self._losses: list[torch.Tensor] = []  # this step's micro-batch losses, unscaled
        self.num_microbatches = num_microbatches
        self.stage_rank = {s: r for r in range(pp) for s in rank_stages(r, pp, len(expected),
                                                                        schedule)}
        # p2p_group: the stages' sends and receives (shm_p2p.py), if not the pp group's own
        p2p = self.group if p2p_group is None else p2p_group
        self.stages = [PipelineStage(m, i, num_stages, device, group=p2p)
                       for m, i in zip(self.modules, self.indices)]
        cls = SCHEDULES[schedule]
        target = self.stages[0] if schedule in SINGLE_STAGE else self.stages
        self.schedule = cls(target, num_microbatches, loss_fn=self._train_loss,
                            scale_grads=False)
        self._record_loss: Callable | None = None  # (start, end) of each loss, when recording
        self.has_first, self.has_last = 0 in expected, num_stages - 1 in expected

    def parameters(self):
        return [p for m in self.modules for p in m.parameters()]

    def _train_loss(self, output, target) -> torch.Tensor:
        """The loss of one micro-batch, as the schedule runs backward on it: divided by the
        number of micro-batches and ``scale_loss`` applied (fp16's loss scaling); the value
        itself is kept for :meth:`step`. (The first step also calls it once on placeholder
        outputs, to infer the gradients' shapes.)"""
        start = time.perf_counter()
        loss = self.loss_fn(output, target)
        if self.num_items is not None:
            loss = loss / self.num_items()
        if not (isinstance(loss, torch.Tensor) and loss.numel() == 1):
            raise ConfigError(
                f"loss_fn returned {describe(loss)}, but meshtrain needs one number per "
                "micro-batch (a scalar tensor: the mean loss over its samples); reduce it, e.g. "
                "reduction='mean' or loss.mean()")
        self._losses.append(loss.detach())
        scaled = self.scale_loss(loss / self.num_microbatches)
        if self._record_loss is not None:
            self._record_loss(start, time.perf_counter())
        return scaled

    def step(self, inputs, targets) -> torch.Tensor | None:
        """Forward and backward over the batch, gradients added to the parameters' ``.grad``;
        returns the mean micro-batch loss on the rank with the last stage, else None."""
        self._losses = []
        args = (inputs,) if self.has_first else ()
        self.schedule.step(*args, target=targets if self.has_last else None,
                           return_outputs=False)
        losses = self._losses[-self.num_microbatches:]  # past the shape inference's call
        return torch.stack(losses).mean() if self.has_last else None

    def timed_step(self, inputs, targets) -> tuple[torch.Tensor | None, list[TimelineEvent]]:
        """:meth:`step` that also records every stage's compute actions; every pp rank gets
        the events of all of them."""
        dist.barrier(group=self.group)
        t0, rank, events = time.perf_counter(), dist.get_rank(self.group), []

        def record(stage, chunk, kind, start, end):
            events.append(TimelineEvent(rank, stage.stage_index, chunk, kind, start - t0,
                                        end - t0))

        with self._actions_recorded(record):
            loss = self.step(inputs, targets)
        gathered = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(gathered, events, group=self.group)
        return loss, sorted((e for part in gathered for e in part), key=lambda e: e.start)

    def step_compute_time(self, inputs, targets) -> tuple[torch.Tensor | None, float]:
        """:meth:`step`, and the seconds this rank spent inside its F/B/W actions (no
        barrier, nothing exchanged: the rest of the step is its bubble)."""
        total = [0.0]

        def record(stage, chunk, kind, start, end):
            total[0] += end - start

        with self._actions_recorded(record):
            loss = self.step(inputs, targets)
        return loss, total[0]

    @contextlib.contextmanager
    def _actions_recorded(self, record: Callable):
        """Inside, every stage's F, B (I: input-only backward) and W action calls
        ``record(stage, microbatch, kind, start, end)`` (perf_counter times), and so does
        each loss the last stage computes (L: the schedule runs it between F and B; it is
        compute, not idle time)."""
        def timed(stage, name, kind):
            run = getattr(stage, name)

            def wrapper(chunk, *args, **kwargs):
                start = time.perf_counter()
                out = run(chunk, *args, **kwargs)
                k = "I" if kind == "B" and not kwargs.get("full_backward", True) else kind
                record(stage, chunk, k, start, time.perf_counter())
                return out
            setattr(stage, name, wrapper)  # instance attribute shadows the method

        methods = (("forward_one_chunk", "F"), ("backward_one_chunk", "B"),
                   ("backward_weight_one_chunk", "W"))
        for stage in self.stages:
            for name, kind in methods:
                timed(stage, name, kind)
        last = [s for s in self.stages if s.stage_index == self.num_stages - 1]
        if last:
            self._record_loss = lambda start, end: record(
                last[0], len(self._losses) - 1, "L", start, end)
        try:
            yield
        finally:
            self._record_loss = None
            for stage in self.stages:
                for name, _ in methods:
                    del stage.__dict__[name]

    @torch.no_grad()
    def eval_loss(self, inputs, targets) -> torch.Tensor | None:
        """The loss of :meth:`forward_only`'s output on the rank with the last stage (its
        output kept in ``eval_output`` for validation metrics); None on the others."""
        out = self.forward_only(inputs)
        if out is None:
            return None
        self.eval_output = out
        return self.loss_fn(out, targets).detach()

    @torch.no_grad()
    def forward_only(self, inputs) -> torch.Tensor | None:
        """Forward only, stage after stage on the whole batch, in eval mode; the last stage's
        output on its rank, None on the others. (Its own sends and receives: any batch shape,
        and the schedule's buffers stay as they are.)"""
        modes = [m.training for m in self.modules]
        out, last, device = None, None, self.stages[0].device
        try:
            for index, module in zip(self.indices, self.modules):
                module.eval()
                src, here = self.stage_rank.get(index - 1), self.stage_rank[index]
                if index == 0:
                    out = inputs
                elif src != here:  # else the previous stage ran here (V layout): keep `out`
                    meta = [None, None]
                    dist.recv_object_list(meta, group=self.group, group_src=src)
                    out = torch.empty(meta[0], dtype=meta[1], device=device)
                    dist.recv(out, group=self.group, group_src=src)
                out = module(out)
                dst = self.stage_rank.get(index + 1)
                if index == self.num_stages - 1:
                    last = out
                elif dst != here:
                    out = out.contiguous()
                    dist.send_object_list([out.shape, out.dtype], group=self.group,
                                          group_dst=dst)
                    dist.send(out, group=self.group, group_dst=dst)
        finally:
            for m, mode in zip(self.modules, modes):
                m.train(mode)
        return last


def clip_grad_norm_(parameters, max_norm: float | None, pp_group) -> torch.Tensor:
    """Clip by the global L2 norm over all pipeline stages (each rank holds only its stages'
    gradients, so the squared local norms are summed over the pp group first); return that
    norm, before clipping. ``max_norm=None`` only measures."""
    group = pp_group.get_group() if hasattr(pp_group, "get_group") else pp_group
    params = [p for p in parameters if p.grad is not None]
    norm = torch.nn.utils.get_total_norm([p.grad for p in params], 2.0)
    if hasattr(norm, "full_tensor"):  # DTensor gradients (FSDP2): sum over the shards first
        norm = norm.full_tensor()
    squared = norm.float() ** 2
    dist.all_reduce(squared, group=group)
    total = squared.sqrt()
    if max_norm is not None:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return total


def ideal_bubble_fraction(pp_degree: int, num_microbatches: int, stages_per_rank: int = 1):
    """Idle share of a step with equal stage times: (p-1)/(m+p-1), or (p-1)/(v*m+p-1) with v
    stages per rank (interleaving divides the bubble by v)."""
    p, m, v = pp_degree, num_microbatches, stages_per_rank
    return (p - 1) / (v * m + p - 1)


def bubble_fraction(events: list[TimelineEvent]) -> float:
    """Measured idle time / step time for each rank (a device), averaged over the ranks; the
    step spans the first start to the last end over all ranks."""
    span = max(e.end for e in events) - min(e.start for e in events)
    ranks = sorted({e.rank for e in events})
    busy = [sum(e.end - e.start for e in events if e.rank == r) for r in ranks]
    return sum(1 - b / span for b in busy) / len(ranks)


def plot_timeline(events: list[TimelineEvent], out_png, title: str | None = None):
    """The pipeline diagram (the report's own drawing) written to ``out_png``; returns the
    Figure."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    from meshtrain.observe.report.figures import draw_actions

    fig = Figure(figsize=(10, 1 + 0.6 * len({e.rank for e in events})))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    draw_actions(ax, [(e.rank, e.stage, e.microbatch, e.kind, e.start, e.end) for e in events])
    ax.set_title(title or f"measured bubble {bubble_fraction(events):.2f}")
    fig.tight_layout()
    fig.savefig(out_png, dpi=120)
    return fig
