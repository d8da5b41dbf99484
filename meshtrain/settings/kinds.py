"""The kinds of value a Trainer setting takes, what a setting needs to have any effect, and
:class:`Setting`, one setting's definition.

The settings themselves are in table.py of this package; its __init__.py is the API.
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
    "steps": lambda s, v: isinstance(v, (list, tuple)) and all(_is_int(i) and i >= 1 for i in v)
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
    "steps": "a list of strictly increasing step numbers >= 1",
    "callbacks": "a list of Callback objects", "callable": "a function",
    "metrics": "a list of metric names or meshtrain.metrics.Metric objects",
    "tp_plan": "a dict (module name -> ParallelStyle)",
}


# -- what a setting needs (Setting.needs) -----------------------------------------------------
# A setting does nothing unless each of its needs is met; set to anything but its default while
# one is not, it is an error (meshtrain/checks.py), and ``meshtrain parity`` leaves it out of the
# runs whose layout lacks it. A need is one of:
#   "pp", "tp", "cp", "dp", "dp_shard", "dp_replicate"   that axis in the layout (degree > 1)
#   "ddp", "plain_dp", "sharded", "ps", "batch",         a layout fact (LAYOUT_FACTS, from Layout)
#   "replayable",
#   "ranks", "processes"
#   "<setting>"                                          another setting set (not at its default)
#   "<setting>=<value>"                                  another setting with that value (a string
#                                                        also matches its first comma-separated
#                                                        item: layout="auto,tp=2" is "auto")
#   "<setting>!=<value>"                                 another setting without that value
#   "not <setting>"                                      another setting left at its default
#   "<need>|<need>|..."                                  any one of these
# A need that names the layout setting ("layout=auto") asks something of the layout too.
AXIS_KINDS = {"pp": "pipeline", "tp": "tensor-parallel", "cp": "context-parallel",
              "dp": "data-parallel", "dp_shard": "sharded data-parallel",
              "dp_replicate": "replicated-shards (HSDP)"}


def _not_plain_dp(layout) -> str:
    return "zero1 shards the optimizer state" if layout.uses_ddp else layout.why_not_ddp()


# name: (in words, is it met? (Layout -> bool), the error's text ({shown}, {name}, {layout},
# {why}), why not (Layout -> str))
LAYOUT_FACTS: dict[str, tuple[str, Callable, str, Callable]] = {
    "ddp": ("a layout that uses DDP (dp or zero1 alone)", lambda layout: layout.uses_ddp,
            "{shown} is a DDP setting, but the layout {layout} does not use DDP ({why}), so it "
            "would do nothing; drop {name}, or use a dp/zero1 layout",
            lambda layout: layout.why_not_ddp()),
    "plain_dp": ("plain data parallel (dp=N: replicated parameters and optimizer state)",
                 lambda layout: layout.uses_ddp and not layout.zero_stage,
                 "{shown} is a plain data-parallel setting, but the layout {layout} is not plain "
                 "data parallel ({why}); use layout='dp=N', or drop {name}", _not_plain_dp),
    "sharded": ("a sharded layout (zero2, zero3 or dp_shard)", lambda layout: layout.is_sharded,
                "{shown} is a sharded-layout setting, but the layout {layout} does not shard "
                "the model, so it would do nothing; use a sharded layout (zero2, zero3 or "
                "dp_shard, e.g. layout='zero3=N'), or drop {name}", lambda layout: ""),
    "ps": ("parameter servers (ps=S,dp=W)", lambda layout: layout.num_servers > 0,
           "{shown} is a parameter-server setting, but the layout {layout} has no servers, so "
           "it would do nothing; write e.g. layout='ps=1,dp=2' (3 processes), or drop {name}",
           lambda layout: ""),
    "batch": ("several data-parallel ranks (dp, dp_shard, dp_replicate or cp above 1)",
              lambda layout: layout.loss_degree > 1,
              "{shown} is a data-parallel setting, but the layout {layout} has no data-parallel "
              "ranks, so it would do nothing; add dp=N to the layout (e.g. devices=2, "
              "layout='dp=2'), or drop {name}", lambda layout: ""),
    "replayable": ("one process or plain data parallel (dp, zero1; no ep)",
                   lambda layout: layout.gradients_identical_after_sync
                   and layout.expert_degree == 1,
                   "{shown} replays a micro-batch on the rank that computed it and compares its "
                   "gradients, which needs one process or plain data parallel, but the layout "
                   "{layout} is not ({why}); use layout='dp=N', or drop {name}",
                   lambda layout: "ep splits the experts" if layout.expert_degree > 1 else
                   "pp, tp or cp splits the model or the sequence" if {"pp", "tp", "cp"} &
                   set(layout.degrees) else layout.why_not_ddp()),
    "ranks": ("several ranks (devices=N)", lambda layout: layout.world_size > 1,
              "{shown} compares the ranks, but the layout {layout} has one rank, so it would do "
              "nothing; train on several (e.g. devices=2), or drop {name}", lambda layout: ""),
    "processes": ("several processes (devices=N)", lambda layout: layout.num_processes > 1,
                  "{shown} is about the collectives between processes, but the layout {layout} "
                  "runs one process, which has none, so it would do nothing; drop {name}, or "
                  "train on several (e.g. devices=2)", lambda layout: ""),
}


def at_default(setting: Setting, value) -> bool:
    """Is ``value`` the setting's default? (a list equals its tuple; True is not 1)"""
    default = setting.default
    if isinstance(default, (tuple, list)) and isinstance(value, (tuple, list)):
        return list(default) == list(value)
    return type(value) is type(default) and value == default


def need_atom(need: str) -> tuple[str, str, str | None]:
    """One need (no ``|``) read: (kind, name, value); kind is "axis", "fact", "set", "equals",
    "differs" or "unset"."""
    if need.startswith("not "):
        return "unset", need[4:].strip(), None
    if "!=" in need:
        name, _, value = need.partition("!=")
        return "differs", name.strip(), value.strip()
    if "=" in need:
        name, _, value = need.partition("=")
        return "equals", name.strip(), value.strip()
    if need in AXIS_KINDS:
        return "axis", need, None
    if need in LAYOUT_FACTS:
        return "fact", need, None
    return "set", need, None


def value_is(value, text: str) -> bool:
    """Does a setting's ``value`` match a need's ``text``? A string when it is ``text`` or
    starts with ``text,`` (layout="auto,tp=2" is layout="auto" with pins); else its repr
    (``None``, ``True``, ``4``)."""
    if isinstance(value, str):
        return value == text or value.partition(",")[0].strip() == text
    return repr(value) == text


def need_met(need: str, layout, values: dict, settings: dict[str, Setting]) -> bool:
    """Is ``need`` met by ``layout`` (a Layout) and the settings' ``values``?"""
    def met(atom: str) -> bool:
        kind, name, value = need_atom(atom)
        if kind == "axis":
            return layout.degree(name) > 1
        if kind == "fact":
            return bool(LAYOUT_FACTS[name][1](layout))
        if kind in ("equals", "differs"):
            return value_is(values[name], value) == (kind == "equals")
        is_set = not at_default(settings[name], values[name])
        return is_set if kind == "set" else not is_set
    return any(met(atom) for atom in need.split("|"))


def need_words(need: str) -> str:
    """A need in words, for the reference and error messages."""
    def words(atom: str) -> str:
        kind, name, value = need_atom(atom)
        if kind == "fact":
            return LAYOUT_FACTS[name][0]
        return {"axis": f"a {name} axis in the layout", "set": f"{name} set",
                "equals": f"{name}={value!r}", "differs": f"{name} not {value}",
                "unset": f"{name} unset"}[kind]
    parts = [words(atom) for atom in need.split("|")]
    return parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " or " + parts[-1]


def is_layout_need(need: str) -> bool:
    """Does ``need`` (any of its alternatives) ask something of the layout (an axis, a layout
    fact, or the layout setting itself: "layout=auto")?"""
    return any(need_atom(atom)[0] in ("axis", "fact") or need_atom(atom)[1] == "layout"
               for atom in need.split("|"))


def need_settings(need: str) -> list[str]:
    """The other settings ``need`` names."""
    return [need_atom(atom)[1] for atom in need.split("|")
            if need_atom(atom)[0] in ("set", "equals", "differs", "unset")]


def _shown(name: str, value) -> str:
    """``name=value`` for a plain value, ``name`` alone for True or an object (a plan)."""
    plain = value is None or isinstance(value, (str, int, float)) and value is not True
    return f"{name}={value!r}" if plain else name


def unmet_message(name: str, value, need: str, layout, values: dict) -> str:
    """Why setting ``name`` (``value``) does nothing when ``need`` is unmet, and the fix."""
    shown = _shown(name, value)
    kind, other, wanted = need_atom(need)
    if "|" in need:
        return (f"{shown} does nothing here: it needs {need_words(need)}, and the layout "
                f"{layout} with these settings has none of them; set one, or drop {name}")
    if kind == "axis":
        what = AXIS_KINDS[other]
        return (f"{shown} is a {what} setting, but the layout {layout} has no {other} axis, so "
                f"it would do nothing ({what} settings need a {what} layout, e.g. "
                f"layout='{other}=2'); add {other}=N to the layout, or drop {name}")
    if kind == "fact":
        _, _, text, why = LAYOUT_FACTS[other]
        return text.format(shown=shown, name=name, layout=layout, why=why(layout))
    current = values[other]
    if kind == "set":
        return (f"{shown} is used with {other} only ({other} is {current!r}), so it would do "
                f"nothing; set {other} too, or drop {name}")
    if kind == "equals":
        return (f"{shown} is used by {other}={wanted!r} only ({other} is {current!r}), so it "
                f"would do nothing; set {other}={wanted!r} too, or drop {name}")
    if kind == "differs":
        return (f"{shown} is used only while {other} is not {wanted} ({other} is {current!r}), "
                f"so it would do nothing; set {other} too, or drop {name}")
    return (f"{shown} does nothing while {other} is set ({other}={current!r} takes its place); "
            f"drop {name} or {other}")


@dataclass(frozen=True)
class Setting:
    """One Trainer keyword.

    ``type`` is a kind of value (a key of ``_FITS``); ``choices`` lists the allowed values of a
    ``choice`` (and of ``loggers``' items); ``none`` allows ``None``; ``minimum`` bounds an int
    (1: a positive integer, 0: >= 0); a number is always > 0. ``error`` replaces the default
    message (a format string with ``{name}`` and ``{value!r}``) where meshtrain's existing
    wording is kept. ``check`` is a further check of the value (raises ConfigError).
    ``config=False``: Python only (an object a TOML file cannot hold), not in config sections.
    ``needs``: what the setting needs to have any effect, each a need of the vocabulary above
    (all of them must be met); set while one is not, it is an error.
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
    needs: tuple[str, ...] = ()

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


