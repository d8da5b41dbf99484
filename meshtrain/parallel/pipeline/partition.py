"""Automatic pipeline partitioning: which contiguous run of blocks each stage gets.

A pipeline is as fast as its slowest stage and needs as much memory per device as its heaviest
one, so the blocks are split into ``num_stages`` contiguous groups whose largest cost is as small
as possible (the min-max, or "linear partition", problem). The costs are measured forward+backward
seconds (``balance="time"``), parameter counts (``"params"``) or parameter plus activation bytes
(``"memory"``). The embedding and the head can be charged to the first and last block, since
they run on the first and last stage.

Split points are the first block index of stages ``1 .. K-1``: ``[3, 6]`` splits 9 blocks into
``[0, 3)``, ``[3, 6)``, ``[6, 9)``.
"""

from __future__ import annotations

import contextlib
import math
import numbers
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from fractions import Fraction

import torch
import torch.nn as nn

from meshtrain.errors import ConfigError

BALANCES = ("time", "params", "memory")


# ---------------------------------------------------------------------------------------------
# The exact min-max partition
# ---------------------------------------------------------------------------------------------
def _exact_costs(costs: Sequence[float]) -> list[int]:
    """The costs as integers proportional to their exact values (floats are dyadic rationals),
    so that sums and comparisons below have no rounding at all."""
    exact = []
    for i, cost in enumerate(costs):
        value = int(cost) if isinstance(cost, numbers.Integral) else float(cost)
        if not math.isfinite(value) or value < 0:
            raise ConfigError(f"block costs must be finite and non-negative, got {cost!r} for "
                              f"block {i}; check how the costs were measured")
        exact.append(Fraction(value))
    scale = math.lcm(*(f.denominator for f in exact)) if exact else 1
    return [f.numerator * (scale // f.denominator) for f in exact]


def _check_num_stages(num_stages: int, num_blocks: int) -> None:
    if not isinstance(num_stages, int) or isinstance(num_stages, bool) or num_stages < 1:
        raise ConfigError(f"num_stages must be a positive integer, got {num_stages!r}")
    if num_stages > num_blocks:
        raise ConfigError(f"pp={num_stages} needs at least {num_stages} blocks; the model has "
                          f"{num_blocks} — use fewer stages or split blocks")


def min_max_partition(costs: Sequence[float], num_stages: int) -> list[int]:
    """Split points of the contiguous ``num_stages``-way partition of ``costs`` (one per block,
    in order, every stage non-empty) whose largest stage sum is the smallest possible.

    Exact dynamic programming over (stages, blocks covered). Tie-break, deterministic: among the
    optimal partitions, the one whose stage sums sorted from largest to smallest are
    lexicographically smallest (smallest maximum, then smallest second-largest, ...: the most
    even), then the one with lexicographically smallest split points. Sums are compared on the
    exact values of the floats, so rounding neither makes nor breaks a tie. Worst case
    O(K²·n²) for n blocks and K stages; pruning makes it far faster in practice.
    """
    values = _exact_costs(costs)
    n = len(values)
    _check_num_stages(num_stages, n)
    prefix = [0]
    for value in values:
        prefix.append(prefix[-1] + value)
    # best[j]: for the first j blocks in k stages, (stage sums sorted descending, split points).
    # Adding one more stage sum to two such keys keeps their order, so extending the best
    # prefix for each position of the last split gives the best whole partition.
    best: list = [None] + [((prefix[j],), ()) for j in range(1, n + 1)]
    for k in range(2, num_stages + 1):
        new: list = [None] * (n + 1)
        last_j = n - (num_stages - k)  # leave at least one block for each later stage
        for j in range(k if k < num_stages else n, last_j + 1):
            chosen = None
            for i in range(j - 1, k - 2, -1):  # the last stage is blocks [i, j)
                last = prefix[j] - prefix[i]
                if chosen is not None and last > chosen[0][0]:
                    break  # the last stage only grows as i falls (costs are non-negative)
                sums, splits = best[i]
                if chosen is not None and sums[0] > chosen[0][0]:
                    continue
                key = (tuple(sorted((*sums, last), reverse=True)), (*splits, i))
                if chosen is None or key < chosen:
                    chosen = key
            new[j] = chosen
        best = new
    return list(best[n][1])


def _check_split_points(split_points: Sequence[int], num_blocks: int, num_stages: int) -> None:
    points = list(split_points)
    bad_type = [p for p in points if not isinstance(p, int) or isinstance(p, bool)]
    if len(points) != num_stages - 1 or bad_type:
        raise ConfigError(f"split_points must be {num_stages - 1} integers for {num_stages} "
                          f"stages (the first block of stages 1..{num_stages - 1}), got {points}")
    bounds = [0, *points, num_blocks]
    if any(a >= b for a, b in zip(bounds, bounds[1:])):
        raise ConfigError(f"split_points {points} must be strictly increasing and within "
                          f"1..{num_blocks - 1} for {num_blocks} blocks, so every stage "
                          f"gets at least one block")


def stage_costs(costs: Sequence[float], split_points: Sequence[int]) -> list[float]:
    """The summed cost of each stage for the given split points."""
    costs = [float(c) for c in costs]
    _check_split_points(split_points, len(costs), len(split_points) + 1)
    bounds = [0, *split_points, len(costs)]
    return [math.fsum(costs[a:b]) for a, b in zip(bounds, bounds[1:])]


# ---------------------------------------------------------------------------------------------
# Block costs
# ---------------------------------------------------------------------------------------------
def block_param_counts(blocks: Sequence[nn.Module]) -> list[int]:
    """Number of parameter elements in each block."""
    return [sum(p.numel() for p in block.parameters()) for block in blocks]


@contextlib.contextmanager
def _untouched(blocks: Sequence[nn.Module], device: torch.device) -> Iterator[None]:
    """Measure without side effects: parameter ``.grad`` and the RNG state are restored."""
    params = [p for block in blocks for p in block.parameters()]
    grads = [p.grad for p in params]
    for p in params:
        p.grad = None
    devices = [device] if device.type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=devices, device_type=device.type):
            yield
    finally:
        for p, grad in zip(params, grads):
            p.grad = grad


def _run(block: nn.Module, x: torch.Tensor, index: int) -> torch.Tensor:
    out = block(x)
    if not isinstance(out, torch.Tensor):
        raise ConfigError(f"block {index} returned {type(out).__name__}; measuring costs needs "
                          f"blocks that map a tensor to a tensor (use balance='params')")
    return out


def _leaf(x: torch.Tensor) -> torch.Tensor:
    return x.detach().requires_grad_(x.is_floating_point())


def block_memory_costs(blocks: Sequence[nn.Module], sample_input: torch.Tensor, *,
                       dtype_bytes: int = 4) -> list[float]:
    """Bytes per block: ``dtype_bytes`` per parameter plus the activations the block saves for
    backward, measured by running the blocks in sequence on ``sample_input`` (the hidden state
    entering the first block) under ``saved_tensors_hooks``. Saved tensors are counted once per
    storage, parameters excluded."""
    param_storages = {p.untyped_storage().data_ptr() for b in blocks for p in b.parameters()}
    counts = block_param_counts(blocks)
    costs = []
    with _untouched(blocks, sample_input.device):
        x = sample_input
        for index, block in enumerate(blocks):
            saved: dict[int, int] = {}

            def pack(t: torch.Tensor) -> torch.Tensor:
                storage = t.untyped_storage()
                if storage.data_ptr() not in param_storages:
                    saved[storage.data_ptr()] = storage.nbytes()
                return t

            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                x = _run(block, _leaf(x), index)
            costs.append(float(dtype_bytes * counts[index] + sum(saved.values())))
    return costs


class _CudaEventClock:
    """Seconds between consecutive calls, from CUDA events on the current stream: each call
    records an event; the second of a pair waits for it and returns the time since the first
    (``clock() - start`` in :func:`block_time_costs` then reads that elapsed time)."""

    def __init__(self, device: torch.device):
        self.device, self.start = device, None

    def __call__(self) -> float:
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        if self.start is None:
            self.start = event
            return 0.0
        event.synchronize()
        elapsed, self.start = self.start.elapsed_time(event) / 1e3, None
        return elapsed


def _clock_for(device: torch.device) -> Callable[[], float]:
    """The clock :func:`block_time_costs` uses by default on ``device`` (see there)."""
    if device.type == "cuda":
        return _CudaEventClock(device)
    single_cpu_thread = device.type == "cpu" and torch.get_num_threads() == 1
    return time.thread_time if single_cpu_thread else time.perf_counter


def block_time_costs(blocks: Sequence[nn.Module], sample_input: torch.Tensor, *,
                     repeats: int = 3, warmup: int = 1,
                     clock: Callable[[], float] | None = None) -> list[float]:
    """Median forward+backward seconds of each block, timed one block at a time (each with its
    own backward) on the input it gets when the blocks run in sequence on ``sample_input``.

    Each round times every block once, so a burst of load from elsewhere hits them alike. The
    clock: on a GPU, CUDA events recorded on the stream around the block (the kernels' time,
    not the launching); on the CPU with one torch thread, that thread's CPU time (all of the
    work runs on it), which other processes cannot inflate. ``clock`` replaces it (any function
    returning seconds; tests pass a fake one).
    """
    if repeats < 1 or warmup < 0:
        raise ConfigError(f"need repeats >= 1 and warmup >= 0, got repeats={repeats}, "
                          f"warmup={warmup}")
    device = sample_input.device
    clock = clock or _clock_for(device)
    times: list[list[float]] = [[] for _ in blocks]
    with _untouched(blocks, device):
        inputs, x = [], sample_input
        with torch.no_grad():
            for index, block in enumerate(blocks):
                inputs.append(x)
                x = _run(block, x, index)
        for round_ in range(warmup + repeats):
            for index, (block, x) in enumerate(zip(blocks, inputs)):
                x = _leaf(x)
                start = clock()
                out = _run(block, x, index)
                if out.requires_grad:
                    out.backward(torch.ones_like(out))
                if round_ >= warmup:
                    times[index].append(clock() - start)
                for p in block.parameters():
                    p.grad = None
    return [statistics.median(t) for t in times]


def agreed_costs(costs: Sequence[float], group, device: torch.device) -> list[float]:
    """One set of costs for every rank of ``group``: each rank's measurements are gathered and
    each block's cost is their median over the ranks (the same numbers, in the same order, on
    every rank, so the same split everywhere; a burst of load on one rank counts less). A
    collective: every rank of ``group`` must call it. Without a process group (or alone) the
    costs stay as they are."""
    import torch.distributed as dist

    costs = [float(c) for c in costs]
    if group is None or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return costs
    mine = torch.tensor(costs, dtype=torch.float64, device=device)
    parts = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, mine, group=group)
    return [statistics.median(column) for column in torch.stack(parts).cpu().T.tolist()]


# ---------------------------------------------------------------------------------------------
# Entry point
# ---------------------------------------------------------------------------------------------
def partition_blocks(blocks: Sequence[nn.Module], num_stages: int, *, balance: str = "time",
                     sample_input: torch.Tensor | None = None,
                     split_points: Sequence[int] | None = None, first_extra_cost: float = 0.0,
                     last_extra_cost: float = 0.0, group=None) -> list[int]:
    """Split points for running ``blocks`` (in order) as a ``num_stages``-stage pipeline.

    ``split_points`` given: checked and returned as they are (manual override). Otherwise each
    block's cost is measured by ``balance`` ("time": :func:`block_time_costs`, "params":
    :func:`block_param_counts`, "memory": :func:`block_memory_costs`; "time" and "memory" run
    the blocks on ``sample_input``, the hidden state that enters the first block) and
    :func:`min_max_partition` solves it. ``first_extra_cost`` / ``last_extra_cost``, in the
    same unit, are added to the first / last block: the embedding and the head.

    ``group``: the process group whose ranks must all get the same split (every rank holding a
    stage: the whole job). Measured costs differ from rank to rank, so under "time" and
    "memory" they are agreed over it first (:func:`agreed_costs`, a collective).
    """
    blocks = list(blocks)
    _check_num_stages(num_stages, len(blocks))
    if split_points is not None:
        _check_split_points(split_points, len(blocks), num_stages)
        return list(split_points)
    if balance not in BALANCES:
        raise ConfigError(f"unknown balance {balance!r}; choose one of {', '.join(BALANCES)}")
    for name, extra in (("first_extra_cost", first_extra_cost),
                        ("last_extra_cost", last_extra_cost)):
        if not math.isfinite(extra) or extra < 0:
            raise ConfigError(f"{name} must be finite and non-negative, got {extra!r}")
    if balance == "params":
        costs = [float(c) for c in block_param_counts(blocks)]
    elif sample_input is None:
        raise ConfigError(f"balance={balance!r} measures the blocks, so it needs sample_input "
                          f"(the hidden-state tensor that enters the first block); pass one, "
                          f"or use balance='params'")
    elif balance == "time":
        costs = block_time_costs(blocks, sample_input)
    else:
        costs = block_memory_costs(blocks, sample_input)
    if balance != "params":
        costs = agreed_costs(costs, group, sample_input.device)
    costs[0] += first_extra_cost
    costs[-1] += last_extra_cost
    return min_max_partition(costs, num_stages)
