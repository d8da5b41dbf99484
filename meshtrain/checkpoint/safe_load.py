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


class SafeReader(FileSystemReader):
    """DCP's file reader with :func:`read_metadata` in place of ``pickle.load``."""

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

    read_metadata(folder)  # refused here with its reason (DCP would wrap the error)
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
