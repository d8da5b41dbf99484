"""Old import paths of modules that moved: each still imports, as the module it became.

``import meshtrain`` puts :class:`_Finder` at the end of ``sys.meta_path``. Importing an old
path (``import meshtrain.parallel.tensor_parallel``, ``from meshtrain.parallel.tensor_parallel
import attention_plan``) then imports the new module and binds it under the old name too: the
same module object (monkeypatching it patches the module meshtrain runs; classes are the same
classes), with one ``DeprecationWarning`` naming the new path, and the public module to import
from where there is one. Nothing here imports torch; the new module is imported only when the
old path is.

Names that left a module whose path is now a package (``meshtrain.observe.memory``'s, now in
its ``probe``) are forwarded by the package's ``__getattr__`` from :func:`moved_names`.

docs/reference.md lists these paths (tools/gen_reference.py); tests/test_public_api.py imports
each.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import os
import sys
import warnings
from collections.abc import Callable

# old dotted path -> (the module it is now, the public module its users import from or None)
MOVED: dict[str, tuple[str, str | None]] = {
    # parallel/ grouped by concern
    "meshtrain.parallel.context_parallel": ("meshtrain.parallel.context.context_parallel",
                                            "meshtrain.parallel.context"),
    "meshtrain.parallel.batch_gather": ("meshtrain.parallel.data.batch_gather", "meshtrain"),
    "meshtrain.parallel.data_parallel": ("meshtrain.parallel.data.data_parallel", None),
    "meshtrain.parallel.fsdp_comm": ("meshtrain.parallel.data.fsdp_comm", None),
    "meshtrain.parallel.fully_shard": ("meshtrain.parallel.data.fully_shard", None),
    "meshtrain.parallel.local_sgd": ("meshtrain.parallel.data.local_sgd", None),
    "meshtrain.parallel.sync_batchnorm": ("meshtrain.parallel.data.sync_batchnorm", None),
    "meshtrain.parallel.zero1": ("meshtrain.parallel.data.zero1", None),
    "meshtrain.parallel.sequence_parallel": ("meshtrain.parallel.tensor.sequence_parallel",
                                             "meshtrain.parallel.tensor"),
    "meshtrain.parallel.tensor_parallel": ("meshtrain.parallel.tensor.tensor_parallel",
                                           "meshtrain.parallel.tensor"),
    "meshtrain.parallel.tp_debug": ("meshtrain.parallel.tensor.tp_debug", None),
    "meshtrain.parallel.tp_shapes": ("meshtrain.parallel.tensor.tp_shapes", None),
    "meshtrain.parallel.ps_client": ("meshtrain.parallel.ps.client", None),
    "meshtrain.parallel.ps_layout": ("meshtrain.parallel.ps.layout", None),
    "meshtrain.parallel.parameter_server": ("meshtrain.parallel.ps.server", None),
    "meshtrain.parallel.shm_collectives": ("meshtrain.parallel.shm.collectives", None),
    "meshtrain.parallel.shm_p2p": ("meshtrain.parallel.shm.p2p", None),
    "meshtrain.parallel.pipeline_check": ("meshtrain.parallel.pipeline.check", None),
    "meshtrain.parallel.pipeline_engine": ("meshtrain.parallel.pipeline.engine", None),
    "meshtrain.parallel.partition": ("meshtrain.parallel.pipeline.partition", None),
    # observe/ and fault/
    "meshtrain.observe.external_loggers": ("meshtrain.observe.loggers.external", None),
    "meshtrain.observe.peak_rss": ("meshtrain.observe.memory.peak_rss", None),
    "meshtrain.observe.tensor_peak": ("meshtrain.observe.memory.tensor_peak", None),
    "meshtrain.observe.zero_formulas": ("meshtrain.observe.memory.zero_formulas", None),
    "meshtrain.observe.desync": ("meshtrain.fault.desync", None),
    "meshtrain.observe.nonfinite": ("meshtrain.fault.nonfinite", None),
    "meshtrain.observe.watchdog": ("meshtrain.fault.watchdog", None),
    # settings/, loop/, parity/, models/hf/
    "meshtrain.setting_types": ("meshtrain.settings.kinds", None),
    "meshtrain.reference": ("meshtrain.settings.reference", None),
    "meshtrain.setting_table": ("meshtrain.settings.table", None),
    "meshtrain.evaluation": ("meshtrain.loop.evaluation", None),
    "meshtrain.prediction": ("meshtrain.loop.prediction", None),
    "meshtrain.trainer_setup": ("meshtrain.loop.setup", None),
    "meshtrain.loop_state": ("meshtrain.loop.state", None),
    "meshtrain.step_end": ("meshtrain.loop.step_end", None),
    "meshtrain.parity_verdict": ("meshtrain.parity.verdict", None),
    "meshtrain.models.hf_pipeline": ("meshtrain.models.hf.pipeline", None),
}

_HERE = __file__
_PACKAGE_INIT = os.path.join(os.path.dirname(__file__), "__init__.py")  # meshtrain.__getattr__


def _caller_level() -> int:
    """``stacklevel`` of the frame that asked for the import (the user's ``import`` line), past
    this file, ``meshtrain.__getattr__`` and ``importlib.import_module``; ``warnings`` itself
    skips the import system's frozen frames, so they are not counted. (The default filters show
    a DeprecationWarning attributed to ``__main__``: a script's own imports.)"""
    frame, level = sys._getframe(1), 1  # level 1: the function that calls warnings.warn
    while frame is not None:
        name = frame.f_code.co_filename
        internal = "importlib" in name and "_bootstrap" in name
        if not (internal or name in (_HERE, _PACKAGE_INIT, importlib.__file__)):
            return level
        level += not internal
        frame = frame.f_back
    return 1


def moved_message(old: str) -> str:
    new, public = MOVED[old]
    text = f"{old} is now {new}"
    if public is not None:
        text += f" (import its public names from {public})"
    return text + "; the old path will be removed"


class _Loader:
    """Binds the old name to the new module: ``create_module`` returns it, already run."""

    def __init__(self, old: str):
        self.old = old

    def create_module(self, spec):
        warnings.warn(moved_message(self.old), DeprecationWarning, stacklevel=_caller_level())
        module = importlib.import_module(MOVED[self.old][0])
        self.spec = module.__spec__  # the import system sets the old path's spec on it next
        return module

    def exec_module(self, module) -> None:  # the new module ran when it was imported
        module.__spec__ = self.spec


class _Finder:
    """A ``sys.meta_path`` finder that knows only the old paths in :data:`MOVED`."""

    @staticmethod
    def find_spec(fullname: str, path=None, target=None):
        if fullname not in MOVED:
            return None
        return importlib.machinery.ModuleSpec(fullname, _Loader(fullname))


def install() -> None:
    """Put the finder on ``sys.meta_path`` once (after the others: a real file wins)."""
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.append(_Finder())


def moved_names(package: str, new: str, names) -> Callable[[str], object]:
    """A ``__getattr__`` for ``package`` that forwards ``names`` (moved into module ``new``),
    warning once per name with the new path; any other name is an ``AttributeError`` (so a
    submodule of that name still imports)."""
    names = frozenset(names)

    def __getattr__(name: str):
        if name not in names:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        warnings.warn(f"{package}.{name} is now {new}.{name}; the old path will be removed",
                      DeprecationWarning, stacklevel=_caller_level())
        value = getattr(importlib.import_module(new), name)
        setattr(sys.modules[package], name, value)  # warned once: later reads find it
        return value

    return __getattr__
