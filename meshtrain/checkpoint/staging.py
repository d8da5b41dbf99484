"""Staging for asynchronous checkpoints: torch's ``DefaultStager`` (one host copy of the
state, kept from save to save, filled in its background thread) with a training run's checks.

An asynchronous save must write the state as it was at save time while training goes on. The
parameters and optimizer state are read by the copy, never written, so it only has to be
finished before the next optimizer update (:meth:`CheckedStager.wait`, which the Trainer calls
there, as torchtitan calls ``maybe_wait_for_staging``). Model buffers, which a forward may
update in place (batch norm statistics), are cloned at once. The NaN/Inf check, which refuses
to write a checkpoint holding non-finite values, runs on the staged copy in the stager's
thread; a refusal surfaces when the save is committed.

Until 2026-11-28 meshtrain kept its own stager and, on CPU, a writer process per rank (458
lines); torch's stager and DCP's thread writer measured the same in the same run
(benchmarks/README.md, "Checkpoint save/load"), so they were replaced.
"""

from __future__ import annotations

import time
from concurrent.futures import Future

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.staging import AsyncStager, DefaultStager, StagingOptions
from torch.distributed.tensor import DTensor

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


class CheckedStager(AsyncStager):
    """torch's :class:`~torch.distributed.checkpoint.staging.DefaultStager` (host buffers
    cached from save to save, the copy in its background thread; pinned and non-blocking on a
    GPU) with what a training run needs around it: model buffers, which a forward may update
    in place (batch-norm statistics), are cloned before ``stage`` returns; the NaN/Inf check
    runs on the staged copy in the background, agreed over ``check_group``."""

    _synchronize_after_execute = False

    def __init__(self, *, on_gpu: bool = False):
        self.inner = DefaultStager(StagingOptions(
            use_pinned_memory=on_gpu, use_shared_memory=False, use_async_staging=True,
            use_non_blocking_copy=on_gpu))
        self._future: Future | None = None
        self.parameters: set[int] = set()
        self.check_group = None
        self.check = False

    def stage(self, state_dict: dict) -> Future:
        self.wait()
        state_dict = _clone_volatile(state_dict, self.parameters)
        staged, result = self.inner.stage(state_dict), Future()

        def checked(future: Future) -> None:  # (in the stager's thread, after the copy)
            try:
                state = future.result()
                if self.check and not staged_all_finite(state, self.check_group):
                    raise NonFiniteState("the model or optimizer state holds NaN/Inf values "
                                         "(on at least one rank)")
                result.set_result(state)
            except BaseException as exc:  # noqa: BLE001 - reported by the save's future
                result.set_exception(exc)

        staged.add_done_callback(checked)
        self._future = result
        return result

    def wait(self) -> float:
        """Block until the last staging copy (and its check) is done; seconds waited. (A
        failed copy or check is reported by the save's own future, not here.)"""
        future, self._future = self._future, None
        if future is None or future.done():
            return 0.0
        start = time.perf_counter()
        try:
            future.result()
        except Exception:  # noqa: BLE001
            pass
        return time.perf_counter() - start

    def synchronize_staging(self) -> None:
        self.wait()

    def close(self) -> None:
        self.wait()
        self.inner.close()


def _clone_volatile(state: dict, parameters: set[int]) -> dict:
    """``state`` with every tensor under ``"model"`` whose storage is not a parameter's
    (``parameters``: data pointers) replaced by a copy made now."""
    def clone(obj):
        if isinstance(obj, torch.Tensor):
            local = _local(obj)
            if local.untyped_storage().data_ptr() in parameters:
                return obj
            copy = local.clone()
            if local is obj:
                return copy
            return DTensor.from_local(copy, obj.device_mesh, obj.placements, run_check=False,
                                      shape=obj.shape, stride=obj.stride())
        if isinstance(obj, dict):
            return {key: clone(value) for key, value in obj.items()}
        if isinstance(obj, (list, tuple)):
            return type(obj)(clone(value) for value in obj)
        return obj

    if "model" not in state:
        return state
    return {**state, "model": clone(state["model"])}
