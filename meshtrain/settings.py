"""Every Trainer setting, defined once: name, section, default, type, one-line doc, check.

The Python API (``Trainer(**keywords)``), the TOML sections of a recipe's config and their
``--section.key=value`` overrides, the ``--dry-run`` listing, the Trainer's ``Args:`` docstring
and ``docs/reference.md`` (``python tools/gen_reference.py``) all come from :data:`SETTINGS`.

The table is meshtrain/setting_table.py, the kinds of value meshtrain/setting_types.py.
A setting's check there looks at its own value only (type, range, choices). Checks that need
several settings or the layout (``stall_timeout_s < collective_timeout_s``, DDP settings without
DDP, ``sequence_parallel`` without ``tp``) stay with the code they protect (Trainer, fault.py).
TOML has no null: in a config ``"none"`` stands for ``None`` (:func:`flatten` converts it).
"""

from __future__ import annotations

import difflib

from meshtrain.config import unknown_key_message
from meshtrain.errors import ConfigError
from meshtrain.setting_table import DEFINITIONS
from meshtrain.setting_types import SECTIONS, Setting

__all__ = ["SECTIONS", "SETTINGS", "Setting", "check", "config_sections", "defaults", "flatten",
           "docstring", "reference_markdown"]

SETTINGS: dict[str, Setting] = {
    s.name: s for section in SECTIONS for s in DEFINITIONS if s.section == section}
assert len(SETTINGS) == len(DEFINITIONS), "a setting is defined twice"


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


def config_sections() -> dict[str, dict]:
    """``{section: {name: default}}`` of the settings a config file can hold (what a recipe's
    DEFAULTS holds for the Trainer)."""
    sections: dict[str, dict] = {section: {} for section in SECTIONS}
    for s in SETTINGS.values():
        if s.config:
            default = s.default  # TOML has arrays, not tuples
            sections[s.section][s.name] = list(default) if isinstance(default, tuple) else default
    return sections


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
                                                      "the config"))
            if isinstance(value, str) and setting.none and value.strip().lower() in ("none", ""):
                value = None
            elif isinstance(value, tuple):
                value = list(value)
            flat[name] = value
    return flat


# -- documentation, written by meshtrain/reference.py from the definitions above ---------------
def reference_markdown() -> str:
    """The text of docs/reference.md: every setting by section, then the callbacks' arguments."""
    from meshtrain.reference import reference_markdown as text

    return text()


def docstring() -> str:
    """An ``Args:`` block for the Trainer's docstring, by section (defaults as Python)."""
    from meshtrain.reference import docstring as text

    return text()
