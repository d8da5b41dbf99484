"""Job configuration: TOML files, ``--section.key=value`` overrides, and the resolved result.

A config is a two-level mapping (``[section]`` then ``key = value``). Resolution is
``defaults <- file <- overrides``; a key the defaults do not know is an error that lists the
known ones, so a typo never passes silently.
"""

from __future__ import annotations

import copy
import json
import tomllib
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
            f"cannot read override {text!r}: write --section.key=value, e.g. --trainer.max_steps=10"
        )
    dotted, raw = body.split("=", 1)
    section, key = dotted.split(".", 1)
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw  # a bare word is a string: --trainer.layout=dp=2
    return section, key, value


def resolve(defaults: dict, file_config: dict, overrides: list[str]) -> dict:
    """Merge ``file_config`` and ``overrides`` onto ``defaults``; reject unknown keys."""
    config = copy.deepcopy(defaults)

    def put(section: str, key: str, value, origin: str) -> None:
        if section not in config:
            raise ConfigError(
                f"unknown section [{section}] in {origin}; known sections: {', '.join(config)}"
            )
        if key not in config[section]:
            known = ", ".join(config[section])
            raise ConfigError(f"unknown key {section}.{key} in {origin}; known keys: {known}")
        config[section][key] = value

    for section, values in file_config.items():
        if not isinstance(values, dict):
            raise ConfigError(f"top-level key {section!r} must be a [section] table")
        for key, value in values.items():
            put(section, key, value, "the config file")
    for text in overrides:
        section, key, value = parse_override(text)
        put(section, key, value, f"override {text!r}")
    return config


def dumps_toml(config: dict) -> str:
    """Write a two-level config back as TOML (None values are left out: TOML has no null)."""
    lines: list[str] = []
    for section, values in config.items():
        lines.append(f"[{section}]")
        for key, value in values.items():
            if value is not None:
                lines.append(f"{key} = {json.dumps(value)}")
        lines.append("")
    return "\n".join(lines)
