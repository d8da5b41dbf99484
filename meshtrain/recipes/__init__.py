"""Recipes: complete jobs described by a TOML config (``meshtrain train CONFIG.toml``).

A config names its recipe in ``[job] recipe = "..."``: a built-in name (``char_lm``) or an import
path ``"package.module:attribute"`` (or ``"package.module"``) of your own, importable from the
current directory or ``PYTHONPATH``. A recipe is a module or object with

- ``DEFAULTS``: every key its config accepts, ``{section: {key: default}}``. The Trainer's part
  is ``meshtrain.settings.config_sections()`` (sections ``[trainer]``, ``[parallel]``,
  ``[pipeline]``, ``[checkpoint]``, ``[fault]``, ``[logging]``), with the recipe's own defaults
  written over it;
- ``run(config, mode="train")``, where mode is ``train``, ``lr-find`` or ``memory`` (one step,
  then the per-rank model-state table); ``Trainer(**settings.flatten(config), ...)`` builds the
  Trainer from the config;
- optionally ``check(config, mode="train")``, which ``--dry-run`` calls to validate the config
  without training (it may return a one-line summary): every check ``run`` would make before
  any process starts, e.g. ``Trainer.check(model, train_data, ...)`` as the built-in recipes do.
  Without it, ``--dry-run`` builds ``Trainer(**settings.flatten(config))`` and, when the recipe
  has ``job(config)``, runs ``Trainer.check`` on that job;
- optionally ``job(config)``, which ``meshtrain parity`` calls: a mapping with ``model`` (a
  factory), ``train_data``, ``optimizer`` (a factory), ``loss_fn`` and ``lr_scheduler`` (see
  meshtrain/parity.py);
- optionally ``metrics(config)``: every metric name ``run`` logs (the Trainer's are
  ``meshtrain.metrics.fit_metric_names``; add what the model logs itself), so that
  ``meshtrain sweep`` checks its objective before any trial instead of in the first one.
"""

from __future__ import annotations

import copy
import difflib
import importlib
import importlib.util
import os
import sys
import traceback

from meshtrain import settings
from meshtrain.check_skips import collecting
from meshtrain.config import dumps_toml, load_toml, resolve
from meshtrain.errors import ConfigError

MODES = ("train", "lr-find", "memory")
BUILTIN = ("char_lm", "causal_lm")


def load_recipe(name: str, origin: str = "the config"):
    """The recipe ``[job] recipe = name`` names: a built-in one or ``module:attribute``."""
    if not isinstance(name, str) or not name:
        raise ConfigError(f"[job] recipe in {origin} must be a recipe name or an import path "
                          f"'package.module:attribute', got {name!r}")
    if name in BUILTIN:
        return importlib.import_module(f"meshtrain.recipes.{name}")
    if os.getcwd() not in sys.path and "" not in sys.path:  # as `python -m` would
        sys.path.append(os.getcwd())
    if ":" not in name and "." not in name and importlib.util.find_spec(name) is None:
        close = difflib.get_close_matches(name, BUILTIN, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ";"
        raise ConfigError(
            f"unknown recipe {name!r} in {origin}{hint} built-in recipes: {', '.join(BUILTIN)}; "
            "or name your own by import path, e.g. recipe = \"mypkg.train:recipe\"")
    module_name, _, attribute = name.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        if error.name and (module_name + ".").startswith(error.name + "."):  # the module itself
            raise ConfigError(
                f"recipe {name!r} in {origin}: cannot import module {module_name!r} (no module "
                f"named {error.name!r}); it must be importable from the current directory "
                f"({os.getcwd()}) or PYTHONPATH") from None
        raise ConfigError(f"recipe {name!r} in {origin}: importing {module_name!r} failed: "
                          f"{_where(error)}") from None
    except Exception as error:  # noqa: BLE001 -- the user's module is broken: say where
        raise ConfigError(f"recipe {name!r} in {origin}: importing {module_name!r} failed: "
                          f"{_where(error)}") from None
    recipe = module
    if attribute:
        try:
            for part in attribute.split("."):
                recipe = getattr(recipe, part)
        except AttributeError:
            raise ConfigError(f"recipe {name!r} in {origin}: module {module_name!r} has no "
                              f"attribute {attribute!r}") from None
    missing = [what for what, ok in (
        ("DEFAULTS (a dict of sections)", isinstance(getattr(recipe, "DEFAULTS", None), dict)),
        ("run(config, mode)", callable(getattr(recipe, "run", None)))) if not ok]
    if missing:
        raise ConfigError(f"recipe {name!r} in {origin} is not a recipe: it has no "
                          f"{' and no '.join(missing)} (see meshtrain/recipes/__init__.py)")
    return recipe


def _where(error: BaseException) -> str:
    frames = traceback.extract_tb(error.__traceback__)
    place = f" ({frames[-1].filename}:{frames[-1].lineno})" if frames else ""
    return f"{type(error).__name__}: {error}{place}"


def resolve_config(path: str, overrides: list[str]):
    """(recipe, resolved config, Trainer keywords) for a config file and its overrides."""
    return resolve_with_notes(path, overrides)[:3]


def resolve_with_notes(path: str, overrides: list[str]):
    """:func:`resolve_config`'s three, and the lines saying which torchtitan names were read
    as which meshtrain settings."""
    file_config = load_toml(path)
    job = file_config.get("job", {})
    name = job.get("recipe", "char_lm") if isinstance(job, dict) else "char_lm"
    recipe = load_recipe(name, origin=path)
    defaults = copy.deepcopy(recipe.DEFAULTS)
    defaults.setdefault("job", {}).setdefault("recipe", name)
    notes: list[str] = []  # torchtitan's names read as meshtrain's
    config = resolve(defaults, file_config, overrides, settings.python_only(), notes)
    if config.get("logging", {}).get("name") == "auto":  # the job is named after its config
        config["logging"]["name"] = os.path.splitext(os.path.basename(path))[0]
    flat = settings.flatten(config)
    settings.check(flat)  # every Trainer setting's own check, before anything starts
    return recipe, config, flat, notes


def run_config(path: str, overrides: list[str], mode: str = "train", dry_run: bool = False):
    """Resolve a config and run its recipe; with ``dry_run``, print the resolved config, check
    it (every check made before any process starts; no process group is created) and return
    without training."""
    assert mode in MODES, mode
    recipe, config, flat, said = resolve_with_notes(path, overrides)
    if os.environ.get("RANK", "0") == "0":
        title = "dry run: " if dry_run else ""
        python_only = [s.name for s in settings.SETTINGS.values() if not s.config]
        note = (f"# Python-only Trainer settings (not in a config): {', '.join(python_only)}\n"
                if dry_run and flat else "")
        said = "".join(f"# {line}\n" for line in said)
        print(f"# {title}resolved config ({path})\n{said}{dumps_toml(config)}{note}", flush=True)
    if not dry_run:
        return recipe.run(config, mode=mode)
    check, summary = getattr(recipe, "check", None), None
    with collecting() as skipped:  # (the checks that could not run, said below)
        if check is not None:
            summary = check(config, mode=mode)
        elif flat:
            from meshtrain.trainer import Trainer

            trainer = Trainer(**flat)
            if callable(getattr(recipe, "job", None)):  # the model against the layout, the data
                job = recipe.job(config)
                trainer.check(job["model"], job["train_data"], optimizer=job["optimizer"],
                              loss_fn=job.get("loss_fn"), lr_scheduler=job.get("lr_scheduler"))
    for line in skipped:
        print(f"# {line}", flush=True)
    print(f"config OK{f': {summary}' if summary else ''} (dry run: nothing was trained)",
          flush=True)
    return None
