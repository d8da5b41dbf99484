"""Numeric precision of the training step.

* ``fp32``: everything in float32.
* ``bf16-mixed``: float32 master weights and optimizer; forward/backward under ``torch.autocast``
  with bfloat16 (CPU and GPU). No loss scaling needed: bf16 has float32's exponent range.
* ``fp16-mixed``: float16 autocast with dynamic loss scaling (``torch.amp.GradScaler``), GPU only.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from meshtrain.errors import ConfigError

PRECISIONS = ("fp32", "bf16-mixed", "fp16-mixed")


def check_precision(precision: str, device_type: str) -> None:
    if precision not in PRECISIONS:
        raise ConfigError(
            f"unknown precision {precision!r}; choose one of {', '.join(PRECISIONS)}"
        )
    if precision == "fp16-mixed" and device_type != "cuda":
        raise ConfigError(
            "precision='fp16-mixed' needs a GPU (float16 autocast with a grad scaler); on "
            f"{device_type} use precision='bf16-mixed' or 'fp32'"
        )


@dataclass
class Precision:
    """Autocast context and (for fp16) the grad scaler for one device type."""

    name: str
    device_type: str

    def __post_init__(self) -> None:
        check_precision(self.name, self.device_type)
        self.scaler = (
            torch.amp.GradScaler(self.device_type) if self.name == "fp16-mixed" else None
        )

    @property
    def autocast_dtype(self) -> torch.dtype | None:
        return {"bf16-mixed": torch.bfloat16, "fp16-mixed": torch.float16}.get(self.name)

    def autocast(self):
        dtype = self.autocast_dtype
        if dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=dtype)

    def backward(self, loss: torch.Tensor) -> None:
        (self.scaler.scale(loss) if self.scaler else loss).backward()

    def unscale(self, optimizer) -> None:
        """Bring gradients back to their true size before clipping (fp16 only)."""
        if self.scaler:
            self.scaler.unscale_(optimizer)

    def step(self, optimizer) -> None:
        if self.scaler:
            self.scaler.step(optimizer)
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
