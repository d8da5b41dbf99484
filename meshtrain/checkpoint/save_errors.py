"""A checkpoint save that fails on the file system (a full disk, a quota, no permission): said
in one clear error on every rank, naming the path, the checkpoint's size beside the space
left, and the last good checkpoint, which is kept.

Without this, a full disk surfaced as torch's ``[enforce fail at inline_container.cc] ...
unexpected pos`` (``torch.save`` of a file that could not grow) or as DCP's
``CheckpointException`` wrapping an ``OSError`` on some rank, and a rank whose own file failed
before DCP's collectives left the others waiting. The manager now runs each local part of a
save (the temporary folder, each rank's small files, DCP's shards) and then agrees with the
other ranks whether every part was written (:func:`any_rank_failed`), before going on or
raising :class:`CheckpointWriteError` everywhere.

The error's first line (what, where, which rank and its error) is the same at every attempt;
the numbers are on the next lines (a failure that repeats identically stops restarts:
fault/restarts.py compares first lines).
"""

from __future__ import annotations

import errno
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.filesystem import FileSystemWriter

from meshtrain.errors import MeshtrainError

SPACE = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
PERMISSION = (errno.EACCES, errno.EPERM, errno.EROFS)
# what torch.save says when its zip writer could not write all it had (a full disk)
SPACE_WORDS = ("unexpected pos", "No space left", "file write failed", "Disk quota exceeded")
PERMISSION_WORDS = ("Permission denied", "Read-only file system", "Operation not permitted")


class CheckpointWriteError(MeshtrainError, RuntimeError):
    """A checkpoint could not be written (a background write, or the file system refused)."""


def causes(error: BaseException):
    """``error``, what it was raised from, and what DCP's CheckpointException gathered from
    each rank."""
    seen, todo = set(), [error]
    while todo:
        e = todo.pop(0)
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        todo += [e.__cause__, e.__context__]
        for failure in getattr(e, "failures", {}).values():  # CheckpointException: rank -> error
            todo.append(failure[0] if isinstance(failure, tuple) else failure)


def kind_of(error: BaseException | str) -> str | None:
    """"space", "permission" or None (another failure) for an error or its text."""
    for e in causes(error) if isinstance(error, BaseException) else [error]:
        number, text = getattr(e, "errno", None), str(e)
        if number in SPACE or any(w in text for w in SPACE_WORDS):
            return "space"
        if number in PERMISSION or any(w in text for w in PERMISSION_WORDS):
            return "permission"
    return None


def _file_system_error(error: BaseException) -> BaseException | None:
    """The error under DCP's wrapping that the file system gave (an OSError, or torch.save's
    RuntimeError of a full disk), or None."""
    for e in causes(error):
        if isinstance(e, OSError) or kind_of(str(e)):
            return e
    return None


def error_text(error: BaseException) -> str:
    """``Type: first line of the message``."""
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__


def failures_of(error: BaseException, rank: int) -> dict[int, str] | None:
    """{rank: its error} of a save that the file system refused (DCP's CheckpointException
    says which ranks failed; otherwise it is this ``rank``'s), or None for other failures."""
    if _file_system_error(error) is None:
        return None
    gathered = getattr(error, "failures", None) or {rank: error}
    found = {}
    for r, failure in gathered.items():
        failure = failure[0] if isinstance(failure, tuple) else failure
        found[r] = error_text(_file_system_error(failure) or failure)
    return found


def refused_write(part) -> BaseException | None:
    """Run ``part`` (this rank's own files of a save): the error if the file system refused
    it, else None; other errors propagate."""
    try:
        part()
    except (OSError, RuntimeError) as error:
        if _file_system_error(error) is None:
            raise
        return error
    return None


def checkpoint_bytes(state: dict) -> int:
    """About what a checkpoint of ``state`` takes: each tensor's whole (global) size."""
    from meshtrain.checkpoint.staging import _tensors

    return sum(t.numel() * t.element_size() for _, t in _tensors(state))


def folder_bytes(folder: Path | None) -> int:
    if folder is None:
        return 0
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


def _size(size: float) -> str:
    for unit in ("KiB", "MiB", "GiB"):
        size /= 1024
        if size < 1024 or unit == "GiB":
            return f"{size:.1f} {unit}"


def disk_usage(path: Path):
    """``shutil.disk_usage`` of the nearest folder of ``path`` that exists."""
    for folder in (path, *path.parents):
        if folder.exists():
            return shutil.disk_usage(folder)
    return None


def describe_failure(step: int, where: Path, failed: dict[int, str], state: dict | None,
                     last_good: Path | None) -> str:
    """The error of a failed save of ``step`` into ``where`` (``failed``: rank -> its error;
    ``state``: what DCP was to write, for its size, or None)."""
    rank, text = min(failed.items())
    kind = next((k for k in map(kind_of, failed.values()) if k), None)
    others = f" and {len(failed) - 1} more rank(s)" if len(failed) > 1 else ""
    what = {"space": "no space left on its file system",
            "permission": "the file system refused this user's writes"}.get(kind, "")
    first = (f"the checkpoint of step {step} could not be written to {where}"
             f"{': ' + what if what else ''} (rank {rank}{others}: {text})")
    usage = disk_usage(where)
    kept = (f"the last complete checkpoint, {last_good}, is kept" if last_good else
            "no earlier checkpoint of this run exists")
    sizes = ([f"{last_good.name} takes {_size(folder_bytes(last_good))}"] if last_good else []) \
        + ([f"the model and optimizer state alone {_size(checkpoint_bytes(state))}"]
           if state is not None else [])
    details = [f"A checkpoint needs about {' and '.join(sizes) or 'as much as the last'}"
               + (f"; the file system holding it has {_size(usage.free)} free of "
                  f"{_size(usage.total)} (shutil.disk_usage)" if usage else "") + "."]
    if kind == "space":
        fix = ("Free space there, keep fewer checkpoints (keep_last_k), or write the run to a "
               "larger file system (run_dir)")
    elif kind == "permission":
        fix = "Give run_dir a folder this user can write, or fix the folder's permissions"
    else:
        fix = "Check the file system of the run folder"
    details.append(f"{kept[0].upper()}{kept[1:]}, and the partial {where.name} removed. {fix}.")
    return first + "\n" + " ".join(details)


def any_rank_failed(error: BaseException | None, device) -> dict[int, str]:
    """Collective when a process group exists: {rank: its error} of the ranks whose local part
    of a save failed ({} when none did: one small all-reduce)."""
    text = None if error is None else f"{type(error).__name__}: {error}"
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return {} if text is None else {dist.get_rank() if dist.is_initialized() else 0: text}
    flag = torch.tensor([int(text is not None)], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if not flag.item():
        return {}
    texts: list = [None] * dist.get_world_size()
    dist.all_gather_object(texts, text)
    return {r: t for r, t in enumerate(texts) if t is not None}


class FaultWriter(FileSystemWriter):
    """DCP's file writer with the ``checkpoint_shard`` fault point after this rank wrote its
    shard file (used only while that point is armed: MESHTRAIN_FAULT, fault/inject.py)."""

    def __init__(self, path, step: int):
        super().__init__(path)
        self.step = step

    def write_data(self, plan, planner):
        from meshtrain.fault.inject import fault_point

        future = super().write_data(plan, planner)  # (one file per rank, written by now)
        fault_point("checkpoint_shard", step=self.step)
        return future
