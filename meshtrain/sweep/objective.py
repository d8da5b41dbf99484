"""The sweep's objective metric against what the job logs.

Before any trial where the job's recipe names the metrics its run logs (``metrics(config)``, as
the built-in recipes do); otherwise inside the first trial, at its first validation (or, without
validation data, its first log), where the trial fails with the reason and the sweep stops
(meshtrain/sweep/trial.py). Either way the reason names the metric, the names the job logs and
the closest one ("did you mean 'val/loss'?")."""

from __future__ import annotations

import difflib


def missing_metric(metric: str, logged, where: str = "the job") -> str:
    """Why ``metric`` is not an objective ``where`` can give: what it logs, the closest name."""
    names = sorted(set(logged))
    close = difflib.get_close_matches(metric, names, n=1, cutoff=0.6)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    return (f"the objective metric {metric!r} is not logged by {where}, which logs "
            f"{', '.join(names) or 'no metric'}.{hint} Set [objective] metric in the space "
            "file to one of those")


def declared_metrics(recipe, configs) -> list[str] | None:
    """Every name the recipe's ``metrics(config)`` gives over ``configs`` (the job's config
    and one per searched value), or None when the recipe does not say what it logs."""
    declare = getattr(recipe, "metrics", None)
    if not callable(declare):
        return None
    return sorted({name for config in configs for name in declare(config)})
