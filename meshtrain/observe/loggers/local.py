"""The loggers that write files in the run folder: ``CSVLogger`` (a plain ``metrics.csv`` that
survives a crash: every row is flushed; :func:`read_metrics_csv` reads it back) and
``TensorBoardLogger`` (event files for ``tensorboard --logdir``). Both forget the steps after a
checkpoint that a run resumes from (``drop_after``), as :func:`drop_steps_after` does for the
run folder's other per-step files."""

from __future__ import annotations

import csv
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from meshtrain.errors import ConfigError
from meshtrain.observe.loggers.base import Logger, _check_metrics, flatten_params


class CSVLogger(Logger):
    """Metrics to ``run_dir/metrics.csv``: column ``step``, then metric names, first seen first.

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

    def drop_after(self, step: int) -> int:
        """Forget the rows of steps after ``step`` (the file is rewritten without them): a run
        resumed from that step's checkpoint logs them again. Returns how many were dropped."""
        kept = [row for row in self._rows if row["step"] <= step]
        dropped = len(self._rows) - len(kept)
        if dropped:
            self._rows = kept
            self._rewrite()
        return dropped

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


def drop_steps_after(path: str | os.PathLike, step: int) -> int:
    """Rewrite a per-step file of the run folder (a CSV file with a ``step`` column, or JSON
    lines with a ``step`` field) without the rows of steps after ``step``, and without a last
    row cut short by a kill; returns how many rows went. A missing file is left missing."""
    path = Path(path)
    if not path.exists():
        return 0
    if path.suffix == ".csv":
        with path.open(newline="") as f:
            rows = list(csv.reader(f))
        if not rows or "step" not in rows[0]:
            return 0
        column = rows[0].index("step")
        kept = [rows[0]] + [r for r in rows[1:] if len(r) == len(rows[0])
                            and _step_at_most(r[column], step)]
        text = None
    else:
        rows = path.read_text().splitlines()
        kept = [line for line in rows if _step_at_most(_json_step(line), step)]
        text = "".join(line + "\n" for line in kept)
    if len(kept) == len(rows):
        return 0
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w", newline="") as f:
        if text is None:
            csv.writer(f).writerows(kept)
        else:
            f.write(text)
    os.replace(tmp, path)
    return len(rows) - len(kept)


def _json_step(line: str):
    try:
        return json.loads(line).get("step")
    except (ValueError, AttributeError):
        return None


def _step_at_most(value, step: int) -> bool:
    try:
        return int(float(value)) <= step
    except (TypeError, ValueError):
        return False


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
        self._flush_secs = flush_secs
        self._writer = SummaryWriter(log_dir=str(self.log_dir), flush_secs=flush_secs)

    def drop_after(self, step: int) -> None:
        """TensorBoard is to hide what earlier event files hold of the steps after ``step``
        (its ``purge_step``): a run resumed from that step's checkpoint logs them again."""
        from torch.utils.tensorboard import SummaryWriter

        self._require_open()
        self._writer.close()
        self._writer = SummaryWriter(log_dir=str(self.log_dir), flush_secs=self._flush_secs,
                                     purge_step=step + 1)

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


def forget_steps_after(trainer, step: int) -> int:
    """The run's loggers (metrics.csv, TensorBoard) and per-step files without the steps after
    ``step`` that an earlier attempt logged, as the checkpoint of ``step`` holds no trace of
    them (rank zero writes them; the others do nothing). ``events.jsonl`` is kept whole: it is
    the run's history, the stop and the resume included. Returns the metrics.csv rows dropped."""
    if not trainer.is_global_zero:
        return 0
    from meshtrain.observe.run_files import BREAKDOWN, EXPERTS  # (a row per logged step)

    dropped = 0
    for logger in trainer.run_log.loggers:
        drop = getattr(logger, "drop_after", None)
        if drop is not None:
            result = drop(step)
            dropped += result if isinstance(logger, CSVLogger) else 0
    for name in (BREAKDOWN, EXPERTS):
        drop_steps_after(trainer.run_dir / name, step)
    return dropped
