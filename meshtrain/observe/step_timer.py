"""Where one rank's step time goes: a clock that is always running in exactly one part of the
step (:data:`~meshtrain.observe.run_files.PARTS`), so the parts add up to the step.

The loop marks the parts it knows (``with timer.part("optimizer"): ...``); a part inside
another pauses the outer one (the loader's wait inside forward_backward is data, not compute);
what no part claims is "other". Two parts are found after the fact and moved: the engine's
exposed communication (the end of backward, from when the last gradient was computed to when
DDP/FSDP finished reducing; :meth:`backward_compute_done` marks the first) and a pipeline's
bubble (its step minus this rank's F/B actions).

Only every ``every``-th step is measured. On a GPU a measured step waits for the device at each
part boundary (the host clock then sees the device's work); on a CPU nothing waits, so timing
every step costs a few clock reads.
"""

from __future__ import annotations

import contextlib
import time

import torch

from meshtrain.observe.run_files import PARTS


class StepTimer:
    def __init__(self, every: int | None, device: torch.device | str = "cpu"):
        self.every = every
        self.cuda = torch.device(device).type == "cuda"
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
        self._wall_start, self._wall_paused, self._wall_steps = time.perf_counter(), 0.0, 0

    def _now(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter()

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

    @contextlib.contextmanager
    def part(self, name: str):
        """The time inside belongs to ``name`` (minus the parts nested in it)."""
        if not self.active:
            yield
            return
        assert name in PARTS, name
        self._switch()
        self._stack.append(name)
        try:
            yield
        finally:
            if self.active:
                self._switch()
                self._stack.pop()

    @contextlib.contextmanager
    def paused(self):
        """Time inside belongs to no step (validation between two steps)."""
        start = time.perf_counter()
        if self.active:
            self._switch()
        try:
            yield
        finally:
            if self.active:
                now = self._now()
                self._start += now - self._last
                self._last = now
            self._wall_paused += time.perf_counter() - start

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
        now = time.perf_counter()
        wall = (now - self._wall_start - self._wall_paused) / max(self._wall_steps, 1)
        self._wall_start, self._wall_paused, self._wall_steps = now, 0.0, 0
        if not self.window_steps:
            return None
        n = self.window_steps
        values = [wall, self.window["step"] / n, *(self.window[p] / n for p in PARTS)]
        self.window = dict.fromkeys(self.window, 0.0)
        self.window_steps = 0
        return values


class TimedBatches:
    """An iterator of batches whose waits are the timer's "data" part."""

    def __init__(self, batches, timer: StepTimer):
        self.batches, self.timer = batches, timer

    def __iter__(self):
        return self

    def __next__(self):
        with self.timer.part("data"):
            return next(self.batches)
