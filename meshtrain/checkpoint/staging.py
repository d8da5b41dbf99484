"""Staging for asynchronous checkpoints: one host copy of the state, reused, filled in the
background, checked for NaN/Inf there.

An asynchronous save must write the state as it was at save time while training goes on. DCP's
default stager copies the whole state into fresh CPU memory before ``async_save`` returns, so
training waits for the copy (and, on the CPU, for page faults of a fresh buffer as big as the
rank's state). :class:`HostStager` instead keeps one host buffer per tensor from one save to
the next (pinned on a GPU, so the copy is a non-blocking DMA), and makes the copy in a
background thread while the next step's forward and backward run: the parameters and
optimizer state are read there, never written, so the copy only has to be finished before the
next optimizer update (:meth:`HostStager.wait`, which the Trainer calls there, as torchtitan
calls ``maybe_wait_for_staging``). Model buffers, which a forward may update in place (batch
norm statistics), are copied at once. The NaN/Inf check, which refuses to write a checkpoint
holding non-finite values, runs on the staged copy in the same background thread; a refusal
surfaces when the save is committed.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.checkpoint.staging import AsyncStager

from meshtrain.errors import MeshtrainError


class NonFiniteState(MeshtrainError):
    """The staged state holds NaN/Inf values on some rank: the checkpoint is not written."""


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _tensors(obj, path=()):
    """(path, tensor) of every tensor in a nested dict/list state."""
    if isinstance(obj, torch.Tensor):
        yield path, obj
    elif isinstance(obj, dict):
        for key, value in obj.items():
            yield from _tensors(value, (*path, key))
    elif isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            yield from _tensors(value, (*path, i))


def _layout(state: dict) -> tuple:
    """What decides whether the buffers of an earlier save fit this state."""
    return tuple((path, type(t).__name__, tuple(_local(t).shape), t.dtype)
                 for path, t in _tensors(state))


def staged_all_finite(state: dict, group) -> bool:
    """Collective over ``group`` (if any): whether every rank's staged floating-point tensors
    are finite."""
    extremes = [r for _, t in _tensors(state) for r in (_local(t),)
                if r.is_floating_point() and r.numel() for r in (r.amax(), r.amin())]
    finite = bool(torch.isfinite(torch.stack(extremes)).all()) if extremes else True
    if group is not None:
        flag = torch.tensor([0 if finite else 1], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        finite = not flag.item()
    return finite


def _empty_like(state, allocate):
    """``state`` with each tensor replaced by an uninitialised host tensor of its (local)
    shape, ``allocate(shape, dtype)``; a DTensor by a DTensor of the same placements around
    one. Nothing is written (ordinary memory is only faulted in by the first copy, in the
    background; shared buffers take their pages when made)."""
    if isinstance(state, torch.Tensor):
        local = _local(state)
        buffer = allocate(local.shape, local.dtype)
        if local is state:
            return buffer
        return DTensor.from_local(buffer, state.device_mesh, state.placements, run_check=False,
                                  shape=state.shape, stride=state.stride())
    if isinstance(state, dict):
        return {key: _empty_like(value, allocate) for key, value in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(_empty_like(value, allocate) for value in state)
    return state


def _with_buffers(state, buffers):
    """``state`` with each tensor replaced by its buffer (other values kept)."""
    if isinstance(state, torch.Tensor):
        return buffers
    if isinstance(state, dict):
        return {key: _with_buffers(value, buffers[key]) for key, value in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(_with_buffers(v, b) for v, b in zip(state, buffers))
    return state


class HostStager(AsyncStager):
    """DCP stager with reusable host buffers and a background copy (see the module docstring).

    ``stage(state)`` returns a Future of the staged state. Tensors under ``state["model"]``
    whose storage is not one of ``parameters`` (data pointers) may change before the next
    update (model buffers): those are copied before ``stage`` returns. ``check``: run the
    NaN/Inf check on the staged copy, agreed over ``check_group`` (None: this rank alone).
    ``shared``: a :class:`meshtrain.checkpoint.writer_process.SharedBuffers` the buffers come
    from (shared memory that a writer process maps), else ordinary (pinned) host memory.
    """

    _synchronize_after_execute = False

    def __init__(self, *, pin_memory: bool = False, shared=None):
        self.pin_memory, self.shared = pin_memory, shared
        self._buffers: dict | None = None
        self._layout: tuple | None = None
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="meshtrain-staging")
        self._future: Future | None = None
        self.parameters: set[int] = set()
        self.check_group = None
        self.check = False

    def stage(self, state_dict: dict) -> Future:
        self.wait()
        layout = _layout(state_dict)
        if layout != self._layout:  # first save, or the state changed shape: new buffers
            if self.shared is not None:
                self.shared.clear()  # the earlier set's buffers go with their registration
            self._buffers = _empty_like(state_dict, self._allocate)
            self._layout = layout
        buffers = dict(_tensors(self._buffers))
        pairs = [(_local(buffers[path]), _local(tensor), self._volatile(path, tensor))
                 for path, tensor in _tensors(state_dict)]
        for buffer, tensor, volatile in pairs:
            if volatile:
                buffer.copy_(tensor)
        staged = _with_buffers(state_dict, self._buffers)
        self._future = self._executor.submit(self._copy, pairs, staged)
        return self._future

    def _allocate(self, shape, dtype: torch.dtype) -> torch.Tensor:
        if self.shared is not None:
            return self.shared.empty(shape, dtype)
        return torch.empty(shape, dtype=dtype, device="cpu", pin_memory=self.pin_memory)

    def _volatile(self, path: tuple, tensor: torch.Tensor) -> bool:
        return (path[:1] == ("model",)
                and _local(tensor).untyped_storage().data_ptr() not in self.parameters)

    def _copy(self, pairs: list, staged: dict) -> dict:
        for buffer, tensor, volatile in pairs:
            if not volatile:
                buffer.copy_(tensor, non_blocking=self.pin_memory)
        if self.pin_memory:
            torch.cuda.synchronize()
        if self.check and not staged_all_finite(staged, self.check_group):
            raise NonFiniteState("the model or optimizer state holds NaN/Inf values "
                                 "(on at least one rank)")
        return staged

    def wait(self) -> float:
        """Block until the last staging copy is done; seconds waited. (A failed copy or check
        is reported by the save's own future, not here.)"""
        future, self._future = self._future, None
        if future is None or future.done():
            return 0.0
        start = time.perf_counter()
        try:
            future.result()
        except Exception:
            pass
        return time.perf_counter() - start

    def synchronize_staging(self) -> None:
        self.wait()

    def close(self) -> None:
        self.wait()
        self._executor.shutdown(wait=True)
