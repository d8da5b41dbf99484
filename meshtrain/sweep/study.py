"""The sweep's Optuna study: its storage (SQLite in the sweep folder by default, or any
database URL SQLAlchemy opens), sampler and pruner, created once and loaded again by a restarted
sweep or by another machine's sweep on the same storage."""

from __future__ import annotations

from pathlib import Path

from meshtrain.errors import ConfigError


def storage_url(storage: str, sweep_dir: Path) -> str:
    return storage or f"sqlite:///{(Path(sweep_dir) / 'study.db').resolve()}"


def open_storage(url: str):
    """The study storage at ``url``; a ``ConfigError`` naming it when it cannot be opened."""
    import optuna

    try:
        return optuna.storages.RDBStorage(url, engine_kwargs=_engine_kwargs(url))
    except Exception as error:  # noqa: BLE001 -- any driver's error: say which URL and why
        reason = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise ConfigError(f"cannot open the sweep's storage {url!r}: {reason}. Give a database "
                          "URL SQLAlchemy can open (sqlite:///path/study.db, "
                          "postgresql://user:password@host/db) or leave storage empty for a "
                          "SQLite file in the sweep folder") from None


def _engine_kwargs(url: str) -> dict:
    # several trial processes write to one SQLite file: wait for its lock instead of failing
    return {"connect_args": {"timeout": 60}} if url.startswith("sqlite") else {}


def make_pruner(name: str, startup_trials: int):
    """The pruner ``name`` (an Optuna study does not store its pruner: the sweep and each
    trial build the same one)."""
    import optuna

    if name == "median":
        return optuna.pruners.MedianPruner(n_startup_trials=startup_trials, n_warmup_steps=0)
    if name == "hyperband":
        return optuna.pruners.HyperbandPruner()
    return optuna.pruners.NopPruner()


def make_study(spec, url: str, name: str):
    """Create the study ``name`` at ``url``, or load it when it exists (a restarted sweep)."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    sampler = (optuna.samplers.TPESampler(seed=spec.seed) if spec.sampler == "tpe"
               else optuna.samplers.RandomSampler(seed=spec.seed))
    pruner = make_pruner(spec.pruner, spec.pruner_startup_trials)
    storage = open_storage(url)
    study = optuna.create_study(study_name=name, storage=storage, sampler=sampler,
                                pruner=pruner, direction=spec.direction, load_if_exists=True)
    if study.direction.name.lower() != spec.direction:
        raise ConfigError(f"study {name!r} in {url} was created to {study.direction.name.lower()}"
                          f" its objective, not {spec.direction}; use another study name")
    return study
