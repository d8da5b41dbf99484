"""A research module's ``training_step`` (and ``validation_step``, ``test_step``) under a
pipeline: split into the model's forward, which the schedule runs stage after stage, and the
rest of the step, which the last stage runs on the pipeline's output as the loss.

The step is called twice per micro-batch, each time with a stand-in for ``self``: an instance of
the module's own class sharing the stage module's attributes, whose call is answered here. On the first stage the call records
its argument (the forward's input) and ends the step there; on the last stage it returns the
pipeline's output for that micro-batch, and the step goes on to its loss, its metrics and its
``self.log`` calls. So whatever the step does before calling the model (unpacking the batch,
scaling, casting) and after (the loss) runs as written, ``super()`` and helper methods
included. What it must do: call the model once, as ``self(x)``, on one tensor whose first
dimension is the micro-batch's samples.
"""

from __future__ import annotations

import torch

from meshtrain.errors import ConfigError


class _Called(Exception):
    """Raised by the stand-in's call on the first stage: the forward's arguments."""

    def __init__(self, args, kwargs):
        super().__init__()
        self.call_args, self.call_kwargs = args, kwargs


_VIEWS: dict[type, type] = {}  # a module class -> its stand-in class


def _step_view(module: torch.nn.Module, on_call, logs: list | None = None) -> torch.nn.Module:
    """``self`` inside a step: an instance of a subclass of the module's own class (so
    ``super()`` and ``isinstance`` work) sharing the module's ``__dict__`` (its parameters,
    submodules and attributes), whose call is ``on_call(...)``; with ``logs``, its ``self.log``
    calls are kept there instead of made."""
    cls = type(module)
    view_cls = _VIEWS.get(cls)
    if view_cls is None:
        def __call__(self, *args, **kwargs):  # noqa: N807 -- the stand-in's call
            return type(self)._on_call(*args, **kwargs)

        members = {"__call__": __call__, "_on_call": None, "_logs": None}
        if callable(getattr(cls, "log", None)):
            def log(self, *args, **kwargs):
                kept = type(self)._logs
                if kept is None:
                    return cls.log(self, *args, **kwargs)
                kept.append((args, kwargs))
            members["log"] = log
        view_cls = _VIEWS[cls] = type(f"{cls.__name__}StepView", (cls,), members)
    view_cls._on_call, view_cls._logs = on_call, logs
    view = object.__new__(view_cls)
    object.__setattr__(view, "__dict__", module.__dict__)
    return view


def _run_step(module, step: str, view, batch, batch_idx: int):
    return getattr(type(module), step)(view, batch, batch_idx)


def forward_input(module: torch.nn.Module, step: str, batch, batch_idx: int) -> torch.Tensor:
    """What ``module.<step>(batch, batch_idx)`` passes to the model: run up to its call."""
    def record(*args, **kwargs):
        raise _Called(args, kwargs)

    name = type(module).__name__
    try:
        _run_step(module, step, _step_view(module, record), batch, batch_idx)
    except _Called as called:
        args, kwargs = called.call_args, called.call_kwargs
        if len(args) != 1 or kwargs or not isinstance(args[0], torch.Tensor):
            raise ConfigError(
                f"{name}.{step} calls the model with {len(args)} positional and "
                f"{len(kwargs)} keyword argument(s); under pp the first stage takes one tensor "
                "(self(x)): pass the rest through the model's own attributes, or use a layout "
                "without pp") from None
        return args[0]
    raise ConfigError(f"{name}.{step} returned without calling the model (self(x)); under pp "
                      "the pipeline runs the model's forward between the step's start and its "
                      "loss, so the step must call self(...) once")


def step_on_output(module: torch.nn.Module, step: str, batch, batch_idx: int,
                   output: torch.Tensor, logs: list | None = None):
    """``module.<step>(batch, batch_idx)`` with the model's call answered by ``output`` (its
    ``self.log`` calls kept in ``logs`` when given)."""
    calls = []

    def answer(*args, **kwargs):
        if calls:
            raise ConfigError(
                f"{type(module).__name__}.{step} calls the model more than once; under pp the "
                "pipeline runs one forward per micro-batch: call self(x) once per step (or use a "
                "layout without pp)")
        calls.append(True)
        return output

    return _run_step(module, step, _step_view(module, answer, logs), batch, batch_idx)


def micro_batches(batch, num: int) -> list:
    """``batch`` (tensors, or tuples, lists and dicts of them) cut into ``num`` micro-batches
    along the first dimension, as the schedule cuts its inputs (``torch.tensor_split``)."""
    if isinstance(batch, torch.Tensor):
        return list(torch.tensor_split(batch, num))
    if isinstance(batch, (tuple, list)):
        parts = [micro_batches(item, num) for item in batch]
        return [type(batch)(part[i] for part in parts) for i in range(num)]
    if isinstance(batch, dict):
        parts = {k: micro_batches(v, num) for k, v in batch.items()}
        return [{k: part[i] for k, part in parts.items()} for i in range(num)]
    return [batch] * num  # (not a tensor: the same for every micro-batch)


class StepLoss:
    """The schedule's loss for a research module: ``(output, index)`` -> the step's loss on
    micro-batch ``index`` of the current step (the targets the schedule hands the last stage
    are the micro-batches' indices). ``module``: the last stage; ``batches``: the current
    step's micro-batches; ``first_idx``: the batch_idx of the first.

    What the step logs is kept per call and made by :meth:`commit` once the schedule is done,
    for the last calls only: torch's first schedule step also calls the loss once, before any
    micro-batch, on the outputs of placeholder inputs to infer the gradients' shapes (2.13,
    stage.py ``_prepare_backward_infra``), and that call's values must not count."""

    def __init__(self, step: str = "training_step"):
        self.step, self.module, self.batches, self.first_idx = step, None, [], 0
        self.logs: list[list] = []  # per call: its self.log calls

    def __call__(self, output: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        from meshtrain.module.core import step_loss

        i = int(index.reshape(-1)[0])
        logs: list = []
        self.logs.append(logs)
        out = step_on_output(self.module, self.step, self.batches[i], self.first_idx + i,
                             output, logs)
        return step_loss(out, self.step)

    def commit(self, calls: int) -> None:
        """Make the ``self.log`` calls of the last ``calls`` calls (the micro-batches')."""
        kept, self.logs = self.logs[len(self.logs) - calls:] if calls else [], []
        for logs in kept:
            for args, kwargs in logs:
                self.module.log(*args, **kwargs)
