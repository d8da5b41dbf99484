"""The machines a plan is for: devices, their memory and speed, and how fast their links are.

Presets (``Cluster.preset("8xH100", nodes=8)``) state published peaks times a stated efficiency;
``"this-machine"`` is measured here: a matmul probe for compute and ``meshtrain bench comm``'s
JSON (``benchmarks/results/bench_comm.json`` or ``--comm FILE``) for communication.

Communication time of a collective on ``n`` ranks moving ``size`` bytes (nccl-tests' sizes) is
``latency + size * bus_factor(op, n) / bus_bandwidth``: the link's bandwidth for tp/cp inside a
node, the inter-node one as soon as the group crosses nodes. From a measured table the time is
read at the measured size instead (interpolated) and scaled by the bus factor to ``n`` ranks.
"""

from __future__ import annotations

import bisect
import dataclasses
import json
import math
import os
import time
from pathlib import Path

import torch

from meshtrain.errors import ConfigError
from meshtrain.parallel.layout import Layout
from meshtrain.plan.bench_comm import bus_factor

GIB = 1 << 30


@dataclasses.dataclass(frozen=True)
class Cluster:
    name: str
    nodes: int
    devices_per_node: int
    memory: int  # bytes per device
    flops: float  # achieved FLOP/s per device at training shapes (peak x efficiency)
    intra_bw: float  # bus bandwidth inside a node, bytes/s
    inter_bw: float  # bus bandwidth across nodes, bytes/s
    latency: float  # seconds per collective (intra; inter: 2x)
    reserved: int  # bytes per device the framework, runtime and allocator take besides tensors
    overlap: float  # fraction of compute time data-parallel collectives can hide behind
    memory_bw: float  # device memory bandwidth, bytes/s (the optimizer step)
    dtype: str = "bf16-mixed"  # the precision jobs on it train in
    comm_table: dict | None = None  # {op: [(bytes, seconds)]} at table_ranks, measured
    table_ranks: int = 2
    # the same for what meshtrain sends through shared memory inside a host (local_comm="auto":
    # FSDP2's all-gather and reduce-scatter, pipeline sends), measured where a CPU job runs
    shared_table: dict | None = None
    compute_share: float = 1.0  # of a core per process (this machine: cores / processes)
    drift: float = 0.0  # seconds a collective waits for ranks drifting apart while computing
    # {cp degree: seconds} a cp collective (K/V all-gather, its gradients' reduce-scatter)
    # waits inside a step beyond its transfer, in place of ``drift``: measured here by
    # benchmarks/cp_sync.py (cp's collectives sit between uneven bursts of compute: on 4
    # processes over 2 cores, a quiet machine, cp=2 6-7 ms, cp=4 11-13 ms, 2026-11-29); a
    # degree not in it pays ``drift``
    cp_sync: dict | None = None
    # of the cores a pipeline's processes keep busy where they outnumber the cores, against
    # data parallel's: the stages hand each other work and sleep on it, and a sleeping stage
    # lends its core imperfectly (to anything else that runs); measured here by
    # benchmarks/pp_core_use.py (4 processes over 2 cores, 2026-12-01: 0.92-0.98 in four runs
    # on a quiet machine, 0.93 beside a busy loop); 1.0 where each process has a core or a
    # device
    pp_core_use: float = 1.0
    # of what a step allocates and frees again (activations, the loss's and the collectives'
    # temporaries), the fraction the host allocator keeps resident (glibc's heap keeps freed
    # chunks): measured on this machine by benchmarks/planner.py; 0 where ``reserved`` is
    # the whole allowance (GPU presets: the CUDA caching allocator's)
    heap_keep: float = 0.0
    # the same by layout family (:func:`heap_family`), where measured: layouts of one family
    # free and reuse memory alike, families do not (glibc, 2026-11-30: of the activations and
    # transients a dp=4 process keeps 0.46, zero3=4 1.1, cp=4 1.8 resident); a family not in
    # it takes the largest of its measured axes', else ``heap_keep``
    heap_keep_by_family: dict[str, float] | None = None
    peak_note: str = ""

    @property
    def world_size(self) -> int:
        return self.nodes * self.devices_per_node

    def heap_keep_of(self, layout: Layout) -> float:
        """The fraction of a step's freed activations and transients the host allocator keeps
        resident under ``layout``: its family's as measured, else the largest measured of its
        axes' (``"pp+tp"``: ``"pp"``'s or ``"tp"``'s), else ``heap_keep``."""
        measured = self.heap_keep_by_family or {}
        family = heap_family(layout)
        if family in measured:
            return measured[family]
        return max((measured[a] for a in family.split("+") if a in measured),
                   default=self.heap_keep)

    def comm_seconds(self, op: str, size: float, ranks: int, *, crosses_nodes: bool,
                     shared: bool = False) -> float:
        """Seconds of one ``op`` of ``size`` bytes over ``ranks``; ``shared``: an op meshtrain
        sends through shared memory when its ranks share a host (a measured ``shared_table``)."""
        if ranks <= 1 or size <= 0:
            return 0.0
        table = self.shared_table if shared and not crosses_nodes and op in (
            self.shared_table or {}) else self.comm_table  # (a table from before: gloo's rows)
        if table and op in table:
            measured = _interpolate(table[op], size)
            return measured * bus_factor(op, ranks) / bus_factor(op, self.table_ranks)
        bandwidth, latency = (self.inter_bw, 2 * self.latency) if crosses_nodes else \
            (self.intra_bw, self.latency)
        return latency + size * bus_factor(op, ranks) / bandwidth

    # -- construction -------------------------------------------------------------------------
    @classmethod
    def preset(cls, name: str, *, nodes: int = 1, comm: str | Path | None = None,
               processes: int | None = None) -> Cluster:
        name = name.lower()
        if name not in PRESETS and name != "this-machine":
            raise ConfigError(f"unknown cluster preset {name!r}; choose one of "
                              f"{', '.join([*PRESETS, 'this-machine'])}")
        if nodes < 1:
            raise ConfigError(f"nodes must be at least 1, got {nodes}")
        if name == "this-machine":
            return this_machine(processes or 2, comm)
        return dataclasses.replace(PRESETS[name], nodes=nodes)


def _interpolate(rows: list[tuple[int, float]], size: float) -> float:
    """Seconds at ``size`` from measured (bytes, seconds) rows: linear between neighbours,
    linear in size past the largest, the smallest's time below it."""
    sizes = [b for b, _ in rows]
    i = bisect.bisect_left(sizes, size)
    if i == 0:
        return rows[0][1]
    if i == len(rows):
        (b0, t0), (b1, t1) = rows[-2], rows[-1]
        return t1 + (size - b1) * (t1 - t0) / (b1 - b0)
    (b0, t0), (b1, t1) = rows[i - 1], rows[i]
    return t0 + (size - b0) * (t1 - t0) / (b1 - b0)


_H100 = dict(devices_per_node=8, flops=989e12 * 0.40, intra_bw=360e9, inter_bw=45e9,
             latency=15e-6, reserved=4 * GIB, overlap=0.8, memory_bw=3.35e12)
#: Published peaks: H100 SXM 989 TFLOP/s dense bf16, 80 GB, 3.35 TB/s; H200 141 GB, 4.8 TB/s;
#: NVLink 4 900 GB/s per GPU (360 GB/s taken as nccl-tests' all-reduce bus bandwidth on 8
#: GPUs); 8 x 400 Gb/s InfiniBand per node (45 GB/s bus bandwidth per GPU across nodes).
#: Efficiency 40 % of peak (torchtitan reports 38-43 % MFU for Llama 3 8B-70B on H100s).
PRESETS = {
    "8xh100": Cluster("8xH100", 1, memory=80 * 10 ** 9, **_H100,
                      peak_note="H100 SXM: 989 TFLOP/s bf16 x 40 %, 80 GB"),
    "8xh200": Cluster("8xH200", 1, memory=141 * 10 ** 9,
                      **{**_H100, "memory_bw": 4.8e12},
                      peak_note="H200 SXM: 989 TFLOP/s bf16 x 40 %, 141 GB"),
}


def heap_family(layout: Layout) -> str:
    """Which of ``pp``, ``cp``, ``tp``, ``ep`` and sharded data parallel (``shard``: ZeRO-2/3,
    HSDP) ``layout`` uses, joined by ``+``; ``"dp"`` when none (DDP, ZeRO-1, one process)."""
    parts = [a for a in ("pp", "cp", "tp") if layout.degree(a) > 1]
    parts += ["ep"] * (layout.expert_degree > 1) + ["shard"] * layout.is_sharded
    return "+".join(parts) or "dp"


def measured_allowance(path: Path) -> tuple[int, float, dict[str, float] | None]:
    """(reserved bytes, heap_keep, heap_keep by family) of a CPU process here as
    benchmarks/planner.py measured them (``allowance`` in its JSON), for the allocator this
    process runs on; (0, 0.0, None) when not measured: the estimate then counts live tensors
    only."""
    if not path.exists():
        return 0, 0.0, None
    allowance = json.loads(path.read_text()).get("allowance") or {}
    if allowance.get("allocator") != host_allocator():
        return 0, 0.0, None
    return int(allowance["reserved"]), float(allowance["heap_keep"]), allowance.get("families")


def _measured_at(path: Path, key: str, processes: int) -> dict | None:
    """``key`` of benchmarks/planner.py's JSON where it was measured at ``processes``."""
    if not path.exists():
        return None
    measured = json.loads(path.read_text()).get(key) or {}
    return measured if measured.get("world") == processes else None


def measured_cp_sync(path: Path, processes: int) -> dict[int, float] | None:
    """{cp degree: seconds} a cp collective waits inside a step here as benchmarks/planner.py
    measured it (``cp_sync`` in its JSON, benchmarks/cp_sync.py) at ``processes`` processes;
    None when not measured at that many (the estimate then adds ``drift``)."""
    measured = _measured_at(path, "cp_sync", processes)
    if measured is None:
        return None
    return {int(degree): float(seconds) for degree, seconds in measured["cp_sync"].items()}


def measured_pp_core_use(path: Path, processes: int) -> float:
    """A pipeline's core use over data parallel's here as benchmarks/planner.py measured it
    (``pp_core_use`` in its JSON, benchmarks/pp_core_use.py) at ``processes`` processes; 1.0
    when not measured at that many."""
    measured = _measured_at(path, "pp_core_use", processes)
    return 1.0 if measured is None else float(measured["pp_core_use"])


def host_allocator() -> str:
    """"jemalloc" or "tcmalloc" when this process runs on one (``LD_PRELOAD``), else "glibc"."""
    maps = Path("/proc/self/maps")
    text = maps.read_text() if maps.exists() else ""
    return next((name for name in ("jemalloc", "tcmalloc") if f"lib{name}" in text), "glibc")


def this_machine(processes: int, comm: str | Path | None = None) -> Cluster:
    """This machine running ``processes`` CPU processes of one torch thread each: compute from
    a matmul probe (the estimate replaces it by the job's own model timed,
    meshtrain.plan.calibrate), shared by the processes when they outnumber the cores;
    communication from a ``meshtrain bench comm`` table, the one measured at ``processes``
    (results/bench_comm_<processes>.json) when there is one."""
    cores = len(os.sched_getaffinity(0))
    results = Path(__file__).parents[2] / "benchmarks/results"
    # a table measured at this many processes when there is one: on a machine with fewer
    # cores than processes, a collective waits for every process to be scheduled
    path = Path(comm) if comm else next(
        (p for p in (results / f"bench_comm_{processes}.json", results / "bench_comm.json")
         if p.exists()), results / "bench_comm.json")
    if not path.exists():
        raise ConfigError(f"{path} does not exist: measure this machine's collectives first with "
                          f"`meshtrain bench comm --devices 2 --json {path}`")
    data = json.loads(path.read_text())
    table: dict[str, list] = {}
    for row in data["rows"]:
        table.setdefault(row["op"], []).append((row["bytes"], row["seconds"]))
    shared: dict[str, list] = {}  # (a table measured before shared memory has none)
    for row in data.get("shared_rows", []):
        shared.setdefault(row["op"], []).append((row["bytes"], row["seconds"]))
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    share = min(1.0, cores / processes)
    reserved, heap_keep, families = measured_allowance(results / "planner.json")
    cp_sync = measured_cp_sync(results / "planner.json", processes)
    pp_core_use = measured_pp_core_use(results / "planner.json", processes) if share < 1 else 1.0
    flops = matmul_flops() * share
    return Cluster("this-machine", 1, processes, memory=memory // processes, flops=flops,
                   compute_share=share, drift=data.get("drift_seconds", 0.0), cp_sync=cp_sync,
                   pp_core_use=pp_core_use,
                   intra_bw=1e9, inter_bw=1e9, latency=1e-4, reserved=reserved,
                   heap_keep=heap_keep, heap_keep_by_family=families, overlap=0.0,
                   memory_bw=5e9 * min(1.0, cores / processes), dtype="fp32",
                   comm_table={op: sorted(rows) for op, rows in table.items()},
                   shared_table={op: sorted(rows) for op, rows in shared.items()} or None,
                   table_ranks=data["world_size"],
                   peak_note=f"{cores} cores, fp32 matmul probe, {path.name}")


def matmul_flops(size: int = 512, seconds: float = 0.3) -> float:
    """fp32 FLOP/s of one thread on a ``size`` x ``size`` matmul, measured."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        a, b = torch.randn(size, size), torch.randn(size, size)
        a @ b
        count, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds:
            a @ b
            count += 1
        return 2 * size ** 3 * count / (time.perf_counter() - start)
    finally:
        torch.set_num_threads(threads)


def gib(size: float) -> str:
    return f"{size / GIB:.1f}" if size < 100 * GIB else f"{math.ceil(size / GIB)}"
