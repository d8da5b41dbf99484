"""Every Trainer setting, defined once: name, section, default, type, one-line doc, check.

The Python API (``Trainer(**keywords)``), the TOML sections of a recipe's config and their
``--section.key=value`` overrides, the ``--dry-run`` listing, the Trainer's ``Args:`` docstring
and ``docs/reference.md`` (``python tools/gen_reference.py``) all come from :data:`SETTINGS`.

The table is meshtrain/settings/table.py, the kinds of value meshtrain/settings/kinds.py.
A setting's check there looks at its own value only (type, range, choices). What a setting needs
to have any effect (an axis, a layout fact, another setting) is part of its definition too
(``Setting.needs``): :func:`unmet_needs` finds the settings that would do nothing under a layout
(an error: meshtrain/checks.py); ``meshtrain parity`` leaves :func:`inapplicable` ones out. Other
checks that need several settings or the layout (``stall_timeout_s < collective_timeout_s``)
stay with the code they protect (Trainer, fault.py).
TOML has no null: in a config ``"none"`` stands for ``None`` (:func:`flatten` converts it).
"""

from __future__ import annotations

import difflib

from meshtrain.config import unknown_key_message
from meshtrain.errors import ConfigError
from meshtrain.settings.table import DEFINITIONS
from meshtrain.settings.kinds import (
    AXIS_KINDS, LAYOUT_FACTS, SECTIONS, Setting, at_default, is_layout_need, need_atom, need_met,
    need_settings, unmet_message,
)

__all__ = ["SECTIONS", "SETTINGS", "Setting", "check", "config_sections", "defaults", "flatten",
           "docstring", "inapplicable", "reference_markdown", "unmet_needs"]

SETTINGS: dict[str, Setting] = {
    s.name: s for section in SECTIONS for s in DEFINITIONS if s.section == section}
assert len(SETTINGS) == len(DEFINITIONS), "a setting is defined twice"


def _check_needs() -> None:
    """Every need names an axis, a layout fact or another setting (at import)."""
    for s in DEFINITIONS:
        for need in s.needs:
            for atom in need.split("|"):
                kind, name, _ = need_atom(atom)
                known = {"axis": AXIS_KINDS, "fact": LAYOUT_FACTS}.get(kind, SETTINGS)
                assert name in known and name != s.name, (s.name, need)


_check_needs()


# -- the API ----------------------------------------------------------------------------------
def defaults() -> dict[str, object]:
    """Every setting's default, by name (the Trainer's keyword defaults)."""
    return {name: s.default for name, s in SETTINGS.items()}


def _unknown_setting(name: str) -> str:
    close = difflib.get_close_matches(name, list(SETTINGS), n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ";"
    return f"unknown Trainer setting {name!r}{hint} known: {', '.join(SETTINGS)}"


def check(values: dict) -> dict:
    """Check the given settings (flat keywords, any subset) and return every setting's value:
    the defaults updated with ``values``. Raises ConfigError naming the setting at fault."""
    for name, value in values.items():
        if name not in SETTINGS:
            raise ConfigError(_unknown_setting(name))
        SETTINGS[name].validate(value)
    from meshtrain.checkpoint.resume import job_name  # name="auto": the script's name
    return {**defaults(), **values, "name": job_name(values.get("name", SETTINGS["name"].default))}


def unmet_needs(layout, values: dict) -> list[tuple[str, str, str]]:
    """The settings in ``values`` (every setting's value, as :func:`check` returns them) that
    are not at their default but would do nothing under ``layout`` (a Layout): (name, the first
    unmet need, the error's message: what it needs and the fix), in the table's order."""
    unmet = []
    for name, s in SETTINGS.items():
        value = values[name]
        if not s.needs or at_default(s, value):
            continue
        need = next((n for n in s.needs if not need_met(n, layout, values, SETTINGS)), None)
        if need is not None:
            unmet.append((name, need, unmet_message(name, value, need, layout, values)))
    return unmet


def inapplicable(layout, values: dict, imposed=()) -> list[str]:
    """The settings in ``values`` (as :func:`check` returns them) that ``layout`` gives nothing
    to do: set while an axis or layout fact they need is missing, and those that need such a
    setting in turn, or one of the ``imposed`` settings (``meshtrain parity`` turns periodic
    checkpoints off: ``keep_last_k`` then has nothing to do). A setting unmet for another
    reason (it needs a setting the user did not set) is not among them: the Trainer refuses it."""
    values, dropped = dict(values), []
    while True:
        drop = [name for name, need, _ in unmet_needs(layout, values)
                if is_layout_need(need) or set(need_settings(need)) & {*dropped, *imposed}]
        if not drop:
            return dropped
        for name in drop:
            values[name] = SETTINGS[name].default
        dropped += drop


def impose(values: dict, imposed: dict) -> dict:
    """The keywords ``values`` with ``imposed`` set, less the settings that need one of the
    imposed ones to be something else (a mode that turns periodic checkpoints off:
    ``meshtrain memory``'s one step, where a config's ``keep_last_k`` has nothing to do)."""
    from meshtrain.parallel.layout import Layout

    values = {**values, **imposed}
    full = check(values)
    while True:
        drop = [name for name, need, _ in unmet_needs(Layout(), full)
                if name in values and set(need_settings(need)) & set(imposed)]
        if not drop:
            return values
        for name in drop:
            del values[name]
            full[name] = SETTINGS[name].default


def config_sections() -> dict[str, dict]:
    """``{section: {name: default}}`` of the settings a config file can hold (what a recipe's
    DEFAULTS holds for the Trainer)."""
    sections: dict[str, dict] = {section: {} for section in SECTIONS}
    for s in SETTINGS.values():
        if s.config:
            default = s.default  # TOML has arrays, not tuples
            sections[s.section][s.name] = list(default) if isinstance(default, tuple) else default
    return sections


def python_only() -> frozenset[str]:
    """The settings a config file cannot hold (objects: a model, callbacks, a loss function):
    passed as ``Trainer(name=...)`` only."""
    return frozenset(name for name, s in SETTINGS.items() if not s.config)


def flatten(config: dict) -> dict:
    """The Trainer sections of a resolved config -> Trainer keywords. Other sections (a
    recipe's own, e.g. [model]) are ignored; TOML stand-ins are converted: ``"none"`` -> None
    where None is allowed, arrays -> lists."""
    flat: dict[str, object] = {}
    for section in SECTIONS:
        for name, value in config.get(section, {}).items():
            setting = SETTINGS.get(name)
            if setting is None or setting.section != section or not setting.config:
                raise ConfigError(unknown_key_message(config_sections(), section, name,
                                                      "the config", python_only()))
            if isinstance(value, str) and setting.none and value.strip().lower() in ("none", ""):
                value = None
            elif isinstance(value, tuple):
                value = list(value)
            flat[name] = value
    return flat


# -- documentation, written by reference.py from the definitions above ------------------------
def reference_markdown() -> str:
    """The text of docs/reference.md: every setting by section, then the callbacks' arguments."""
    from meshtrain.settings.reference import reference_markdown as text

    return text()


def docstring() -> str:
    """An ``Args:`` block for the Trainer's docstring, by section (defaults as Python)."""
    from meshtrain.settings.reference import docstring as text

    return text()
