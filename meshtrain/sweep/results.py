"""What a sweep leaves: a ranked table of its trials (and why each failed one failed), the best
trial's whole config as a TOML that ``meshtrain train`` takes, and Optuna's plots (history,
parameter importance, parallel coordinates) as images in the sweep folder."""

from __future__ import annotations

import math
from pathlib import Path

from meshtrain.config import dumps_toml
from meshtrain.parity.verdict import table
from meshtrain.sweep.space import param_overrides

BEST = "best.toml"


def ranked(study, direction: str) -> list:
    """Finished trials first, best objective first; then pruned, failed and running ones."""
    import optuna

    State = optuna.trial.TrialState
    order = {State.COMPLETE: 0, State.PRUNED: 1, State.FAIL: 2, State.RUNNING: 3}
    sign = 1 if direction == "minimize" else -1

    def key(trial):
        value = trial.value if trial.value is not None else math.inf
        return order.get(trial.state, 4), sign * value if trial.value is not None else value

    return sorted(study.get_trials(deepcopy=False), key=key)


def trial_rows(study, spec) -> tuple[list[str], list[tuple]]:
    """(header, rows) of the ranked trials: trial, values, objective, status, steps, wall s."""
    keys = [p.key for p in spec.params]
    rows = []
    for trial in ranked(study, spec.direction):
        wall = trial.user_attrs.get("wall_s")
        rows.append((str(trial.number), *(_fmt(trial.params.get(k)) for k in keys),
                     _fmt(trial.value), trial.state.name.lower(),
                     _fmt(trial.user_attrs.get("steps")),
                     f"{wall:.1f}" if wall is not None else "-"))
    return ["trial", *keys, spec.metric, "status", "steps", "wall s"], rows


def failures(study) -> list[tuple[int, str]]:
    """(trial number, why it failed) of each failed trial, in trial order."""
    import optuna

    return [(t.number, t.user_attrs.get("fail_reason", "no reason recorded"))
            for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.FAIL,))]


def trial_table(study, spec) -> str:
    header, rows = trial_rows(study, spec)
    return table([header, *[list(row) for row in rows]])


def _fmt(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(value)


def write_best_config(study, sweep) -> Path | None:
    """The best trial's config, every setting resolved, as ``best.toml`` in the sweep folder:
    its parameters and seed; a fresh run folder (not the trial's) and no resume."""
    from meshtrain.recipes import resolve_config

    try:
        best = study.best_trial
    except ValueError:  # no finished trial
        return None
    overrides = [*sweep.overrides, *param_overrides(best.params),
                 f"--trainer.seed={best.user_attrs.get('seed', sweep.spec.seed + best.number)}"]
    config = resolve_config(sweep.config, overrides)[1]
    config["logging"]["run_dir"] = None
    config["checkpoint"]["resume"] = None
    path = sweep.dir / BEST
    header = (f"# The best trial ({best.number}) of sweep {sweep.name!r}: "
              f"{sweep.spec.metric} = {best.value:.6g}\n# meshtrain train {path}\n")
    path.write_text(header + dumps_toml(config))
    return path


def save_plots(study, folder: Path) -> list[str]:
    """Optuna's plots as PNG files in ``folder``; the names written (none without a finished
    trial; a plot that needs more finished trials or parameters than there are is left out)."""
    import warnings

    import optuna

    if not study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,)):
        return []
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from optuna.visualization import matplotlib as plots

    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for name, plot in (("history", plots.plot_optimization_history),
                       ("importance", plots.plot_param_importances),
                       ("parallel_coordinates", plots.plot_parallel_coordinate)):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # Optuna marks its matplotlib plots experimental
                axes = plot(study)
        except (ValueError, RuntimeError, ZeroDivisionError):
            continue
        figure = getattr(axes, "figure", None) or axes.flat[0].figure
        figure.set_size_inches(8, 5)
        figure.tight_layout()
        figure.savefig(folder / f"{name}.png", dpi=100)
        plt.close(figure)
        written.append(f"{name}.png")
    return written


def write_report(study, sweep, best: Path | None, plots: list[str]) -> Path:
    """``report.html`` in the sweep folder: the ranked trials (each linked to its run's own
    report), the best config and the plots, in one self-contained page."""
    import base64
    from collections import Counter

    import jinja2

    header, rows = trial_rows(study, sweep.spec)
    best_number = study.best_trial.number if best is not None else None
    cells = []
    for row in rows:
        report = sweep.dir / f"trial_{int(row[0]):04d}" / "run" / "report.html"
        cells.append({"cells": row, "best": int(row[0]) == best_number,
                      "report": str(report.relative_to(sweep.dir)) if report.is_file() else None})
    counts = Counter(t.state.name.lower() for t in study.get_trials(deepcopy=False))
    uris = [(name.removesuffix(".png").replace("_", " "), "data:image/png;base64," +
             base64.b64encode((sweep.dir / "plots" / name).read_bytes()).decode())
            for name in plots]
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(Path(__file__).parent),
                             autoescape=True)
    html = env.get_template("report.html.j2").render(
        name=sweep.name, direction=sweep.spec.direction, metric=sweep.spec.metric,
        url=sweep.url, counts=", ".join(f"{n} {state}" for state, n in sorted(counts.items())),
        best={"number": best_number, "value": _fmt(study.best_value), "config": best}
        if best is not None else None, header=header, rows=cells, plots=uris,
        failures=failures(study), stopped=sweep.stopped)
    out = sweep.dir / "report.html"
    out.write_text(html, encoding="utf-8")
    return out


def summarize(study, sweep, log=print) -> None:
    log(trial_table(study, sweep.spec))
    for number, reason in failures(study):
        log(f"trial {number} failed: {reason}")
    path = write_best_config(study, sweep)
    if path is not None:
        log(f"best: trial {study.best_trial.number}, {sweep.spec.metric} = "
            f"{study.best_value:.6g}; its config: {path}")
    plots = save_plots(study, sweep.dir / "plots")
    if plots:
        log(f"plots: {sweep.dir / 'plots'} ({', '.join(plots)})")
    log(f"report: {write_report(study, sweep, path, plots)}")
