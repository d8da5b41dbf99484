"""Public packages whose names are imported on first use (PEP 562), as ``meshtrain`` itself does.

A package lists ``{name: defining module}`` and takes ``__getattr__``/``__dir__`` from
:func:`lazy_exports`: importing the package (or a submodule of it) imports nothing else, so
``import meshtrain`` and the commands that train nothing stay free of torch; the first read of a
name imports its module and keeps the value in the package.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable


def lazy_exports(package: str, exports: dict[str, str]
                 ) -> tuple[Callable[[str], object], Callable[[], list[str]]]:
    """``__getattr__`` and ``__dir__`` for ``package`` exporting ``exports``' names. Any other
    name is an ``AttributeError``, so ``from package import submodule`` still imports it."""

    def __getattr__(name: str):
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(exports[name]), name)
        setattr(sys.modules[package], name, value)
        return value

    def __dir__() -> list[str]:
        return sorted({*vars(sys.modules[package]), *exports})

    return __getattr__, __dir__
