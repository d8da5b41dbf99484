"""PNG plots of a finished run: loss curves and the learning-rate finder.

Figures are drawn with ``matplotlib.figure.Figure`` on an Agg canvas, so no GUI backend is needed
and pyplot's global state is never touched. matplotlib is imported inside the functions only.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from meshtrain.errors import ConfigError

__all__ = ["plot_loss_curves", "plot_lr_find"]


def _finite(value: Any) -> float | None:
    """``float(value)`` when it is a finite number, else None."""
    if value is None or value == "":
        return None
    try:
        x = float(value)
    except (TypeError, ValueError):
        return None
    return x if math.isfinite(x) else None


def _series(rows: Iterable[Mapping[str, Any]], key: str) -> tuple[list[float], list[float]]:
    """(steps, values) of rows where both ``step`` and ``key`` are finite numbers."""
    xs: list[float] = []
    ys: list[float] = []
    for row in rows:
        x, y = _finite(row.get("step")), _finite(row.get(key))
        if x is not None and y is not None:
            xs.append(x)
            ys.append(y)
    return xs, ys


def _new_figure(size=(8.0, 5.0)):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=size, dpi=100, layout="tight")
    FigureCanvasAgg(fig)
    return fig


def _save(fig, out_png: str | os.PathLike) -> Path:
    out = Path(out_png)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, format="png")
    return out


def plot_loss_curves(
    rows: Sequence[Mapping[str, Any]], out_png: str | os.PathLike, *, title: str = ""
) -> Path:
    """Plot ``train/loss`` and ``val/loss`` against ``step`` from metric rows; return the PNG path.

    ``rows`` is what ``read_metrics_csv`` returns (or any dicts with those keys). Missing,
    empty or non-finite values are skipped; with no loss values at all the PNG says so.
    """
    fig = _new_figure()
    ax = fig.add_subplot()
    train = _series(rows, "train/loss")
    val = _series(rows, "val/loss")
    if train[0]:
        ax.plot(*train, label="train loss", linewidth=1.2)
    if val[0]:
        ax.plot(*val, label="validation loss", marker="o", markersize=4, linewidth=1.5)
    if train[0] or val[0]:
        ax.legend()
    else:
        ax.text(0.5, 0.5, "no loss values logged", ha="center", va="center",
                transform=ax.transAxes)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.grid(True, alpha=0.3)
    if title:
        ax.set_title(title)
    return _save(fig, out_png)


def plot_lr_find(
    lrs: Sequence[float],
    losses: Sequence[float],
    suggested_lr: float | None,
    out_png: str | os.PathLike,
) -> Path:
    """Plot loss against learning rate (log x axis), mark ``suggested_lr``; return the PNG path.

    Non-finite losses (a diverged sweep) are left out, and the y axis is cut a little above the
    first loss so that the divergence at the end does not flatten the interesting part.
    """
    if len(lrs) != len(losses):
        raise ConfigError(
            f"plot_lr_find needs one loss per learning rate, got {len(lrs)} lrs and "
            f"{len(losses)} losses"
        )
    if suggested_lr is not None and not (_finite(suggested_lr) and suggested_lr > 0):
        raise ConfigError(f"suggested_lr must be a positive number or None, got {suggested_lr!r}")
    points = [(float(lr), y) for lr, loss in zip(lrs, losses)
              if (y := _finite(loss)) is not None and _finite(lr) and float(lr) > 0]
    fig = _new_figure()
    ax = fig.add_subplot()
    ax.set_xscale("log")
    if points:
        xs, ys = zip(*points)
        ax.plot(xs, ys, linewidth=1.5, label="loss")
        low, high, first = min(ys), max(ys), ys[0]
        top = min(high, first + 0.5 * (first - low)) if first > low else high
        pad = 0.05 * (top - low) or 0.05 * abs(top) or 0.05
        ax.set_ylim(low - pad, top + pad)
    else:
        ax.text(0.5, 0.5, "no finite losses", ha="center", va="center", transform=ax.transAxes)
    if suggested_lr is not None:
        ax.axvline(suggested_lr, color="tab:red", linestyle="--",
                   label=f"suggested lr {suggested_lr:.2e}")
    if points or suggested_lr is not None:
        ax.legend()
    ax.set_xlabel("learning rate")
    ax.set_ylabel("loss")
    ax.set_title("Learning-rate finder")
    ax.grid(True, which="both", alpha=0.3)
    return _save(fig, out_png)
