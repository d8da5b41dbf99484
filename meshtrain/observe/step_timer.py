"""Where one rank's step time goes: a clock that is always running in exactly one part of the
step (:data:`~meshtrain.observe.run_files.PARTS`), so the parts add up to the step.

The loop marks the parts it knows (``with timer.part("optimizer"): ...``); a part inside
another pauses the outer one (the loader's wait inside forward_backward is data, not compute);
what no part claims is "other". Two parts are found after the fact and moved: the engine's
exposed communication (the end of backward, from when the last gradient was computed to when
DDP/FSDP finished reducing; :meth:`backward_compute_done` marks the first) and a pipeline's
bubble (its step minus this rank's F/B actions).

Only every ``every``-th step is measured. On a CPU the clock is the host's, and timing every
step costs a few clock reads. On a GPU (:class:`DeviceStepTimer`) nothing waits for the device:
each boundary records a CUDA event on the current stream, and at the end of a logging interval the
calls are replayed on a :class:`StepTimer` whose clock reads the events' times. The parts are then
the device's timeline: a host-side wait (for data, say) counts only where the device ran dry.
"""

from __future__ import annotations

import contextlib
import time

import torch

from meshtrain.observe.run_files import PARTS


def make_step_timer(every: int | None, device: torch.device | str = "cpu"):
    """The step timer for ``device``: events on a CUDA device, the host clock elsewhere."""
    if torch.device(device).type == "cuda":
        return DeviceStepTimer(every)
    return StepTimer(every)


class _Parts:
    """The context managers both timers share, over their enter/leave and pause/unpause."""

    active = False
    peek = None  # called with each batch the loader gives (the monitor's FLOPs count: once)

    @contextlib.contextmanager
    def part(self, name: str):
        """The time inside belongs to ``name`` (minus the parts nested in it)."""
        if not self.active:
            yield
            return
        self.enter(name)
        try:
            yield
        finally:
            self.leave()

    @contextlib.contextmanager
    def paused(self):
        """Time inside belongs to no step (validation between two steps)."""
        self.pause()
        try:
            yield
        finally:
            self.unpause()


class StepTimer(_Parts):
    def __init__(self, every: int | None, clock=time.perf_counter):
        self.every = every
        self._clock = clock
        self.active = False  # this step is measured
        self._parts = dict.fromkeys(PARTS, 0.0)
        self._stack: list[str] = []
        self._last = self._start = 0.0
        self._mark: float | None = None
        self._step, self._ended, self._ended_at = 0, (0, False), 0.0
        self.window = dict.fromkeys(("step", *PARTS), 0.0)  # sums over the measured steps
        self.window_steps = 0
        # the loop's own clock over the window: every step, measured or not, and what lies
        # between steps, less validation (what the parts are checked against)
        self._wall_start: float | None = None  # the first step's start
        self._wall_paused, self._wall_steps = 0.0, 0

    def _now(self) -> float:
        return self._clock()

    def _switch(self) -> float:
        now = self._now()
        self._parts[self._stack[-1]] += now - self._last
        self._last = now
        return now

    def begin(self, step: int) -> None:
        """Optimizer step ``step`` (1-based) starts; measured when ``every`` divides it. When
        the step before was measured too, the time since its end (logging, the breakdown's
        gather, an epoch's new loader) counts as this step's "other"."""
        self._step = step
        self.active = bool(self.every) and step % self.every == 0
        if self._wall_start is None:
            self._wall_start = self._now()
        self._wall_steps += 1
        if self.active:
            self._parts = dict.fromkeys(PARTS, 0.0)
            self._stack, self._mark = ["other"], None
            self._start = self._last = self._now()
            if self._ended == (step - 1, True):  # what ran since the last step is "other"
                self._parts["other"] = self._start - self._ended_at
                self._start = self._ended_at

    def end(self) -> None:
        """The step ended: its parts join the window."""
        if not self.active:
            return
        now = self._switch()
        self._ended, self._ended_at = (self._step, True), now
        self.active = False
        self.window["step"] += now - self._start
        for name, seconds in self._parts.items():
            self.window[name] += seconds
        self.window_steps += 1

    def enter(self, name: str) -> None:
        if self.active:
            assert name in PARTS, name
            self._switch()
            self._stack.append(name)

    def leave(self) -> None:
        if self.active:
            self._switch()
            self._stack.pop()

    def pause(self) -> None:
        self._paused_at = self._now()
        if self.active:
            self._switch()

    def unpause(self) -> None:
        now = self._now()
        if self.active:
            self._start += now - self._last
            self._last = now
        self._wall_paused += now - self._paused_at

    def move(self, seconds: float, source: str, target: str) -> None:
        """Reassign ``seconds`` already counted in ``source`` to ``target`` (at most what
        ``source`` holds): a part found after the fact."""
        if not self.active:
            return
        self._switch()  # the running part's time so far is counted first
        seconds = min(max(seconds, 0.0), self._parts[source])
        self._parts[source] -= seconds
        self._parts[target] += seconds

    # -- exposed communication at the end of backward ------------------------------------------
    def watch_backward(self, loss: torch.Tensor) -> None:
        """Mark when ``loss``'s backward has computed its last gradient: a callback queued at
        the start of backward runs before the ones DDP and FSDP queue later to wait for their
        reductions."""
        if not self.active or not loss.requires_grad:
            return
        from torch.autograd import Variable

        def queue(grad):
            Variable._execution_engine.queue_callback(self.backward_compute_done)
            return grad

        loss.register_hook(queue)

    def backward_compute_done(self) -> None:
        self._mark = self._now()

    def backward_returned(self) -> None:
        """After ``backward()``: the time since the last gradient was computed was spent
        waiting for gradient reductions (exposed communication)."""
        if self.active and self._mark is not None:
            self.move(self._now() - self._mark, "compute", "comm")
            self._mark = None

    # -- the window ---------------------------------------------------------------------------
    def take_window(self) -> list[float] | None:
        """Mean seconds per measured step since the last call: [wall, step, *PARTS], where
        wall is the loop's clock per step (every step, and what lies between them); None when
        no step was measured. Resets the window."""
        now = self._now()
        start = now if self._wall_start is None else self._wall_start
        wall = (now - start - self._wall_paused) / max(self._wall_steps, 1)
        self._wall_start, self._wall_paused, self._wall_steps = now, 0.0, 0
        if not self.window_steps:
            return None
        n = self.window_steps
        values = [wall, self.window["step"] / n, *(self.window[p] / n for p in PARTS)]
        self.window = dict.fromkeys(self.window, 0.0)
        self.window_steps = 0
        return values


class DeviceStepTimer(_Parts):
    """:class:`StepTimer` on a CUDA device without a host sync: every call that reads the clock
    records an event on the current stream instead, and :meth:`take_window` (at a logging
    interval) waits for the last one and replays the calls on a host :class:`StepTimer` whose
    clock gives each event's time. One event per boundary, no sync per step."""

    def __init__(self, every: int | None, event=None):
        self.every = every
        self._event = event or (lambda: torch.cuda.Event(enable_timing=True))
        self.active = False
        self._time = 0.0  # the replay's clock: the time of the call being replayed
        self._replay = StepTimer(every, clock=lambda: self._time)
        self._calls: list[tuple[str, tuple, torch.cuda.Event]] = []
        self._origin: tuple[torch.cuda.Event, float] | None = None  # (event, its time)
        self._mark_pending = False

    def _record(self, method: str, *args) -> None:
        event = self._event()
        event.record()
        self._calls.append((method, args, event))

    def begin(self, step: int) -> None:
        if not self.every:
            return
        self.active = step % self.every == 0
        self._record("begin", step)

    def end(self) -> None:
        if self.active:
            self._record("end")
            self.active = False

    def enter(self, name: str) -> None:
        if self.active:
            assert name in PARTS, name
            self._record("enter", name)

    def leave(self) -> None:
        if self.active:
            self._record("leave")

    def pause(self) -> None:
        if self.every:
            self._record("pause")

    def unpause(self) -> None:
        if self.every:
            self._record("unpause")

    def move(self, seconds: float, source: str, target: str) -> None:
        """(Host seconds: a pipeline's bubble, measured by the schedule.)"""
        if self.active:
            self._record("move", seconds, source, target)

    def watch_backward(self, loss: torch.Tensor) -> None:
        StepTimer.watch_backward(self, loss)

    def backward_compute_done(self) -> None:
        """The event follows the last gradient's kernels on the stream backward runs on."""
        if self.active:
            self._record("backward_compute_done")
            self._mark_pending = True

    def backward_returned(self) -> None:
        if self.active and self._mark_pending:
            self._record("backward_returned")
            self._mark_pending = False

    def take_window(self) -> list[float] | None:
        """As :meth:`StepTimer.take_window`, on the device's clock (waits for the last event
        recorded, once per logging interval)."""
        if self._calls:
            last = self._calls[-1][2]
            last.synchronize()
            origin, at = self._origin or (self._calls[0][2], 0.0)
            for method, args, event in self._calls:
                # elapsed_time is float milliseconds: measured from the last window's end
                self._time = at + origin.elapsed_time(event) / 1000
                getattr(self._replay, method)(*args)
            self._origin, self._calls = (last, self._time), []
        return self._replay.take_window()


class TimedBatches:
    """An iterator of batches whose waits are the timer's "data" part."""

    def __init__(self, batches, timer: StepTimer):
        self.batches, self.timer = batches, timer

    def __iter__(self):
        return self

    def __next__(self):
        with self.timer.part("data"):
            batch = next(self.batches)
        if self.timer.peek is not None:
            self.timer.peek(batch)
        return batch
