"""Hyperparameter search: many meshtrain trials at once, each on its own slice of the machine
and under its own layout, driven by an Optuna study kept in a database (``meshtrain sweep``)."""

from meshtrain.sweep.controller import run_sweep
from meshtrain.sweep.space import SweepSpec, load_spec

__all__ = ["SweepSpec", "load_spec", "run_sweep"]
