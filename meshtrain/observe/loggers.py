"""Metric loggers used by the Trainer on global rank zero only.

A logger receives hyperparameters once and scalar metrics by step. ``Logger`` itself does nothing,
so a Trainer can hold one on every rank and call it unconditionally. ``CSVLogger`` keeps a plain
``metrics.csv`` that survives a crash (every row is flushed); ``TensorBoardLogger`` writes event
files for ``tensorboard --logdir``. MLflow and Weights & Biases loggers (optional extras) are in
``meshtrain/observe/external_loggers.py``. Nothing here touches ``torch.distributed``.
"""

from __future__ import annotations

import csv
import dataclasses
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from meshtrain.errors import ConfigError

__all__ = [
    "EXTERNAL_LOGGERS",
    "CSVLogger",
    "Logger",
    "TensorBoardLogger",
    "flatten_params",
    "make_loggers",
    "read_metrics_csv",
]


class Logger:
    """Base logger: every method is a no-op (used as-is on non-zero ranks)."""

    def log_hparams(self, params: dict) -> None:
        """Record the run's hyperparameters / resolved config."""

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        """Record scalar ``metrics`` (name -> number) at optimizer ``step``."""

    def finalize(self) -> None:
        """Flush and close files; safe to call more than once."""


def _to_float(name: str, value: Any) -> float:
    """``float(value)`` (works for Python numbers and one-element tensors) or a ConfigError."""
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ConfigError(
            f"metric {name!r} has a value of type {type(value).__name__} ({value!r:.60}) that is "
            "not a number; log only numbers or one-element tensors (call .item() on others)"
        ) from None


def _check_metrics(metrics: Mapping[str, Any]) -> dict[str, float]:
    """Convert metric values to floats and reject reserved or non-string names."""
    out: dict[str, float] = {}
    for name, value in metrics.items():
        if not isinstance(name, str) or not name:
            raise ConfigError(f"metric names must be non-empty strings, got {name!r}")
        if name == "step":
            raise ConfigError(
                "'step' is reserved for the step column; pass the step as the `step` argument "
                "and give the metric another name"
            )
        out[name] = _to_float(name, value)
    return out


# -- CSV -------------------------------------------------------------------------------------------


class CSVLogger(Logger):
    """Write metrics to ``run_dir/metrics.csv``: column ``step`` then metric names, first seen first.

    Each ``log_metrics`` call appends one row and flushes it. When a call brings a metric name that
    was not seen before, the file is rewritten (atomically, via a temporary file) with the wider
    header; earlier rows get empty cells for it. With ``append=True`` (default) rows already in an
    existing ``metrics.csv`` are kept, so a resumed run continues the same file; ``append=False``
    starts a fresh file. ``log_hparams`` is a no-op: the Trainer saves the resolved config itself.
    """

    def __init__(self, run_dir: str | os.PathLike, *, append: bool = True) -> None:
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / "metrics.csv"
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._columns: list[str] = ["step"]
        self._rows: list[dict[str, Any]] = []
        self._file = None
        if append and self.path.exists() and self.path.stat().st_size > 0:
            with self.path.open(newline="") as f:
                header = next(csv.reader(f), None)
            if not header or header[0] != "step":
                raise ConfigError(
                    f"{self.path} exists but is not a meshtrain metrics file (its first column is "
                    f"not 'step'); move it away or use CSVLogger(..., append=False)"
                )
            self._columns = list(header)
            self._rows = read_metrics_csv(self.path)
        else:
            self._rewrite()

    @property
    def columns(self) -> list[str]:
        """Header of the file: ``step`` then metric names in first-seen order."""
        return list(self._columns)

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        values = _check_metrics(metrics)
        row: dict[str, Any] = {"step": int(step), **values}
        self._rows.append(row)
        new = [name for name in values if name not in self._columns]
        if new:
            self._columns.extend(new)
            self._rewrite()
            return
        f = self._open()
        csv.writer(f).writerow(self._cells(row))
        f.flush()

    def finalize(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    # -- internals --
    def _cells(self, row: Mapping[str, Any]) -> list[Any]:
        return ["" if row.get(c) is None else row[c] for c in self._columns]

    def _open(self):
        if self._file is None:
            self._file = self.path.open("a", newline="")
        return self._file

    def _rewrite(self) -> None:
        """Write header and all rows to a temporary file, then swap it in."""
        self.finalize()
        tmp = self.path.with_name(self.path.name + ".tmp")
        with tmp.open("w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(self._columns)
            writer.writerows(self._cells(row) for row in self._rows)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)


def read_metrics_csv(path: str | os.PathLike) -> list[dict]:
    """Read a ``metrics.csv`` back: one dict per row, ``step`` as int, other values as float.

    Every column is present in every dict; empty cells are ``None``.
    """
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"metrics file {path} does not exist; check the run directory")
    rows: list[dict] = []
    with path.open(newline="") as f:
        for raw in csv.DictReader(f):
            row: dict[str, Any] = {}
            for key, cell in raw.items():
                if key is None:  # more cells than header columns: ignore the extras
                    continue
                if cell is None or cell == "":
                    row[key] = None
                elif key == "step":
                    row[key] = int(float(cell))
                else:
                    row[key] = float(cell)
            rows.append(row)
    return rows


# -- TensorBoard -----------------------------------------------------------------------------------


def flatten_params(params: Any, prefix: str = "") -> dict[str, Any]:
    """Flatten nested dicts / dataclasses into ``{"a.b.c": value}`` (lists and others kept as-is)."""
    if dataclasses.is_dataclass(params) and not isinstance(params, type):
        params = {f.name: getattr(params, f.name) for f in dataclasses.fields(params)}
    if not isinstance(params, Mapping):
        return {prefix or "value": params}
    flat: dict[str, Any] = {}
    for key, value in params.items():
        name = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(value, Mapping) or (
            dataclasses.is_dataclass(value) and not isinstance(value, type)
        ):
            flat.update(flatten_params(value, name))
        else:
            flat[name] = value
    return flat


def _markdown_table(flat: Mapping[str, Any]) -> str:
    """Two-column markdown table (TensorBoard renders text summaries as markdown)."""

    def cell(x: Any) -> str:
        return str(x).replace("|", "\\|").replace("\n", " ")

    lines = ["| parameter | value |", "|---|---|"]
    lines += [f"| {cell(k)} | {cell(v)} |" for k, v in sorted(flat.items())]
    return "\n".join(lines)


class TensorBoardLogger(Logger):
    """Write TensorBoard event files under ``run_dir/tensorboard``.

    Metrics become scalars tagged by their name (``train/loss`` groups under ``train``).
    ``log_hparams`` writes the flattened config as a markdown table in the TEXT tab (tag
    ``hparams``), which needs no metrics, unlike TensorBoard's HPARAMS plugin.
    """

    def __init__(self, run_dir: str | os.PathLike, *, flush_secs: int = 30) -> None:
        from torch.utils.tensorboard import SummaryWriter  # lazy: imports tensorboard

        self.log_dir = Path(run_dir) / "tensorboard"
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._writer = SummaryWriter(log_dir=str(self.log_dir), flush_secs=flush_secs)

    def log_hparams(self, params: dict) -> None:
        self._require_open()
        self._writer.add_text("hparams", _markdown_table(flatten_params(params)), global_step=0)

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self._require_open()
        for name, value in _check_metrics(metrics).items():
            self._writer.add_scalar(name, value, global_step=int(step))

    def finalize(self) -> None:
        if self._writer is not None:
            self._writer.flush()
            self._writer.close()
            self._writer = None

    def _require_open(self) -> None:
        if self._writer is None:
            raise ConfigError(
                "TensorBoardLogger was used after finalize(); create a new logger for a new run"
            )


LOGGERS = {"csv": CSVLogger, "tensorboard": TensorBoardLogger}
# optional extras (pip install 'meshtrain[loggers]'), in meshtrain/observe/external_loggers.py
EXTERNAL_LOGGERS = ("mlflow", "wandb")


def make_loggers(names, run_dir: Path, hparams: dict, *, record: bool = True) -> list[Logger]:
    """The loggers named in ``names`` (``"csv"``, ``"tensorboard"``, ``"mlflow"``, ``"wandb"``),
    each given ``hparams``; MLflow's experiment and W&B's project are the job's name
    (``hparams["name"]``). ``record=False``: loggers opened again on a run that recorded its
    hparams already (metrics.csv appended, a new TensorBoard event file in the same folder, the
    same MLflow or W&B run continued)."""
    names = [names] if isinstance(names, str) else list(names)
    loggers: list[Logger] = []
    try:
        for name in names:
            if name in LOGGERS:
                loggers.append(LOGGERS[name](run_dir))
            elif name in EXTERNAL_LOGGERS:
                from meshtrain.observe.external_loggers import make_external_logger

                loggers.append(make_external_logger(name, run_dir, hparams.get("name")))
            else:
                raise ConfigError(f"unknown logger {name!r} in loggers; choose from "
                                  + ", ".join(repr(n) for n in (*LOGGERS, *EXTERNAL_LOGGERS)))
        for logger in loggers:
            if record:
                logger.log_hparams(hparams)
    except BaseException:
        for logger in loggers:  # close what was opened (an MLflow / W&B run ends)
            logger.finalize()
        raise
    return loggers
