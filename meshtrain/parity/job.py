"""What ``meshtrain parity`` trains: the job (a config's recipe ``job(config)`` or a Python entry
point ``module:function``) and the Trainer settings of each run."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

from meshtrain.errors import ConfigError
from meshtrain.parallel.layout import Layout, _parse_pairs

#: settings every parity run uses, whatever the job says: nothing but training
QUIET = dict(loggers=(), progress_bar=False, report=False, save_final_checkpoint=False, resume=None,
             checkpoint_every_n_steps=None, checkpoint_every_n_minutes=None,
             checkpoint_every_n_epochs=None,
             val_every_n_steps=None, log_every_n_steps=1, log_grad_norm=True, max_epochs=None)


@dataclass
class Source:
    """Where the job comes from: a TOML config (with overrides) or a ``module:function``."""

    target: str
    overrides: tuple[str, ...] = ()

    @property
    def is_config(self) -> bool:
        return self.target.endswith(".toml") or os.path.isfile(self.target)

    def load(self) -> dict:
        """The job mapping, with ``settings`` resolved (overrides applied and checked)."""
        from meshtrain import settings

        if self.is_config:
            from meshtrain.recipes import resolve_config

            recipe, config, flat = resolve_config(self.target, list(self.overrides))
            make = getattr(recipe, "job", None)
            if make is None:
                raise ConfigError(
                    f"the recipe of {self.target} has no job(config) function, which meshtrain "
                    "parity calls to build the model, data, optimizer and loss; add one (see "
                    "meshtrain/recipes/char_lm.py) or point parity at a Python entry point")
            job = dict(make(config))
            job["settings"] = {**flat, **job.get("settings", {})}
        else:
            job = dict(_entry_point(self.target)())
            job["settings"] = _apply_overrides(dict(job.get("settings", {})), self.overrides)
            settings.check(job["settings"])
        missing = [k for k in ("model", "train_data", "optimizer") if job.get(k) is None]
        if missing:
            raise ConfigError(f"the job from {self.target} has no {', '.join(missing)}; it must "
                              "give model, train_data, optimizer (and loss_fn unless the model "
                              "returns its loss)")
        return job


def _entry_point(target: str):
    import importlib

    module_name, _, attribute = target.partition(":")
    if not module_name or not attribute:
        raise ConfigError(f"cannot read {target!r}: give a config file (.toml) or a Python entry "
                          "point 'package.module:function' that returns the job")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        raise ConfigError(f"cannot import {module_name!r} for {target!r} ({error}); it must be "
                          f"importable from the current directory ({os.getcwd()}) or "
                          "PYTHONPATH") from None
    function = getattr(module, attribute, None)
    if not callable(function):
        raise ConfigError(f"{module_name!r} has no function {attribute!r} (from {target!r})")
    return function


def _apply_overrides(flat: dict, overrides) -> dict:
    from meshtrain import settings
    from meshtrain.config import parse_override, unknown_key_message

    for text in overrides:
        section, key, value = parse_override(text)
        setting = settings.SETTINGS.get(key)
        if setting is None or setting.section != section:
            raise ConfigError(unknown_key_message(settings.config_sections(), section, key,
                                                  f"override {text!r}", settings.python_only()))
        flat[key] = value
    return flat


# -- one run ---------------------------------------------------------------------------------
def layout_world_size(layout: str) -> int:
    """How many processes ``layout`` needs (``Layout.processes_of``; no 'auto' axis)."""
    if any(str(v).strip().lower() in ("auto", "-1") for v in _parse_pairs(layout).values()):
        raise ConfigError(f"layout {layout!r}: meshtrain parity needs every degree written out "
                          "(no 'auto'), so it knows how many processes to start")
    return Layout.processes_of(layout)


def run_settings(job: dict, layout: str | None, steps: int, run_dir: str,
                 extra: dict | None = None) -> dict:
    """The Trainer settings of one run: the job's (and ``extra``), quiet, under ``layout`` (one
    process when None). A setting that needs what this layout lacks (``tp_plan`` without tp, a pipeline
    schedule without pp, a DDP hook without DDP: its ``needs`` in meshtrain/settings/table.py)
    is left out, so that the one-process reference and every other layout train without it."""
    from meshtrain import settings as table
    from meshtrain.parallel.layout import Layout

    world = 1 if not layout else layout_world_size(layout)
    settings = {**job["settings"], **(extra or {}), **QUIET, "layout": layout or None,
                "devices": world, "max_steps": steps, "run_dir": run_dir}
    if layout and "ps" in _parse_pairs(layout):  # the servers alone know the global norm
        settings["log_grad_norm"] = False
    for name in table.inapplicable(Layout.parse(layout or None, world), table.check(settings),
                                   imposed=QUIET):
        del settings[name]  # (its default, which needs nothing)
    return settings


def floor_split(job: dict) -> int | None:
    """The micro-batch size of the one-process float64 run that shows the model's own floor
    (what another order of the same sums moves): half the global batch, or the whole batch
    where the job splits it; None where it cannot be split."""
    from meshtrain import settings

    whole = job["settings"].get("global_batch_size",
                                settings.SETTINGS["global_batch_size"].default)
    micro = job["settings"].get("micro_batch_size")
    if micro is not None and micro < whole:
        return whole
    return whole // 2 if whole % 2 == 0 and whole >= 2 else None
