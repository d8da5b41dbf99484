"""Recipes: complete jobs described by a TOML config (``meshtrain train CONFIG.toml``).

A config names its recipe in ``[job] recipe = "..."``; each recipe module has ``DEFAULTS`` (every
key it accepts, with its default) and ``run(config, mode="train")``, where mode is ``train``,
``lr-find`` or ``memory`` (one step, then the per-rank model-state table).
"""

from __future__ import annotations

import os

from meshtrain.config import load_toml, resolve
from meshtrain.errors import ConfigError


def _recipes() -> dict:
    from meshtrain.recipes import char_lm

    return {"char_lm": char_lm}


MODES = ("train", "lr-find", "memory")


def run_config(path: str, overrides: list[str], mode: str = "train"):
    assert mode in MODES, mode
    file_config = load_toml(path)
    name = file_config.get("job", {}).get("recipe", "char_lm")
    recipes = _recipes()
    if name not in recipes:
        raise ConfigError(f"unknown recipe {name!r} in {path}; known: {', '.join(recipes)}")
    recipe = recipes[name]
    config = resolve(recipe.DEFAULTS, file_config, overrides)
    if os.environ.get("RANK", "0") == "0":
        from meshtrain.config import dumps_toml

        print(f"# resolved config ({path})\n{dumps_toml(config)}", flush=True)
    return recipe.run(config, mode=mode)
