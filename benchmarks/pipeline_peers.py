"""The peer of pipeline.py: ``torch.distributed.pipelining`` driven directly, as its users write it.

``RawSchedule`` builds one ``PipelineStage`` per stage module this rank holds and the schedule
class (``Schedule1F1B`` or ``ScheduleInterleaved1F1B``) with the loss function, and its step is
``schedule.step(inputs, target=targets)`` on the ranks holding the first and last stages, the
gradients scaled by the schedule (its default). The stage modules are the ones meshtrain's
``split_model`` cuts, so both rows run the same model and data; what differs is meshtrain's own
work around the schedule (``PipelineRunner.step``: the loss wrapper that keeps each micro-batch's
loss and scales it by the number of micro-batches, where the raw schedule divides the gradients
after the last backward instead). ``timed_step`` is ``PipelineRunner``'s, so the bubble is
measured the same way (the loss timed as compute, like meshtrain's: a wrapper that reads one
attribute when nothing records).
"""

from __future__ import annotations

import time

import torch
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleInterleaved1F1B

from meshtrain.parallel.pipeline import PipelineRunner

RAW_SCHEDULES = {"1f1b": Schedule1F1B, "interleaved-1f1b": ScheduleInterleaved1F1B}


class RawSchedule:
    timed_step = PipelineRunner.timed_step  # records F and B actions the same way
    step_compute_time = PipelineRunner.step_compute_time
    _actions_recorded = PipelineRunner._actions_recorded

    def __init__(self, modules, indices, num_stages: int, group, *, schedule: str,
                 num_microbatches: int, loss_fn):
        self.group, self.modules = group, list(modules)
        self.stages = [PipelineStage(module, index, num_stages, torch.device("cpu"), group=group)
                       for module, index in zip(modules, indices)]
        target = self.stages[0] if schedule == "1f1b" else self.stages
        self.loss_fn, self.num_stages = loss_fn, num_stages
        self._losses, self._record_loss = [], None  # what _actions_recorded reads and sets
        self.schedule = RAW_SCHEDULES[schedule](target, num_microbatches, loss_fn=self._loss)
        self.has_first, self.has_last = 0 in indices, num_stages - 1 in indices

    def _loss(self, output, target):
        start = time.perf_counter()
        loss = self.loss_fn(output, target)
        if self._record_loss is not None:
            self._losses.append(None)  # the micro-batch's number, for the timeline
            self._record_loss(start, time.perf_counter())
        return loss

    def parameters(self):
        return [p for module in self.modules for p in module.parameters()]

    def step(self, inputs, targets):
        self._losses = []
        args = (inputs,) if self.has_first else ()
        self.schedule.step(*args, target=targets if self.has_last else None)
