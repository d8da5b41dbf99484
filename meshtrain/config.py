"""Job configuration: TOML files, ``--section.key=value`` (or ``--section.key value``)
overrides, and the resolved result.

A config is a two-level mapping (``[section]`` then ``key = value``). Resolution is
``defaults <- file <- overrides``; a key the defaults do not know is an error that lists the
known ones, so a typo never passes silently.
"""

from __future__ import annotations

import copy
import difflib
import json
import math
import os
import tomllib
from collections.abc import Collection
from pathlib import Path

from meshtrain.errors import ConfigError


def load_toml(path: str | Path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist; pass the path of a .toml file")
    try:
        return tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as error:
        raise ConfigError(f"cannot parse {path}: {error}") from None


def parse_override(text: str) -> tuple[str, str, object]:
    """``--trainer.max_steps=10`` -> ("trainer", "max_steps", 10). Values are read as TOML."""
    body = text[2:] if text.startswith("--") else text
    if "=" not in body or "." not in body.split("=", 1)[0]:
        raise ConfigError(
            f"cannot read override {text!r}: write --section.key=value or --section.key value, "
            "e.g. --trainer.max_steps=10"
        )
    dotted, raw = body.split("=", 1)
    section, key = dotted.split(".", 1)
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw  # a bare word is a string: --trainer.layout=dp=2
    return section, key, value


def join_overrides(args: list[str]) -> list[str]:
    """``--section.key value`` pairs joined into ``--section.key=value`` (LightningCLI's and
    torchtitan's space form beside meshtrain's ``=`` form); other arguments as they are."""
    joined, i = [], 0
    while i < len(args):
        arg = args[i]
        name = arg[2:] if arg.startswith("--") else ""
        if name and "=" not in name and "." in name and i + 1 < len(args) and \
                not args[i + 1].startswith("--"):
            joined.append(f"{arg}={args[i + 1]}")
            i += 2
            continue
        joined.append(arg)
        i += 1
    return joined


def unknown_key_message(known: dict[str, dict], section: str, key: str, origin: str,
                        python_only: Collection[str] = ()) -> str:
    """Why ``[section] key`` is not in ``known`` (a two-level defaults mapping), and the fix:
    the section it belongs in, the closest known key, or that it is one of the Trainer's
    ``python_only`` settings (meshtrain.settings.python_only())."""
    elsewhere = [name for name, keys in known.items() if key in keys and name != section]
    if elsewhere:
        right = elsewhere[0]
        return (f"{section}.{key} in {origin}: {key} is a [{right}] setting, not [{section}]; "
                f"write it under [{right}] (or --{right}.{key}=...)")
    if key in python_only:
        return (f"{section}.{key} in {origin}: {key} is a Python-only Trainer setting (a config "
                f"file cannot hold it); pass Trainer({key}=...) in your recipe's run()")
    message = f"unknown key {section}.{key} in {origin}"
    close = difflib.get_close_matches(key, list(known.get(section, {})), n=1)
    others = {k: name for name, keys in known.items() if name != section for k in keys}
    close_elsewhere = difflib.get_close_matches(key, list(others), n=1)
    if close:
        message += f"; did you mean {section}.{close[0]}?"
    elif close_elsewhere:
        message += f"; did you mean {others[close_elsewhere[0]]}.{close_elsewhere[0]}?"
    return message + f" known keys of [{section}]: {', '.join(known.get(section, {}))}"


def resolve(defaults: dict, file_config: dict, overrides: list[str],
            python_only: Collection[str] = (), notes: list | None = None) -> dict:
    """Merge ``file_config`` and ``overrides`` onto ``defaults``; reject unknown keys (naming
    the right section of a key written in the wrong one, the closest known key, or that it is
    one of ``python_only``: see :func:`unknown_key_message`). torchtitan's names are read as
    meshtrain's (meshtrain/settings/torchtitan.py), each said in ``notes``."""
    from meshtrain.settings.torchtitan import from_torchtitan

    config = copy.deepcopy(defaults)

    def put(section: str, key: str, value, origin: str) -> None:
        if section not in config:
            close = difflib.get_close_matches(section, list(config), n=1)
            hint = f"; did you mean [{close[0]}]?" if close else ";"
            raise ConfigError(
                f"unknown section [{section}] in {origin}{hint} known sections: "
                f"{', '.join(config)}"
            )
        if key not in config[section]:
            raise ConfigError(unknown_key_message(config, section, key, origin, python_only))
        config[section][key] = value

    for section, values in file_config.items():
        if not isinstance(values, dict):
            raise ConfigError(f"top-level key {section!r} must be a [section] table")
    levels = [[(section, key, value, "the config file")
               for section, values in file_config.items() for key, value in values.items()],
              [(*parse_override(text), f"override {text!r}")
               for text in join_overrides(list(overrides))]]
    levels, said = from_torchtitan(levels, config)
    for level in levels:
        for section, key, value, origin in level:
            put(section, key, value, origin)
    if notes is not None:
        notes.extend(said)
    return config


def toml_value(value) -> str:
    """One value as TOML (``None``, which TOML lacks, as ``none``)."""
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return repr(value) if math.isfinite(value) else ("nan" if math.isnan(value) else
                                                        ("inf" if value > 0 else "-inf"))
    if isinstance(value, (str, os.PathLike)):
        return json.dumps(os.fspath(value))
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_toml_key(k)} = {toml_value(v)}" for k, v in value.items()) + "}"
    return json.dumps(str(value))


def _toml_key(key) -> str:
    key = str(key)
    return key if key and all(c.isalnum() or c in "_-" for c in key) else json.dumps(key)


def dumps_toml(config: dict) -> str:
    """Write a two-level config back as TOML. ``None`` (TOML has no null) is written as a
    comment, ``# key = none``, so that every key shows and the text reads back the same."""
    lines: list[str] = []
    for section, values in config.items():
        lines.append(f"[{section}]")
        for key, value in values.items():
            prefix = "# " if value is None else ""
            lines.append(f"{prefix}{_toml_key(key)} = {toml_value(value)}")
        lines.append("")
    return "\n".join(lines)
