"""Numeric precision of the training step.

* ``fp32``: everything in float32.
* ``bf16-mixed``: float32 master weights and optimizer; forward/backward under ``torch.autocast``
  with bfloat16 (CPU and GPU). No loss scaling needed: bf16 has float32's exponent range.
* ``fp16-mixed``: float16 autocast (CPU and GPU) with dynamic loss scaling: the loss is multiplied
  by the grad scaler's scale before backward (by the engine, or under ``pp`` inside the loss
  function the schedule calls), the gradients are divided by it before clipping and the step, and
  a step whose gradients hold an inf/NaN is skipped (the scale halves).

float8 matmuls (torchao, the ``float8`` setting) are a model transformation applied with the
layout, beside these precisions: meshtrain/parallel/float8.py.

Every rank must skip the same steps: ranks hold different gradients under FSDP (shards), TP and
``pp`` (stages), so :class:`CollectiveGradScaler` takes the largest "found inf" over the world
before the step. Measured parity with one process: docs/precision.md.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.distributed as dist

from meshtrain.errors import ConfigError

PRECISIONS = ("fp32", "bf16-mixed", "fp16-mixed")


def check_precision(precision: str, device_type: str) -> None:
    if precision not in PRECISIONS:
        raise ConfigError(
            f"unknown precision {precision!r}; choose one of {', '.join(PRECISIONS)}"
        )


class CollectiveGradScaler(torch.amp.GradScaler):
    """``torch.amp.GradScaler`` whose inf/NaN finding is the same on every rank.

    torch's scaler checks the gradients this rank holds; DTensor gradients (FSDP2, TP) reduce
    the flag over their own mesh only, and pipeline stages not at all, so ranks could disagree
    (one skips the step and halves the scale, another steps). Here the flag is MAX-reduced over
    the world after unscaling: one tiny all-reduce per step."""

    def _ensure_scale(self, optimizer: torch.optim.Optimizer) -> None:
        if self._enabled and self._scale is None:  # a pipeline rank without the loss: the
            # last stage scaled it (the gradients it sent back are scaled), scale() ran there
            device = next((p.device for g in optimizer.param_groups for p in g["params"]),
                          torch.device(self._device))
            self._lazy_init_scale_growth_tracker(device)

    def step(self, optimizer: torch.optim.Optimizer, *args, **kwargs):
        self._ensure_scale(optimizer)  # (without clipping, step is the first to need it)
        return super().step(optimizer, *args, **kwargs)

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        self._ensure_scale(optimizer)
        super().unscale_(optimizer)
        if not (self._enabled and dist.is_available() and dist.is_initialized()
                and dist.get_world_size() > 1):
            return
        found = self._per_optimizer_states[id(optimizer)]["found_inf_per_device"]
        flag = torch.zeros((), dtype=torch.float32, device=self._scale.device)
        for value in found.values():  # one entry per device (one here)
            flag = torch.maximum(flag, value.to(flag.device))
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)  # every rank, even one without gradients
        for value in found.values():
            value.copy_(flag)


@dataclass
class Precision:
    """Autocast context and (for fp16) the grad scaler for one device type."""

    name: str
    device_type: str

    def __post_init__(self) -> None:
        check_precision(self.name, self.device_type)
        self.scaler = (
            CollectiveGradScaler(self.device_type) if self.name == "fp16-mixed" else None
        )

    @property
    def autocast_dtype(self) -> torch.dtype | None:
        return {"bf16-mixed": torch.bfloat16, "fp16-mixed": torch.float16}.get(self.name)

    def autocast(self):
        dtype = self.autocast_dtype
        if dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=dtype)

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss to run backward on: under fp16 times the grad scaler's current scale."""
        return self.scaler.scale(loss) if self.scaler else loss

    def backward(self, loss: torch.Tensor) -> None:
        self.scale_loss(loss).backward()

    def unscale(self, optimizer) -> None:
        """Bring gradients back to their true size before clipping (fp16 only)."""
        if self.scaler:
            self.scaler.unscale_(optimizer)

    def step(self, optimizer) -> None:
        if self.scaler:
            self.scaler.step(optimizer)  # unscales first unless done; skips on inf/NaN
            self.scaler.update()
        else:
            optimizer.step()

    def skip_step(self) -> None:
        """The step's update was dropped (nan_policy): let the grad scaler start a new step."""
        if self.scaler:
            self.scaler.update(self.scaler.get_scale())  # same scale; clears per-step state

    def state_dict(self) -> dict:
        return self.scaler.state_dict() if self.scaler else {}

    def load_state_dict(self, state: dict) -> None:
        if self.scaler and state:
            self.scaler.load_state_dict(state)
