"""Reading checkpoints back without running code: tensors, numbers, strings and DCP's metadata.

Unpickling an arbitrary file can call any function (``open``, ``os.system``) while it loads, so a
checkpoint someone shared, or one lying in a run folder that ``resume="auto"`` picks up, must
never be read with plain ``pickle`` or ``torch.load(weights_only=False)``. Here:

* ``trainer_state.pt`` and ``rng_rank*.pt`` are read with ``torch.load(weights_only=True)``:
  dicts, lists, tuples, tensors, numbers, strings and ``None`` only (:func:`load_plain`); what
  meshtrain writes there is checked to be just that before it is written (:func:`check_plain`);
* DCP's ``.metadata`` (a pickle) is read by an unpickler that builds only DCP's own metadata
  classes, torch dtypes and sizes (:func:`read_metadata`), and DCP's non-tensor entries
  (optimizer hyperparameters) with ``weights_only=True`` (:class:`SafeLoadPlanner`).

A file that needs more is refused with :data:`TRUST_HINT`: checkpoints written by meshtrain before
this change stored NumPy's RNG state as an array; ``meshtrain upgrade-checkpoint DIR --trust``
converts such a checkpoint once, after its owner says it is theirs (docs/security.md).

A folder whose save never finished (``.tmp-*``), a missing file, or a shard shorter than the
metadata says is refused before loading, naming the file (:func:`check_complete`); a shard that
cannot be read (replaced, damaged) is named when its read fails (:meth:`SafeReader.read_data`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import io
import os
import pickle
import re
from pathlib import Path

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import (
    DefaultLoadPlanner,
    _EmptyStateDictLoadPlanner,
)

from meshtrain.errors import ConfigError

TRUST_HINT = ("if you (or someone you trust) wrote this checkpoint with an older meshtrain, convert "
              "it once with `meshtrain upgrade-checkpoint {folder} --trust` (it is then read "
              "safely); otherwise do not use it (docs/security.md)")

PLAIN_TYPES = (str, int, float, bool, bytes, type(None), torch.Tensor, torch.dtype, torch.Size)


def _refusal(file: Path, why: str, older: bool = True) -> ConfigError:
    """``older``: could an older meshtrain have written it (then converting it is the fix)?"""
    then = (TRUST_HINT.format(folder=file.parent) if older else
            "meshtrain never writes such data there: do not use this checkpoint (docs/security.md)")
    return ConfigError(f"{file} was refused: {why}. Loading it could run code hidden in the "
                       f"file; {then}")


def load_plain(file: str | Path):
    """The contents of a ``torch.save`` file that holds only plain data (refused otherwise)."""
    file = Path(file)
    try:
        return torch.load(file, weights_only=True, map_location="cpu")
    except pickle.UnpicklingError as error:
        found = re.search(r"GLOBAL ([\w.]+)", str(error))
        what = found.group(1) if found else str(error).split("error:")[-1].strip().splitlines()[0]
        raise _refusal(file, f"it holds more than tensors, numbers and strings ({what})") from None


def check_plain(value, where: str) -> None:
    """Refuse (ConfigError) a value meshtrain is about to save that :func:`load_plain` could not
    read back: tried for real (``torch.save``, then ``weights_only=True``), and on failure the
    first offending entry named."""
    buffer = io.BytesIO()
    torch.save(value, buffer)
    buffer.seek(0)
    try:
        torch.load(buffer, weights_only=True)
    except pickle.UnpicklingError as error:
        where, kind = _first_unplain(value, where) or (where, str(error).splitlines()[-1])
        raise ConfigError(
            f"{where} is a {kind}: a checkpoint keeps only tensors, numbers, strings, None and "
            "dicts/lists/tuples of them (so that loading it cannot run code); make the "
            "state_dict() that returns it give plain values (e.g. float(x), str(path))") from None


def _first_unplain(value, where: str) -> tuple[str, str] | None:
    """(where, type) of the first entry of ``value`` that is not plain data, or None."""
    if isinstance(value, dict):
        items = value.items()
    elif type(value) in (list, tuple, torch.Size):
        items = enumerate(value)
    elif type(value) in PLAIN_TYPES or isinstance(value, (torch.Tensor, torch.dtype)):
        return None
    else:
        return where, f"{type(value).__module__}.{type(value).__qualname__}"
    for key, item in items:
        found = _first_unplain(item, f"{where}[{key!r}]")
        if found:
            return found
    return None


def check_checkpoint_files(folder: str | Path) -> None:
    """Refuse a checkpoint folder whose trainer state or RNG files are more than plain data."""
    for file in sorted(Path(folder).glob("*.pt")):
        load_plain(file)


# -- DCP ---------------------------------------------------------------------------------------
def _dcp_class(module: str, name: str):
    """A class DCP's metadata may hold: a dataclass or enum of torch.distributed.checkpoint."""
    import importlib

    if not module.startswith("torch.distributed.checkpoint"):
        return None
    found = getattr(importlib.import_module(module), name, None)
    if isinstance(found, type) and (dataclasses.is_dataclass(found) or issubclass(found, enum.Enum)):
        return found
    return None


class _MetadataUnpickler(pickle.Unpickler):
    SIMPLE = {("collections", "OrderedDict"), ("builtins", "set"), ("builtins", "frozenset"),
              ("builtins", "object"), ("copyreg", "_reconstructor"), ("pathlib", "PosixPath"),
              ("pathlib", "PurePosixPath"), ("pathlib", "WindowsPath"),
              ("pathlib", "PureWindowsPath"), ("torch", "Size"),
              ("torch.serialization", "_get_layout")}

    def find_class(self, module, name):
        if (module, name) in self.SIMPLE:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None),
                                            (torch.dtype, torch.layout, torch.memory_format)):
            return getattr(torch, name)
        found = _dcp_class(module, name)
        if found is None:
            raise pickle.UnpicklingError(f"{module}.{name} is not part of DCP's metadata")
        return found


def read_metadata(folder: str | Path):
    """DCP's ``Metadata`` of checkpoint ``folder``, unpickled with only DCP's own classes."""
    file = Path(folder) / ".metadata"
    with open(file, "rb") as f:
        try:
            return _MetadataUnpickler(f).load()
        except pickle.UnpicklingError as error:
            raise _refusal(file, str(error), older=False) from None


def check_complete(folder: str | Path) -> None:
    """Refuse (ConfigError, naming the file) a checkpoint folder that a load would fail on: one
    whose save did not finish, a missing file, a shard shorter than its entries."""
    folder = Path(folder)
    unfinished = folder.name.startswith(".tmp-")
    missing = [name for name in ("trainer_state.pt", ".metadata") if not (folder / name).is_file()]
    if unfinished or missing:
        why = (f"its save did not finish (a checkpoint is written as .tmp-<name> and renamed "
               f"when every rank has written it){'; ' if missing else ''}" if unfinished else "")
        lacks = f"{', '.join(missing)} missing" if missing else ""
        done = sorted(p for p in folder.parent.glob("*") if not p.name.startswith(".")
                      and (p / "trainer_state.pt").is_file() and (p / ".metadata").is_file())
        other = f" (in that folder: {', '.join(p.name for p in done[-3:])})" if done else ""
        raise ConfigError(f"{folder} is not a complete meshtrain checkpoint: {why}{lacks}; "
                          f"resume from a complete one{other}, or use resume='auto'")
    sizes: dict[str, int] = {}
    for item in read_metadata(folder).storage_data.values():
        end = item.offset + item.length
        sizes[item.relative_path] = max(sizes.get(item.relative_path, 0), end)
    for name, needed in sorted(sizes.items()):
        file = folder / name
        if not file.is_file():
            raise ConfigError(f"{file} is missing: the checkpoint's metadata lists entries in "
                              "it. Resume from another checkpoint (or restore the file)")
        if file.stat().st_size < needed:
            raise ConfigError(
                f"{file} holds {file.stat().st_size} bytes but the checkpoint's metadata "
                f"places entries up to byte {needed}: it was truncated or replaced after the "
                "save. Resume from another checkpoint (or restore the file)")


class SafeReader(FileSystemReader):
    """DCP's file reader with :func:`read_metadata` in place of ``pickle.load``, naming the
    shard file whose read fails."""

    def read_data(self, plan, planner):
        import dataclasses as dc

        per_file: dict[str, list] = {}
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index].relative_path,
                                []).append(item)
        for name, items in per_file.items():
            try:
                super().read_data(dc.replace(plan, items=items), planner).wait()
            except ConfigError:
                raise
            except Exception as error:  # noqa: BLE001 - named, with what it said
                file = Path(str(self.path)) / name
                said = (str(error).strip().splitlines() or [""])[0]
                raise ConfigError(
                    f"{file} could not be read ({type(error).__name__}: {said}): it is damaged "
                    "or was replaced after the save (it does not hold what the checkpoint's "
                    "metadata says). Resume from another checkpoint (or restore the file)"
                ) from error
        from torch.futures import Future

        done: Future = Future()
        done.set_result(None)
        return done

    def read_metadata(self):  # (no **kwargs: DCP then does not look for per-rank metadata)
        from torch.distributed.checkpoint.metadata import StorageMeta

        metadata = read_metadata(self.path)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class _PlainBytes:
    """DCP's non-tensor entries (optimizer hyperparameters, ...) read with weights_only=True."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        name = read_item.dest_index.fqn
        try:
            obj = torch.load(value, weights_only=True)
        except pickle.UnpicklingError:
            raise _refusal(Path(str(self.folder)) / name, "this entry of the distributed "
                           "checkpoint holds more than tensors, numbers and strings",
                           older=False) from None
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[name], obj)
        else:
            self.state_dict[name] = obj


class SafeLoadPlanner(_PlainBytes, DefaultLoadPlanner):
    def __init__(self, folder, *args, **kwargs):
        self.folder = folder
        super().__init__(*args, **kwargs)


class _SafeEmptyPlanner(_PlainBytes, _EmptyStateDictLoadPlanner):
    def __init__(self, folder, *args, **kwargs):
        self.folder = folder
        super().__init__(*args, **kwargs)


@contextlib.contextmanager
def _refusals_unwrapped():
    """DCP wraps what a rank raised in a CheckpointException: raise our refusal itself."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        yield
    except CheckpointException as error:
        for failure in error.failures.values():
            cause = failure[0] if isinstance(failure, tuple) else failure
            if isinstance(cause, ConfigError):
                raise cause from None
        raise


def load_dcp(state: dict, folder: str | Path) -> None:
    """``dcp.load(state, checkpoint_id=folder)`` (collective), reading only plain data."""
    import torch.distributed.checkpoint as dcp

    check_complete(folder)  # refused here with its reason (DCP would wrap the error)
    with _refusals_unwrapped():
        dcp.load(state, storage_reader=SafeReader(str(folder)), planner=SafeLoadPlanner(folder))


def load_dcp_keys(folder: str | Path, keys: set[str]) -> dict:
    """The entries ``keys`` of checkpoint ``folder`` read whole in this one process (no process
    group), as DCP's ``_load_state_dict_from_keys`` but reading only plain data."""
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    read_metadata(folder)  # refused here with its reason (DCP would wrap the error)
    state: dict = {}
    with _refusals_unwrapped():
        _load_state_dict(state_dict=state, storage_reader=SafeReader(str(folder)),
                         process_group=None, no_dist=True,
                         planner=_SafeEmptyPlanner(folder, keys=keys))
    return state


def read_model_state(checkpoint_dir: str | os.PathLike,
                     dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """The model entries of the checkpoint ``checkpoint_dir`` as full tensors, read in this one
    process (no process group), floating-point ones converted to ``dtype`` when given."""
    checkpoint_dir = Path(checkpoint_dir)
    if not (checkpoint_dir / ".metadata").is_file():
        raise ConfigError(
            f"{checkpoint_dir} is not a distributed checkpoint (no .metadata file); pass a "
            "checkpoint folder such as runs/<name>/<time>/checkpoints/final"
        )
    check_checkpoint_files(checkpoint_dir)  # a poisoned checkpoint is refused, not passed on
    state = load_dcp_keys(checkpoint_dir, {"model"})["model"]
    if dtype is not None:
        state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}
    return state
