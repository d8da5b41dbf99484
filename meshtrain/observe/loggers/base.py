"""What every metric logger is: :class:`Logger` (its methods, each a no-op: a Trainer holds one on
every rank and calls it unconditionally), the check that metrics are numbers, and the
hyperparameters flattened to ``a.b.c`` keys."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from meshtrain.errors import ConfigError


class Logger:
    """Base logger: every method is a no-op (used as-is on non-zero ranks)."""

    def log_hparams(self, params: dict) -> None:
        """Record the run's hyperparameters / resolved config."""

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        """Record scalar ``metrics`` (name -> number) at optimizer ``step``."""

    def finalize(self) -> None:
        """Flush and close files; safe to call more than once."""


def _to_float(name: str, value: Any) -> float:
    """``float(value)`` (works for Python numbers and one-element tensors) or a ConfigError."""
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ConfigError(
            f"metric {name!r} has a value of type {type(value).__name__} ({value!r:.60}) that is "
            "not a number; log only numbers or one-element tensors (call .item() on others)"
        ) from None


def _check_metrics(metrics: Mapping[str, Any]) -> dict[str, float]:
    """Convert metric values to floats and reject reserved or non-string names."""
    out: dict[str, float] = {}
    for name, value in metrics.items():
        if not isinstance(name, str) or not name:
            raise ConfigError(f"metric names must be non-empty strings, got {name!r}")
        if name == "step":
            raise ConfigError(
                "'step' is reserved for the step column; pass the step as the `step` argument "
                "and give the metric another name"
            )
        out[name] = _to_float(name, value)
    return out


# -- CSV -------------------------------------------------------------------------------------------


def flatten_params(params: Any, prefix: str = "") -> dict[str, Any]:
    """Nested dicts / dataclasses as ``{"a.b.c": value}`` (lists and others kept as they are)."""
    if dataclasses.is_dataclass(params) and not isinstance(params, type):
        params = {f.name: getattr(params, f.name) for f in dataclasses.fields(params)}
    if not isinstance(params, Mapping):
        return {prefix or "value": params}
    flat: dict[str, Any] = {}
    for key, value in params.items():
        name = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(value, Mapping) or (
            dataclasses.is_dataclass(value) and not isinstance(value, type)
        ):
            flat.update(flatten_params(value, name))
        else:
            flat[name] = value
    return flat
