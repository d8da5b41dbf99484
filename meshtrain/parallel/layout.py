"""Layouts: how the world of processes is cut into parallel axes.

A layout names one degree per axis, e.g. ``"dp=2"``. It is parsed and checked here, in one place,
before any process group exists (the same role as torchtitan's ``ParallelDims``): the degrees must
multiply to the world size, and each axis becomes a named dimension of one ``DeviceMesh``.

Syntax: comma-separated ``axis=degree`` pairs; at most one degree may be ``auto`` (or ``-1``) and is
then filled with whatever the world size leaves. Axes with degree 1 may be left out. An empty
string or ``None`` means one process per world rank of plain data parallelism (``dp=auto``).

Axes available now:

====== ===========================================================================
``dp`` data parallel, replicated parameters, gradients averaged by all-reduce (DDP)
====== ===========================================================================

Later strategies (sharded data parallel, tensor and pipeline parallel) add their axes to
``AXES`` and an ``apply_*`` step to ``meshtrain.parallel.apply``; the parser, the checks and the
mesh construction stay as they are.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from meshtrain.errors import LayoutError

#: Axes in mesh order (outermost first) with a one-line description for error messages.
AXES: dict[str, str] = {
    "dp": "data parallel (DistributedDataParallel, replicated parameters)",
}

#: Axis names later issues will add; a clear message beats "unknown axis" for these.
PLANNED_AXES = {
    "zero1": "ZeRO-1 (sharded optimizer state)",
    "zero2": "ZeRO-2 (sharded gradients and optimizer state)",
    "zero3": "ZeRO-3 / FSDP (fully sharded)",
    "dp_shard": "sharded data parallel (FSDP)",
    "dp_replicate": "hybrid sharded data parallel (HSDP)",
    "tp": "tensor parallel",
    "pp": "pipeline parallel",
}

_PAIR = re.compile(r"^\s*([A-Za-z_][A-Za-z0-9_]*)\s*=\s*(\S+)\s*$")


@dataclass(frozen=True)
class Layout:
    """Parallel degrees by axis name; ``degrees`` holds only axes with a degree above 1."""

    degrees: dict[str, int] = field(default_factory=dict)

    # -- construction -------------------------------------------------------------------------
    @classmethod
    def parse(cls, spec: str | dict | Layout | None, world_size: int) -> Layout:
        """Parse ``spec`` (string, mapping or Layout) and check it against ``world_size``."""
        if world_size < 1:
            raise LayoutError(f"world size must be at least 1, got {world_size}")
        if isinstance(spec, Layout):
            raw = dict(spec.degrees)
        elif spec is None or (isinstance(spec, str) and not spec.strip()):
            raw = {"dp": "auto"}
        elif isinstance(spec, str):
            raw = _parse_pairs(spec)
        elif isinstance(spec, dict):
            raw = dict(spec)
        else:
            raise LayoutError(
                f"layout must be a string like 'dp=2', a dict or a Layout, got {type(spec).__name__}"
            )
        return cls(_resolve(raw, world_size, spec))

    # -- queries ------------------------------------------------------------------------------
    def degree(self, axis: str) -> int:
        """The degree of ``axis`` (1 when the layout does not use it)."""
        return self.degrees.get(axis, 1)

    @property
    def dp_degree(self) -> int:
        """Ranks that see different data (all data-parallel flavours together)."""
        return self.degree("dp")

    @property
    def world_size(self) -> int:
        return math.prod(self.degrees.values()) if self.degrees else 1

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        return tuple(self.degrees[a] for a in self.axis_names)

    @property
    def axis_names(self) -> tuple[str, ...]:
        return tuple(a for a in AXES if a in self.degrees)

    def build_mesh(self, device_type: str):
        """The ``DeviceMesh`` of this layout, one named dimension per axis (needs a process group)."""
        from torch.distributed.device_mesh import init_device_mesh

        if not self.degrees:
            return None
        return init_device_mesh(device_type, self.mesh_shape, mesh_dim_names=self.axis_names)

    def __str__(self) -> str:
        return ",".join(f"{a}={self.degrees[a]}" for a in self.axis_names) or "single"


def _parse_pairs(spec: str) -> dict[str, str]:
    raw: dict[str, str] = {}
    for part in spec.split(","):
        if not part.strip():
            continue
        match = _PAIR.match(part)
        if not match:
            raise LayoutError(
                f"cannot read {part.strip()!r} in layout {spec!r}: write comma-separated "
                f"axis=degree pairs, e.g. 'dp=2'"
            )
        axis, value = match.group(1).lower(), match.group(2)
        if axis in raw:
            raise LayoutError(f"axis {axis!r} appears twice in layout {spec!r}; name it once")
        raw[axis] = value
    return raw


def _resolve(raw: dict, world_size: int, spec) -> dict[str, int]:
    known = ", ".join(AXES)
    degrees: dict[str, int] = {}
    auto_axis = None
    for axis, value in raw.items():
        if axis not in AXES:
            if axis in PLANNED_AXES:
                raise LayoutError(
                    f"layout axis {axis!r} ({PLANNED_AXES[axis]}) is not available in this version "
                    f"of meshtrain; axes available now: {known}"
                )
            raise LayoutError(f"unknown layout axis {axis!r} in {spec!r}; known axes: {known}")
        if str(value).strip().lower() in ("auto", "-1"):
            if auto_axis is not None:
                raise LayoutError(
                    f"only one axis may be 'auto', got {auto_axis!r} and {axis!r} in {spec!r}"
                )
            auto_axis = axis
            continue
        try:
            degree = int(value)
        except (TypeError, ValueError):
            raise LayoutError(
                f"degree of {axis!r} must be a positive integer or 'auto', got {value!r}"
            ) from None
        if degree < 1:
            raise LayoutError(f"degree of {axis!r} must be at least 1, got {degree}")
        degrees[axis] = degree

    fixed = math.prod(degrees.values()) if degrees else 1
    if auto_axis is not None:
        if world_size % fixed:
            raise LayoutError(
                f"layout {spec!r}: the fixed degrees multiply to {fixed}, which does not divide "
                f"the world size {world_size}, so {auto_axis!r}=auto has no integer value; "
                f"use a world size that is a multiple of {fixed}"
            )
        degrees[auto_axis] = world_size // fixed
    elif fixed != world_size:
        got = " x ".join(f"{a}={d}" for a, d in degrees.items()) or "1"
        raise LayoutError(
            f"layout {spec!r} needs {fixed} processes ({got}) but the world size is {world_size}; "
            f"start {fixed} processes (devices={fixed} or --nproc-per-node {fixed}) or change the "
            f"degrees so they multiply to {world_size} (or set one to 'auto')"
        )
    return {a: d for a, d in degrees.items() if d > 1}
