"""The kinds of value a Trainer setting takes, and :class:`Setting`, one setting's definition.

The settings themselves are in meshtrain/setting_table.py; meshtrain/settings.py is the API.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from meshtrain.errors import ConfigError

SECTIONS: dict[str, str] = {
    "trainer": "what to train on and for how long: layout, devices, batch sizes, precision, "
               "validation",
    "parallel": "how the layout is applied: DDP buckets and hooks, sharding options, "
                "activation checkpointing, tensor-parallel options",
    "pipeline": "pipeline parallel (pp=N): schedule and how the model's blocks are cut into stages",
    "checkpoint": "periodic and final checkpoints, and where a run resumes from",
    "fault": "fault tolerance: non-finite policy, collective timeouts, stall watchdog",
    "logging": "metrics, loggers, progress bar and where a run's folder goes",
}

def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_layout(value) -> bool:
    from meshtrain.parallel.layout import Layout

    return isinstance(value, (str, dict, Layout))


# The kinds of value (Setting.type): whether a value fits, and the allowed values in words (a
# check's message and the reference's type column).
_FITS: dict[str, Callable[[Setting, object], bool]] = {
    "int": lambda s, v: _is_int(v) and (s.minimum is None or v >= s.minimum),
    "number": lambda s, v: (_is_int(v) or isinstance(v, float)) and math.isfinite(v) and v > 0,
    "bool": lambda s, v: isinstance(v, bool),
    "str": lambda s, v: isinstance(v, str),
    "path": lambda s, v: isinstance(v, (str, os.PathLike)),
    "resume": lambda s, v: isinstance(v, (str, os.PathLike)),
    "choice": lambda s, v: any(v == c and type(v) is type(c) for c in s.choices),
    "devices": lambda s, v: v == "auto" or (_is_int(v) and v >= 1),
    "layout": lambda s, v: _is_layout(v),
    "loggers": lambda s, v: True,  # _check_loggers names the bad item
    "int_list": lambda s, v: isinstance(v, (list, tuple)) and all(_is_int(i) and i >= 1 for i in v)
    and all(a < b for a, b in zip(v, v[1:])),
    "callbacks": lambda s, v: isinstance(v, Iterable) and not isinstance(v, (str, bytes, dict)),
    "callable": lambda s, v: callable(v),
    "metrics": lambda s, v: isinstance(v, (list, tuple)),
    "tp_plan": lambda s, v: isinstance(v, dict) or callable(v),
}
_WHAT = {
    "number": "a positive number", "bool": "True or False", "str": "a string", "path": "a path",
    "resume": "'auto' or a checkpoint folder", "devices": "a positive integer or 'auto'",
    "layout": "a layout string or table", "loggers": "a list of logger names",
    "int_list": "a list of strictly increasing block indices >= 1 (the first block of stages "
                "1, 2, ...)",
    "callbacks": "a list of Callback objects", "callable": "a function",
    "metrics": "a list of metric names or meshtrain.metrics.Metric objects",
    "tp_plan": "a dict (module name -> ParallelStyle)",
}


@dataclass(frozen=True)
class Setting:
    """One Trainer keyword.

    ``type`` is a kind of value (a key of ``_FITS``); ``choices`` lists the allowed values of a
    ``choice`` (and of ``loggers``' items); ``none`` allows ``None``; ``minimum`` bounds an int
    (1: a positive integer, 0: >= 0); a number is always > 0. ``error`` replaces the default
    message (a format string with ``{name}`` and ``{value!r}``) where meshtrain's existing
    wording is kept. ``check`` is a further check of the value (raises ConfigError).
    ``config=False``: Python only (an object a TOML file cannot hold), not in config sections.
    """

    name: str
    section: str
    default: object
    type: str
    doc: str
    choices: tuple = ()
    none: bool = False
    minimum: int | None = None
    error: str | None = None
    check: Callable[[object], None] | None = None
    config: bool = True

    def __post_init__(self) -> None:
        assert self.section in SECTIONS and self.type in _FITS, (self.section, self.type)

    def validate(self, value) -> None:
        """Raise ConfigError, naming the setting and the allowed values, unless ``value`` fits."""
        if value is None and self.none:
            return
        if not _FITS[self.type](self, value):
            template = self.error or "{name} must be {what}, got {value!r}"
            raise ConfigError(template.format(name=self.name, value=value, what=self.what()))
        if self.check is not None:
            self.check(value)

    def what(self) -> str:
        """The allowed values in words: "a positive integer or None", "one of 'a', 'b', 'c'"."""
        if self.type == "int":
            what = {1: "a positive integer", 0: "an integer >= 0"}.get(self.minimum, "an integer")
        elif self.type == "choice":
            names = [repr(c) for c in self.choices]
            what = "one of " + ", ".join(names) if len(names) > 2 else " or ".join(names)
        else:
            what = _WHAT[self.type]
        return what + (" or None" if self.none else "")


