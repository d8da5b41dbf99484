"""Layouts: how the world of processes is cut into parallel axes.

A layout names one degree per axis, e.g. ``"dp=2"``. It is parsed and checked here, in one place,
before any process group exists (the same role as torchtitan's ``ParallelDims``): the degrees must
multiply to the world size, and each axis becomes a named dimension of one ``DeviceMesh``.

Syntax: comma-separated ``axis=degree`` pairs; at most one degree may be ``auto`` (or ``-1``) and is
then filled with whatever the world size leaves. Axes with degree 1 may be left out. An empty
string or ``None`` means one process per world rank of plain data parallelism (``dp=auto``).

The axes, in mesh order (outermost first), are :data:`AXES`: ``pp``, ``dp_replicate`` (HSDP's
replicas, with ``dp_shard``), ``dp`` (DDP), ``dp_shard`` (FSDP2), ``cp`` and ``tp``.

ZeRO names are aliases that also pick what is sharded (Rajbhandari et al., SC 2020):

* ``zero1=N``: ``dp=N`` with the optimizer state sharded (``ZeroRedundancyOptimizer``);
* ``zero2=N``: ``dp_shard=N`` with parameters kept gathered from forward to backward
  (``reshard_after_forward=False``): gradients and optimizer state sharded;
* ``zero3=N``: ``dp_shard=N``: parameters, gradients and optimizer state sharded.

Hybrid sharding: ``dp_replicate=2,dp_shard=2`` (or ``dp_replicate=2,zero2=2``).

Expert parallel: ``ep=E`` splits the experts of MoE layers over E of the data- and
context-parallel ranks (E divides their product; meshtrain/parallel/expert/): it adds no
process. ``ep=2`` alone is 2 processes, ``dp=2`` for the rest, each rank holding half the
experts; ``dp_shard=4,ep=2`` shards the dense part over 4, splits the experts over 2 and shards
them over the other 2 (the "expert data-parallel" ranks, ``edp``; under HSDP ``edp`` spans the
replicas). ep combines with ``dp``, ``dp_shard``, ``dp_replicate``, ``cp`` and ``pp``.

Parameter servers: ``ps=S,dp=W`` starts S + W processes; the last S hold the parameters and the
optimizer (meshtrain/parallel/ps/layout.py) and are not in the mesh, the first W are the
data-parallel workers (``dp=auto`` when left out). ``ps`` combines with ``dp`` only.

Composition: any combination on one mesh, e.g. ``pp=2,dp_shard=2,tp=2``. With ``pp``, ``tp`` or
``cp``, ``dp`` gradients are averaged by an explicit all-reduce instead of DDP (DDP breaks under
pipelining and does not take DTensor parameters); ``zero1`` is for plain data parallelism only.
``cp`` with ``pp`` needs a model with its own ``enable_context_parallel`` (meshtrain's GPT).

Two words for data parallelism: the **batch** axes are all data-parallel axes together (ranks
along them see different samples; ``batch_degree`` of them split the global batch), while ``dp``
is one of them, the DDP axis. The **loss** axes are the batch axes plus ``cp``: the ranks whose
losses together make the global mean, and over which replicated gradients are averaged.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from meshtrain.errors import LayoutError
from meshtrain.parallel.layout_hints import divisor, unknown_axis

#: Axes in mesh order (outermost first) with a one-line description for error messages.
AXES: dict[str, str] = {
    "pp": "pipeline parallel (stages of consecutive blocks)",
    "dp_replicate": "replicas of a sharded model (HSDP, used with dp_shard)",
    "dp": "data parallel (DistributedDataParallel, replicated parameters)",
    "dp_shard": "fully sharded data parallel (FSDP2, ZeRO-3)",
    "cp": "context parallel (the sequence split over ranks)",
    "tp": "tensor parallel (Megatron-style column/row splits)",
}

#: Data-parallel axes: ranks along them see different data.
DATA_PARALLEL_AXES = ("dp_replicate", "dp", "dp_shard")

#: ZeRO aliases: name -> (axis, ZeRO stage).
ZERO_ALIASES = {"zero1": ("dp", 1), "zero2": ("dp_shard", 2), "zero3": ("dp_shard", 3)}

#: Counts beside the mesh axes, taken out first: they start (ps) or borrow (ep) processes.
COUNTS = {"ep": "expert parallel (no process of its own)", "ps": "parameter servers"}
NAMES = (*AXES, *ZERO_ALIASES, *COUNTS)  # every name a layout may use, as messages list them

_PAIR = re.compile(r"^\s*([A-Za-z_][A-Za-z0-9_]*)\s*=\s*(\S+)\s*$")


@dataclass(frozen=True)
class Layout:
    """Parallel degrees by axis name; ``degrees`` holds only axes with a degree above 1.

    ``zero_stage`` says what data parallelism shards: 0 nothing (DDP), 1 optimizer state,
    2 gradients and optimizer state, 3 everything (parameters too).
    """

    degrees: dict[str, int] = field(default_factory=dict)
    zero_stage: int = 0
    num_servers: int = 0  # ``ps=S``: S parameter-server processes beside the mesh's workers
    expert_degree: int = 1  # ``ep=E``: experts split over E of the data-parallel ranks

    # -- construction -------------------------------------------------------------------------
    @classmethod
    def parse(cls, spec: str | dict | Layout | None, world_size: int) -> Layout:
        """Parse ``spec`` (string, mapping or Layout) and check it against ``world_size``."""
        if world_size < 1:
            raise LayoutError(f"world size must be at least 1, got {world_size}")
        if isinstance(spec, Layout):
            return cls.parse(str(spec) if spec.degrees or spec.num_servers else "dp=1",
                             world_size)
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
        num_servers = _servers(raw, world_size, spec)
        experts = _experts(raw, spec)
        degrees, zero_stage = _resolve(raw, world_size - num_servers, spec)
        return cls(degrees, zero_stage, num_servers, _check_experts(experts, degrees,
                                                                      zero_stage, spec))

    # -- queries ------------------------------------------------------------------------------
    def degree(self, axis: str) -> int:
        """The degree of ``axis`` (1 when the layout does not use it)."""
        return self.degrees.get(axis, 1)

    @property
    def batch_degree(self) -> int:
        """Ranks that see different samples: all data-parallel axes together (``dp`` alone is
        the DDP axis, ``degree("dp")``)."""
        return math.prod(self.degree(a) for a in DATA_PARALLEL_AXES)

    @property
    def batch_axes(self) -> tuple[str, ...]:
        """The data-parallel axes of this layout, in mesh order."""
        return tuple(a for a in DATA_PARALLEL_AXES if a in self.degrees)

    @property
    def loss_axes(self) -> tuple[str, ...]:
        """The batch axes and ``cp``: ranks whose mean loss is the global loss; gradients of
        replicated parameters are averaged over them."""
        return tuple(a for a in (*DATA_PARALLEL_AXES, "cp") if a in self.degrees)

    @property
    def loss_degree(self) -> int:
        return math.prod(self.degree(a) for a in self.loss_axes)

    @property
    def is_sharded(self) -> bool:
        """Parameters and gradients sharded with FSDP2 (ZeRO-2 and ZeRO-3, HSDP)."""
        return "dp_shard" in self.degrees

    @property
    def uses_ddp(self) -> bool:
        """DDP averages the gradients (``dp``/``zero1`` alone): its bucket and hook settings apply."""
        return self.degree("dp") > 1 and self.loss_axes == ("dp",) and not (
            "pp" in self.degrees or "tp" in self.degrees or self.num_servers)

    @property
    def averages_gradients_by_hand(self) -> bool:
        """Replicated (not sharded) gradients averaged by an explicit all-reduce over the loss
        axes: plain ``dp`` with ``pp`` or ``tp``, and any ``cp`` without ``dp_shard``."""
        return not (self.is_sharded or self.num_servers) and self.loss_degree > 1 and not \
            self.uses_ddp

    @property
    def gradients_identical_after_sync(self) -> bool:
        """Does every rank hold the same full gradients once they are averaged? (plain DDP or
        ZeRO-1, or one process; not sharded, tensor, context or pipeline parallel)"""
        return self.world_size == 1 or self.uses_ddp

    def why_not_ddp(self) -> str:
        """Why DDP's settings do nothing under this layout (for error messages)."""
        if self.is_sharded:
            return "FSDP reduce-scatters the gradients of a sharded layout"
        if self.num_servers:
            return "parameter servers average the workers' gradients"
        if self.averages_gradients_by_hand:
            return "with pp, tp or cp, gradients are averaged by an explicit all-reduce"
        return "no data-parallel ranks average gradients here"

    @property
    def world_size(self) -> int:
        """The mesh's ranks (with ``ps``: the workers; the servers are not in it)."""
        return math.prod(self.degrees.values()) if self.degrees else 1

    @property
    def expert_data_degree(self) -> int:  # ``edp``: a stage's ranks holding the same experts
        return self.world_size // (self.degree("pp") * self.expert_degree)

    @property
    def num_processes(self) -> int:
        """Every process of the job: the mesh's ranks and the parameter servers."""
        return self.world_size + self.num_servers

    @staticmethod
    def processes_of(spec: str) -> int:
        """The processes a layout written out in full (no ``auto``) starts: its degrees
        multiplied, ``ps``'s servers added; ``ep`` borrows ranks (alone it stands for dp=E)."""
        degrees = {a: int(v) if v.strip().isdigit() else 0 for a, v in _parse_pairs(spec).items()}
        if not all(degrees.values()):
            raise LayoutError(f"layout {spec!r}: write every degree out as a number (no 'auto')")
        servers, experts = degrees.pop("ps", 0), degrees.pop("ep", 1)
        borrowed = {*DATA_PARALLEL_AXES, *ZERO_ALIASES, "cp"} & set(degrees)
        return math.prod(degrees.values()) * (1 if borrowed else experts) + servers

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        return tuple(self.degrees[a] for a in self.axis_names)

    @property
    def axis_names(self) -> tuple[str, ...]:
        return tuple(a for a in AXES if a in self.degrees)

    def build_mesh(self, device_type: str, backends: dict[str, str] | None = None):
        """The ``DeviceMesh`` of this layout, one named dimension per axis (needs a process
        group); ``backends``: another backend than the default group's for some axes."""
        from torch.distributed.device_mesh import init_device_mesh

        if not self.degrees:
            return None
        return init_device_mesh(device_type, self.mesh_shape, mesh_dim_names=self.axis_names,
                                backend_override=backends or None)

    def __str__(self) -> str:
        names = {"dp": "zero1"} if self.zero_stage == 1 else (
            {"dp_shard": "zero2"} if self.zero_stage == 2 else {})
        text = ",".join(f"{names.get(a, a)}={self.degrees[a]}" for a in self.axis_names)
        if self.num_servers:
            return f"ps={self.num_servers},{text or 'dp=1'}"
        if self.expert_degree > 1:
            return f"{text},ep={self.expert_degree}"
        return text or "single"


def _pop_count(raw: dict, key: str, spec, what: str) -> int | None:
    """``key``'s integer taken out of ``raw`` (None when absent): ``ps`` and ``ep`` are no mesh
    axis; ``what`` says what to give."""
    if key not in raw:
        return None
    value = raw.pop(key)
    try:
        return int(value)
    except (TypeError, ValueError):
        raise LayoutError(f"{key}={value!r} in {spec!r}: give {what}; 'auto' is not taken"
                          ) from None


def _servers(raw: dict, world_size: int, spec) -> int:
    """``ps=S`` (parameter servers, meshtrain/parallel/ps/layout.py) taken out of ``raw``: the
    last S processes serve, the others are plain data-parallel workers."""
    num_servers = _pop_count(raw, "ps", spec, "the number of parameter servers, e.g. "
                             "'ps=1,dp=3' (1 server, 3 workers)")
    if num_servers is None:
        return 0
    if num_servers < 1:
        raise LayoutError(f"ps={num_servers} in {spec!r}: a parameter-server layout needs at "
                          "least 1 server; drop ps= for all-reduce data parallelism")
    other = sorted(set(raw) - {"dp"})
    if other:
        raise LayoutError(f"layout {spec!r}: with ps (parameter servers) the workers are plain "
                          f"data parallel; {', '.join(other)} do not combine with it; write "
                          f"e.g. 'ps={num_servers},dp={max(1, world_size - num_servers)}'")
    if world_size <= num_servers:
        raise LayoutError(
            f"layout {spec!r} has {num_servers} parameter server(s) and the world size is "
            f"{world_size}, which leaves no workers; start more processes (world size = servers "
            f"+ workers, e.g. devices={num_servers + 2} for 2 workers) or lower ps")
    workers = str(raw.setdefault("dp", "auto")).strip().lower()
    if workers not in ("auto", "-1") and workers.isdigit() and int(workers) + num_servers != \
            world_size:
        raise LayoutError(
            f"layout {spec!r} needs {int(workers) + num_servers} processes ({num_servers} "
            f"server(s) + {workers} workers) but the world size is {world_size}; start "
            f"{int(workers) + num_servers} processes, or write 'ps={num_servers}' alone (every "
            "other process a worker)")
    return num_servers


def _experts(raw: dict, spec) -> int:
    """``ep=E`` taken out of ``raw`` (it borrows ranks); without a data- or context-parallel
    axis, the ranks the other axes leave are plain data parallel (``dp=auto``)."""
    degree = _pop_count(raw, "ep", spec, "the number of ranks the experts are split over, "
                        "e.g. 'ep=2'")
    if degree is None:
        return 1
    if degree < 1:
        raise LayoutError(f"degree of 'ep' must be at least 1, got {degree}")
    if not set(raw) & {*DATA_PARALLEL_AXES, *ZERO_ALIASES, "cp"}:
        raw["dp"] = "auto"  # (the ranks ep borrows: the rest of the world)
    return degree


def _check_experts(degree: int, degrees: dict, zero_stage: int, spec) -> int:
    """``ep``'s degree, checked against the data- and context-parallel ranks it borrows."""
    if degree == 1:
        return 1
    other = sorted(set(degrees) - {"dp_replicate", "dp", "dp_shard", "cp", "pp"})
    if other or zero_stage == 1:
        why = {"tp": "tp (not yet together: tp alone splits each expert of meshtrain's MoE "
                     "GPT by hidden unit, ep splits the experts between ranks)"}
        what = ", ".join(why.get(a, a) for a in other) or "zero1 (its optimizer would " \
            "overwrite the experts)"
        raise LayoutError(f"layout {spec!r}: ep (expert parallel) combines with dp, dp_shard "
                          f"(zero2/zero3), dp_replicate (HSDP), cp and pp, not with {what}; "
                          f"e.g. 'ep={degree}' or 'zero3={degree},ep={degree}'")
    data = math.prod(degrees.get(a, 1) for a in ("dp_replicate", "dp", "dp_shard", "cp"))
    if data % degree:
        raise LayoutError(
            f"layout {spec!r}: ep={degree} borrows its ranks from the data- and context-parallel "
            f"ranks, which are {data}; ep must divide it (e.g. ep={divisor(data, degree)}, or more processes)")
    return degree


def _parse_pairs(spec: str) -> dict[str, str]:
    if spec.strip().partition(",")[0].strip() == "auto":
        raise LayoutError(f"layout {spec!r} is the Trainer's to plan (docs/planner.md); here give "
                          "a concrete layout, e.g. the pick that `meshtrain train CONFIG "
                          "--trainer.layout=auto --dry-run` prints")
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
    degrees: dict[str, int] = {}
    auto_axis = None
    zero_stage = None
    for name in list(raw):
        if name in ZERO_ALIASES:
            axis, stage = ZERO_ALIASES[name]
            if zero_stage is not None:
                raise LayoutError(f"layout {spec!r} names two ZeRO stages; pick one")
            if axis in raw:
                raise LayoutError(
                    f"layout {spec!r} names both {name!r} and {axis!r}, which are the same axis; "
                    f"keep {name!r}"
                )
            zero_stage = stage
            raw = {(axis if k == name else k): v for k, v in raw.items()}
    for axis, value in raw.items():
        if axis not in AXES:
            raise unknown_axis(axis, spec, NAMES)
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
    degrees = {a: d for a, d in degrees.items() if d > 1}
    if "dp" in degrees and "dp_shard" in degrees:
        raise LayoutError(
            f"layout {spec!r} combines dp (replicated) with dp_shard (sharded); for hybrid "
            f"sharding write dp_replicate={degrees['dp']},dp_shard={degrees['dp_shard']}"
        )
    if "dp_replicate" in degrees and "dp_shard" not in degrees:
        raise LayoutError(
            f"layout {spec!r}: dp_replicate replicates a sharded model and needs dp_shard "
            f"(HSDP); for plain replication write dp={degrees['dp_replicate']}"
        )
    if zero_stage == 1 and ("pp" in degrees or "tp" in degrees or "cp" in degrees):
        raise LayoutError(
            f"layout {spec!r}: zero1 is available with plain data parallelism only; with pp, "
            f"tp or cp shard the optimizer state with zero2/zero3 (dp_shard) instead"
        )
    if zero_stage is None:
        zero_stage = 3 if "dp_shard" in raw else 0
    return degrees, zero_stage

