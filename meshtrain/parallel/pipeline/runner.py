"""Running this rank's pipeline stages under a ``torch.distributed.pipelining`` schedule.

:class:`PipelineRunner` drives the schedules: GPipe (Huang et al. 2019), 1F1B / PipeDream-Flush
and interleaved 1F1B (Narayanan et al. 2021), breadth-first looping, and zero-bubble schedules
that split the backward into input (I) and weight (W) parts (Qi et al. 2023). Loss scaling: the
backward runs on each micro-batch's ``loss_fn`` (a mean) divided by the number of micro-batches,
so the accumulated gradients equal one process's of the batch mean (equal-sized micro-batches,
the loss averaging over equal counts), as a one-process loop accumulating gradients does (not
torch's ``scale_grads``: a pass over all gradients per step).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.pipelining import PipelineStage

from meshtrain.data.batch import describe
from meshtrain.errors import ConfigError
from meshtrain.fault.inject import fault_point
from meshtrain.parallel.pipeline.runtime import lean
from meshtrain.parallel.pipeline.stages import SCHEDULES, SINGLE_STAGE, rank_stages
from meshtrain.parallel.pipeline.timeline import TimelineEvent


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
        # p2p_group: the stages' sends and receives (shm/p2p.py), if not the pp group's own
        p2p = self.group if p2p_group is None else p2p_group
        self.stages = [PipelineStage(m, i, num_stages, device, group=p2p)
                       for m, i in zip(self.modules, self.indices)]
        for stage in self.stages:  # (which micro-batch a forward is of: set_side_inputs)
            stage.forward_one_chunk = _numbered(stage.forward_one_chunk, stage.submod)
        # torch's schedule; on CPU stages its action loop made leaner (runtime.py)
        cls = lean(SCHEDULES[schedule], device)
        target = self.stages[0] if schedule in SINGLE_STAGE else self.stages
        self.schedule = cls(target, num_microbatches, loss_fn=self._train_loss,
                            scale_grads=False)
        self._record_loss: Callable | None = None  # (start, end) of each loss, when recording
        self.has_first, self.has_last = 0 in expected, num_stages - 1 in expected

    def parameters(self):
        return [p for m in self.modules for p in m.parameters()]

    def set_side_inputs(self, side: dict | None, chunks: int) -> None:
        """Tensors each stage's forward may read beside the tensor it receives (a Hugging Face
        model's ``position_ids`` of packed documents: every pp rank loads the whole batch),
        cut into ``chunks`` micro-batches as the schedule cuts the inputs: a stage's forward of
        micro-batch ``i`` finds them in ``module._pp_side[i]`` (``module._pp_chunk`` = i)."""
        parts = None
        if side:
            cut = [torch.tensor_split(value, chunks) for value in side.values()]
            parts = [dict(zip(side, values)) for values in zip(*cut)]
        for module in self.modules:
            module._pp_side, module._pp_chunk = parts, 0

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
        # (put back after: an instance's own wrapper, as _numbered's, or else the method)
        before = [{name: stage.__dict__.get(name) for name, _ in methods}
                  for stage in self.stages]
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
            for stage, own in zip(self.stages, before):
                for name, _ in methods:
                    if own[name] is None:
                        del stage.__dict__[name]
                    else:
                        stage.__dict__[name] = own[name]

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


def _numbered(forward_one_chunk, module):
    """A stage's ``forward_one_chunk`` that first tells its module which micro-batch it runs."""
    def run(fwd_chunk_id, *args, **kwargs):
        module._pp_chunk = fwd_chunk_id
        fault_point("pipeline_p2p")  # MESHTRAIN_FAULT (meshtrain/fault/inject.py)
        return forward_one_chunk(fwd_chunk_id, *args, **kwargs)
    return run


def clip_grad_norm_(parameters, max_norm: float | None, pp_group,
                    copies: frozenset[int] = frozenset()) -> torch.Tensor:
    """Clip by the global L2 norm over all pipeline stages (each rank holds only its stages'
    gradients, so the squared local norms are summed over the pp group first); return that
    norm, before clipping. ``max_norm=None`` only measures. ``copies``: ids of parameters
    another stage also holds (tied weights, pipeline/tied.py): clipped, not counted again."""
    group = pp_group.get_group() if hasattr(pp_group, "get_group") else pp_group
    params = [p for p in parameters if p.grad is not None]
    norm = torch.nn.utils.get_total_norm([p.grad for p in params if id(p) not in copies], 2.0)
    if hasattr(norm, "full_tensor"):  # DTensor gradients (FSDP2): sum over the shards first
        norm = norm.full_tensor()
    squared = norm.to(torch.promote_types(norm.dtype, torch.float32)) ** 2  # (float64 stays)
    dist.all_reduce(squared, group=group)
    total = squared.sqrt()
    if max_norm is not None:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return total
