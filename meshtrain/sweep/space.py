"""A sweep's description (SPACE.toml): the objective, the search space over config keys, the
trial budget and how the machine is split; checked against the job's config before anything runs.

    [objective]
    metric = "val/loss"            # a validation metric the trials log
    direction = "minimize"         # or "maximize"

    [sweep]                        # each also a command-line flag (--trials 8, ...)
    trials = 8
    devices_per_trial = 1          # CPU cores (or GPUs) per trial
    concurrent = 0                 # trials at once; 0: as many as the devices allow
    sampler = "tpe"                # "tpe" or "random"
    pruner = "median"              # "median", "hyperband" or "none"
    pruner_startup_trials = 2      # trials finished before the median pruner prunes
    seed = 0                       # the sampler's seed; trial k trains with seed + k
    storage = ""                   # "": SQLite in the sweep folder; or a database URL
    study = ""                     # "": the job's name

    [params]
    "optimizer.lr" = { low = 1e-4, high = 1e-2, log = true }
    "model.num_layers" = { choices = [2, 4] }
    "trainer.layout" = { choices = ["dp=2", "zero2=2"] }
    "model.d_model" = { low = 64, high = 256, step = 64 }

    [[enqueue]]                    # trials to run first, with these values
    "optimizer.lr" = 3e-3
"""

from __future__ import annotations

import dataclasses
import math

from meshtrain.config import load_toml, toml_value
from meshtrain.errors import ConfigError

SWEEP_DEFAULTS = {"trials": 8, "devices_per_trial": 1, "concurrent": 0, "sampler": "tpe",
                  "pruner": "median", "pruner_startup_trials": 2, "seed": 0, "storage": "",
                  "study": ""}
SAMPLERS, PRUNERS, DIRECTIONS = ("tpe", "random"), ("median", "hyperband", "none"), (
    "minimize", "maximize")


@dataclasses.dataclass
class Param:
    """One searched config key: ``choices`` (categorical), else a range ``low``..``high``
    (integers when both ends are, ``log`` scale, ``step``)."""

    key: str
    choices: tuple | None = None
    low: float | int | None = None
    high: float | int | None = None
    log: bool = False
    step: float | int | None = None

    @property
    def is_int(self) -> bool:
        return self.choices is None and all(
            isinstance(v, int) and not isinstance(v, bool) for v in (self.low, self.high))

    def distribution(self):
        import optuna

        if self.choices is not None:
            return optuna.distributions.CategoricalDistribution(list(self.choices))
        if self.is_int:
            return optuna.distributions.IntDistribution(self.low, self.high, log=self.log,
                                                        step=self.step or 1)
        return optuna.distributions.FloatDistribution(float(self.low), float(self.high),
                                                      log=self.log, step=self.step)

    def examples(self) -> list:
        """Values that stand for the whole range in the config check."""
        return list(self.choices) if self.choices is not None else [self.low, self.high]

    def describe(self) -> str:
        if self.choices is not None:
            return f"one of {list(self.choices)}"
        scale = ", log scale" if self.log else ""
        step = f", step {self.step}" if self.step else ""
        kind = "integer" if self.is_int else "float"
        return f"{kind} in [{self.low}, {self.high}]{scale}{step}"


@dataclasses.dataclass
class SweepSpec:
    metric: str = "val/loss"
    direction: str = "minimize"
    params: list[Param] = dataclasses.field(default_factory=list)
    enqueue: list[dict] = dataclasses.field(default_factory=list)
    trials: int = 8
    devices_per_trial: int = 1
    concurrent: int = 0
    sampler: str = "tpe"
    pruner: str = "median"
    pruner_startup_trials: int = 2
    seed: int = 0
    storage: str = ""
    study: str = ""

    def distributions(self) -> dict:
        return {p.key: p.distribution() for p in self.params}


def _param(key: str, body) -> Param:
    where = f"[params] {key!r}"
    if not isinstance(key, str) or key.count(".") != 1:
        raise ConfigError(f"{where}: a searched key is 'section.key', e.g. 'optimizer.lr'")
    if not isinstance(body, dict):
        raise ConfigError(f"{where} must be a table: {{ low = ..., high = ... }} or "
                          "{ choices = [...] }")
    unknown = set(body) - {"choices", "low", "high", "log", "step"}
    if unknown:
        raise ConfigError(f"{where}: unknown field(s) {sorted(unknown)}; a range takes low, "
                          "high, log, step; a choice takes choices")
    if "choices" in body:
        choices = body["choices"]
        if set(body) != {"choices"}:
            raise ConfigError(f"{where}: choices cannot be combined with a range")
        if not isinstance(choices, list) or not choices:
            raise ConfigError(f"{where}: choices must be a non-empty list")
        if any(isinstance(c, (list, dict)) for c in choices):
            raise ConfigError(f"{where}: each choice must be a single value (a number, string "
                              "or boolean)")
        return Param(key, choices=tuple(choices))
    if "low" not in body or "high" not in body:
        raise ConfigError(f"{where}: a range needs both low and high")
    low, high = body["low"], body["high"]
    for name, value in (("low", low), ("high", high)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(
                value):
            raise ConfigError(f"{where}: {name} must be a finite number, got {value!r}")
    if low > high:
        raise ConfigError(f"{where}: low {low} > high {high}; swap them")
    log, step = body.get("log", False), body.get("step")
    if not isinstance(log, bool):
        raise ConfigError(f"{where}: log must be true or false, got {log!r}")
    if log and low <= 0:
        raise ConfigError(f"{where}: a log-scale range needs low > 0, got {low}")
    if step is not None and (isinstance(step, bool) or not isinstance(step, (int, float))
                             or step <= 0 or log):
        raise ConfigError(f"{where}: step must be a positive number (and not with log), got "
                          f"{step!r}")
    return Param(key, low=low, high=high, log=log, step=step)


def load_spec(path: str | None = None, *, table: dict | None = None, **flags) -> SweepSpec:
    """The sweep described by the TOML file ``path`` (or the mapping ``table``), with
    command-line ``flags`` (the ``[sweep]`` keys) written over it. Raises ``ConfigError``."""
    table = load_toml(path) if path is not None else dict(table or {})
    origin = path or "the space"
    unknown = set(table) - {"objective", "sweep", "params", "enqueue"}
    if unknown:
        raise ConfigError(f"{origin}: unknown section(s) {sorted(unknown)}; a space file has "
                          "[objective], [sweep], [params] and [[enqueue]]")
    objective = dict(table.get("objective", {}))
    bad = set(objective) - {"metric", "direction"}
    if bad:
        raise ConfigError(f"{origin}: [objective] takes metric and direction, not {sorted(bad)}")
    sweep = dict(SWEEP_DEFAULTS)
    for key, value in table.get("sweep", {}).items():
        if key not in SWEEP_DEFAULTS:
            raise ConfigError(f"{origin}: unknown [sweep] key {key!r}; known: "
                              f"{', '.join(SWEEP_DEFAULTS)}")
        sweep[key] = value
    sweep.update({k: v for k, v in flags.items() if v is not None})
    params = [_param(key, body) for key, body in table.get("params", {}).items()]
    if not params:
        raise ConfigError(f"{origin}: [params] is empty: name at least one config key to "
                          "search, e.g. \"optimizer.lr\" = { low = 1e-4, high = 1e-2, log = true }")
    spec = SweepSpec(metric=objective.get("metric", "val/loss"),
                     direction=objective.get("direction", "minimize"), params=params,
                     enqueue=list(table.get("enqueue", [])), **sweep)
    _check(spec, origin)
    return spec


def _check(spec: SweepSpec, origin: str) -> None:
    def positive(name, value, minimum=1):
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise ConfigError(f"{origin}: {name} must be an integer >= {minimum}, got {value!r}")

    positive("trials", spec.trials)
    positive("devices_per_trial", spec.devices_per_trial)
    positive("concurrent", spec.concurrent, 0)
    positive("pruner_startup_trials", spec.pruner_startup_trials, 0)
    positive("seed", spec.seed, 0)
    for name, value, allowed in (("direction", spec.direction, DIRECTIONS),
                                 ("sampler", spec.sampler, SAMPLERS),
                                 ("pruner", spec.pruner, PRUNERS)):
        if value not in allowed:
            raise ConfigError(f"{origin}: {name} must be one of {', '.join(allowed)}, got "
                              f"{value!r}")
    if not isinstance(spec.metric, str) or not spec.metric:
        raise ConfigError(f"{origin}: [objective] metric must name a validation metric, e.g. "
                          "\"val/loss\"")
    keys = {p.key for p in spec.params}
    for i, values in enumerate(spec.enqueue):
        if not isinstance(values, dict) or not set(values) <= keys:
            raise ConfigError(f"{origin}: [[enqueue]] #{i + 1} may only set searched keys "
                              f"({', '.join(sorted(keys))}), got {values!r}")


def param_overrides(params: dict) -> list[str]:
    """A trial's parameters as the ``--key=value`` overrides of the job's config it runs."""
    return [f"--{key}={toml_value(value)}" for key, value in sorted(params.items())]
