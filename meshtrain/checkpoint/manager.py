"""The one checkpoint writer: periodic, best-k, last and final saves, all atomic (torch
distributed checkpoint, DCP); periodic ones optionally asynchronous.

A :class:`CheckpointManager` saves ``<directory>/step_00000012`` every N steps and/or every N
minutes, keeps the last k, and never leaves a half-written folder that looks complete: every
save goes into ``.tmp-<name>`` and is renamed by rank 0 once all ranks have written.

With ``async_save=True`` the model and optimizer state is copied into host buffers kept from
save to save, in a background thread while the next step's forward and backward run (torch's
``DefaultStager``, with meshtrain's checks around it: ``staging.py``;
:meth:`CheckpointManager.before_update` waits for the copy and the Trainer calls it before
each optimizer update), then written by DCP in a background thread while training goes on;
one save is in flight at most. The caller commits
it once every rank's write is done (:meth:`~CheckpointManager.poll` on every rank, then
:meth:`~CheckpointManager.commit`), or blocks for it with :meth:`~CheckpointManager.wait`.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import time
import warnings
from concurrent.futures import Future
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
from torch.distributed.optim import ZeroRedundancyOptimizer

from meshtrain.checkpoint.state import (
    SUMMARY,
    TRAINER_STATE,
    _barrier,
    _quiet_single_process,
    _rank,
    checkpoint_state,
    commit_tmp,
    prepare_tmp,
    tmp_path,
    write_extras,
)
from meshtrain.checkpoint.save_errors import (
    CheckpointWriteError,
    FaultWriter,
    any_rank_failed,
    describe_failure,
    failures_of,
    refused_write,
)
from meshtrain.checkpoint.staging import CheckedStager, NonFiniteState
from meshtrain.errors import ConfigError
from meshtrain.fault.inject import ARMED

DCP_METADATA = ".metadata"
_now = time.monotonic  # (the tests replace it)
_STEP_NAME = re.compile(r"step_(\d+)$")


def checkpoint_name(step: int) -> str:
    """The folder name of the checkpoint at ``step``: ``step_00000012``."""
    return f"step_{int(step):08d}"


def checkpoint_step(folder: Path) -> int | None:
    """The step of a complete checkpoint folder, or None if it is not one."""
    if folder.name.startswith(".") or not folder.is_dir():
        return None
    if not all((folder / f).is_file() for f in (TRAINER_STATE, SUMMARY, DCP_METADATA)):
        return None
    try:
        step = json.loads((folder / SUMMARY).read_text()).get("step")
        if isinstance(step, int) and not isinstance(step, bool):
            return step
    except (OSError, ValueError, AttributeError):
        return None
    match = _STEP_NAME.match(folder.name)
    return int(match.group(1)) if match else None


def list_complete(directory: str | os.PathLike) -> list[Path]:
    """Complete checkpoints in ``directory`` (``step_*``, ``final``, ...), oldest to newest.

    Sorted by step, then by modification time; ``.tmp-*`` and incomplete folders are left out.
    """
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = []
    for folder in directory.iterdir():
        try:
            step = checkpoint_step(folder)
            if step is not None:
                found.append((step, folder.stat().st_mtime, folder.name, folder))
        except OSError:  # removed meanwhile (pruned by rank 0)
            continue
    return [entry[-1] for entry in sorted(found)]


def latest_complete(directory: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint in ``directory``, or None."""
    complete = list_complete(directory)
    return complete[-1] if complete else None


def young_daly_interval_s(save_cost_s: float, mtbf_s: float) -> float:
    """Young/Daly's optimal time between checkpoints: sqrt(2 * save cost * MTBF)."""
    if not (math.isfinite(save_cost_s) and save_cost_s >= 0):
        raise ConfigError(f"save_cost_s must be a finite number >= 0, got {save_cost_s!r}")
    if not (math.isfinite(mtbf_s) and mtbf_s > 0):
        raise ConfigError(f"mtbf_s (mean time between failures) must be > 0, got {mtbf_s!r}")
    return math.sqrt(2.0 * save_cost_s * mtbf_s)


def _positive_int(name: str, value) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ConfigError(f"{name} must be a positive integer or None, got {value!r}")


def check_options(*, every_n_steps=None, every_n_minutes=None, keep_last_k=None,
                  async_save=False) -> None:
    """The manager's settings, checkable before any process starts (the Trainer does)."""
    _positive_int("every_n_steps", every_n_steps)
    if every_n_minutes is not None and (
        isinstance(every_n_minutes, bool) or not isinstance(every_n_minutes, (int, float))
        or not math.isfinite(every_n_minutes) or every_n_minutes <= 0
    ):
        raise ConfigError(f"every_n_minutes must be a number > 0 or None, got {every_n_minutes!r}")
    _positive_int("keep_last_k", keep_last_k)
    if not isinstance(async_save, bool):
        raise ConfigError(f"async_save must be True or False, got {async_save!r}")


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def local_all_finite(model: torch.nn.Module, optimizer) -> bool:
    """Local: whether this rank's parameters and floating-point optimizer state are finite."""
    tensors = [_local(p.detach()) for p in model.parameters()]
    if optimizer is not None:
        inner = optimizer.optim if isinstance(optimizer, ZeroRedundancyOptimizer) else optimizer
        for state in inner.state.values():
            tensors += [_local(v) for v in state.values() if isinstance(v, torch.Tensor)]
    by_device: dict[torch.device, list[torch.Tensor]] = {}  # Adam's `step` stays on the CPU
    for t in tensors:
        if t.is_floating_point() and t.numel():
            by_device.setdefault(t.device, []).extend((t.amax(), t.amin()))  # NaN propagates
    return all(bool(torch.isfinite(torch.stack(extremes)).all())
               for extremes in by_device.values())


def all_finite(model: torch.nn.Module, optimizer) -> bool:
    """Collective when a process group exists: False if any rank holds NaN/Inf values."""
    finite = local_all_finite(model, optimizer)
    if dist.is_initialized():
        # on the parameters' device: NCCL reduces GPU tensors only
        device = next((_local(p).device for p in model.parameters()), torch.device("cpu"))
        flag = torch.tensor([0 if finite else 1], dtype=torch.int32, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        finite = not flag.item()
    return finite


class CheckpointManager:
    """Periodic atomic checkpoints in ``directory``; see the module docstring.

    Args:
        every_n_steps: a save is due at steps divisible by this (or None).
        every_n_minutes: a save is due this long after the last one started (or None).
        keep_last_k: after each commit, delete all but the newest k ``step_*`` checkpoints.
        async_save: copy and write in the background (DCP ``async_save`` with
            :class:`~meshtrain.checkpoint.staging.CheckedStager`); call :meth:`before_update`
            before changing the model or optimizer state after a save.
        process_group: the group DCP's own collectives use. With ``async_save`` it should be a
            gloo group of its own so the background write never interleaves with training
            collectives; if None one is created (collectively) at the first save.
    """

    def __init__(self, directory, *, every_n_steps=None, every_n_minutes=None, keep_last_k=None,
                 async_save=False, process_group=None):
        check_options(every_n_steps=every_n_steps, every_n_minutes=every_n_minutes,
                      keep_last_k=keep_last_k, async_save=async_save)
        self.directory = Path(directory)
        self.every_n_steps, self.every_n_minutes = every_n_steps, every_n_minutes
        self.keep_last_k, self.async_save = keep_last_k, async_save
        self.process_group = process_group
        self.last_blocking_s: float | None = None  # time the last save() kept its caller
        self.last_save_s: float | None = None  # start of the last save to its commit
        self._last_start = _now()
        self._pending: tuple[Future, int, Path, Path, float] | None = None
        self._last_written: tuple[Path, int] | None = None  # (folder, step) of the last save
        self._stager: CheckedStager | None = None  # background saves' host copy (staging.py)
        self.on_commit = None  # called with (folder, step, seconds) when a save is in place
        self.extra_state = None  # () -> {name: state}: the callbacks' state, saved as "callbacks"

    @classmethod
    def from_settings(cls, directory, settings: dict) -> CheckpointManager:
        """The Trainer's writer, from its ``checkpoint`` settings (collective: with
        ``async_checkpoint``, DCP's collectives of a background write get a gloo group of
        their own, created here, so they never interleave with the training step's)."""
        async_save = settings["async_checkpoint"]
        group = dist.new_group(backend="gloo") if async_save and dist.is_initialized() else None
        return cls(directory, process_group=group, async_save=async_save,
                   every_n_steps=settings["checkpoint_every_n_steps"],
                   every_n_minutes=settings["checkpoint_every_n_minutes"],
                   keep_last_k=settings["keep_last_k"])

    # -- when ---------------------------------------------------------------------------------
    def due_by_steps(self, step: int) -> bool:
        return self.every_n_steps is not None and step % self.every_n_steps == 0

    def due_by_time(self) -> bool:
        """Local: whether every_n_minutes have passed since the last save started."""
        if self.every_n_minutes is None:
            return False
        return _now() - self._last_start >= 60.0 * self.every_n_minutes

    # -- saving -------------------------------------------------------------------------------
    def save(self, step: int, model, optimizer, trainer_state: dict, summary: dict) -> bool:
        """Collective: save (or start saving, with ``async_save``) the periodic checkpoint of
        ``step`` as ``<directory>/step_00000012``; False if refused (NaN/Inf values)."""
        path = self.save_to(self.directory / checkpoint_name(step), step, model, optimizer,
                            trainer_state, summary, background=self.async_save)
        return path is not None

    def save_to(self, path, step: int, model, optimizer, trainer_state: dict, summary: dict, *,
                background: bool = False) -> Path | None:
        """Collective: write the state of ``step`` into the folder ``path``, atomically.

        Every save goes through here: periodic, best-k, last and final. A folder that holds
        NaN/Inf values is never written (None is returned, with a warning); the folder this
        writer last wrote is not written again for the same step. ``background``: an
        asynchronous write, committed by :meth:`commit` or :meth:`wait`. A write the file
        system refuses (full, no permission) raises CheckpointWriteError on every rank, with
        the path and the space (save_errors.py); the last complete checkpoint is kept.
        """
        path, start = Path(path), _now()
        self.wait()
        if self._last_written == (path, step):
            return path
        if not background and not all_finite(model, optimizer):  # (background: when staged)
            warnings.warn(f"checkpoint of step {step} not saved to {path}: the model or "
                          "optimizer state holds NaN/Inf values (on at least one rank)",
                          stacklevel=3)
            self.last_blocking_s = _now() - start
            return None
        if path.parent == self.directory and _STEP_NAME.match(path.name):
            self._last_start = start  # the clock of every_n_minutes
        if background and self.process_group is None and dist.is_initialized():
            self.process_group = dist.new_group(backend="gloo")
        tmp = tmp_path(path)
        state = checkpoint_state(model, optimizer)
        if self.extra_state is not None and (extra := self.extra_state()):
            state["callbacks"] = extra
        device = next((_local(p).device for p in model.parameters()), torch.device("cpu"))
        for part in (lambda: prepare_tmp(tmp, agree=False),  # each rank's own files first,
                     lambda: write_extras(tmp, trainer_state, summary)):  # then agreed
            failed = any_rank_failed(refused_write(part), device)
            if failed:
                self._write_failed(step, tmp, failed, state)
        where = dict(checkpoint_id=tmp, process_group=self.process_group)
        if "checkpoint_shard" in ARMED:  # MESHTRAIN_FAULT (fault/inject.py)
            where = dict(storage_writer=FaultWriter(tmp, step), process_group=self.process_group)
        with _quiet_single_process():  # (an async save's thread may still warn, once)
            if not background:
                try:
                    dcp.save(state, **where)
                except (Exception, CheckpointException) as error:  # on every rank, by DCP
                    failed = failures_of(error, _rank())
                    if failed is None:  # not the file system's
                        raise
                    self._write_failed(step, tmp, failed, state, error)
            else:
                stager = self._host_stager(model)
                future = dcp.async_save(
                    state, async_checkpointer_type=AsyncCheckpointerType.THREAD,
                    async_stager=stager, **where)
                future = getattr(future, "upload_completion", future)  # an AsyncSaveResponse
                self._pending = (future, step, tmp, path, start)
        self._last_written = (path, step)
        if not background:
            # dcp.save returns on a rank only after every rank wrote (extras included) and the
            # coordinator wrote .metadata: the folder is complete.
            commit_tmp(tmp, path)
            self._prune(path)
            _barrier()
            if self.on_commit is not None:
                self.on_commit(path, step, _now() - start)
        self.last_blocking_s = _now() - start
        if not background:
            self.last_save_s = self.last_blocking_s
        return path

    def _write_failed(self, step: int, tmp: Path, failed: dict[int, str], state: dict,
                      error: BaseException | None = None):
        """(Every rank, alike.) Remove the partial folder (rank 0) and raise the error."""
        if _rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointWriteError(describe_failure(
            step, tmp, failed, state, latest_complete(self.directory))) from error

    def _host_stager(self, model) -> CheckedStager:
        """The stager of background saves (its host buffers reused from save to save; pinned
        on a GPU); the model's buffers are copied at once, everything else while the next step
        computes."""
        if self._stager is None:
            self._stager = CheckedStager(on_gpu=any(_local(p).is_cuda for p in model.parameters()))
        self._stager.parameters = {_local(p).untyped_storage().data_ptr()
                                   for p in model.parameters()}
        self._stager.check, self._stager.check_group = True, self.process_group
        return self._stager

    def before_update(self) -> float:
        """Block until an asynchronous save's copy of the state is made (call before anything
        changes the parameters or optimizer state); seconds blocked, also added to
        ``last_blocking_s``."""
        waited = self._stager.wait() if self._stager is not None else 0.0
        if waited and self.last_blocking_s is not None:
            self.last_blocking_s += waited
        return waited

    def written_at(self, step: int) -> Path | None:
        """The folder this writer last wrote, if it holds the state of ``step``."""
        if self._last_written is not None and self._last_written[1] == step:
            return self._last_written[0]
        return None

    @property
    def in_flight(self) -> bool:
        """An asynchronous save has started and is not committed yet."""
        return self._pending is not None

    def poll(self) -> bool:
        """Local, non-blocking: True if nothing is in flight or this rank's write is done."""
        return self._pending is None or self._pending[0].done()

    def commit(self) -> Path | None:
        """Finish the in-flight save once every rank's :meth:`poll` is True (no collective).

        Rank 0 renames the folder into place and prunes old checkpoints. Returns the
        committed folder, or None if nothing was in flight.
        """
        if self._pending is None:
            return None
        future, step, tmp, final, start = self._pending
        self._pending = None
        try:
            future.result()
        except NonFiniteState as exc:  # refused when staged, as a sync save refuses at once
            if _rank() == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            self._last_written = None
            warnings.warn(f"checkpoint of step {step} not saved to {final}: {exc}",
                          stacklevel=2)
            return None
        except BaseException as exc:
            if _rank() == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            failed = failures_of(exc, _rank())
            if failed is not None:  # the file system's: said as a sync save says it
                raise CheckpointWriteError(describe_failure(
                    step, tmp, failed, None, latest_complete(self.directory))) from exc
            raise CheckpointWriteError(
                f"the asynchronous checkpoint of step {step} could not be written to {tmp}: "
                f"{exc}") from exc
        commit_tmp(tmp, final)
        self._prune(final)
        self.last_save_s = _now() - start
        if self.on_commit is not None:
            self.on_commit(final, step, self.last_save_s)
        return final

    def wait(self) -> Path | None:
        """Collective: block until the in-flight save is written everywhere, then commit it."""
        if self._pending is None:
            return None
        final = self.commit()  # blocks in the future's result()
        _barrier()  # every rank sees the renamed folder
        return final

    # -- housekeeping -------------------------------------------------------------------------
    def _prune(self, keep: Path) -> None:
        """Rank 0: delete the oldest complete ``step_*`` checkpoints beyond keep_last_k."""
        if self.keep_last_k is None or _rank() != 0 or keep.parent != self.directory:
            return
        steps = [p for p in list_complete(self.directory) if _STEP_NAME.match(p.name)]
        for old in steps[: max(0, len(steps) - self.keep_last_k)]:
            if old != keep:  # renamed first: never seen half-deleted under its own name
                trash = old.with_name(f".tmp-pruned-{old.name}")
                os.replace(old, trash)
                shutil.rmtree(trash, ignore_errors=True)

    def cleanup_partial(self) -> None:
        """Rank 0: delete ``.tmp-*`` folders left by an interrupted save (call at start-up)."""
        if _rank() != 0 or not self.directory.is_dir():
            return
        busy = self._pending[2] if self._pending is not None else None
        for folder in self.directory.glob(".tmp-*"):
            if folder.is_dir() and folder != busy:
                shutil.rmtree(folder, ignore_errors=True)
