"""What a fit shows and writes on global rank zero: its lines, metrics to the loggers, the
memory table and the loss plot.

Every line goes through the ``meshtrain`` logger of Python's ``logging`` (level INFO), as
Lightning's go through ``lightning.pytorch``, whether the progress bar is on or off: the run
folder, the model summary, the memory table, the validation results, the progress bar's own
lines where it prints lines (not on a terminal), the ``fit:``/``final:`` summary.
``logging.getLogger("meshtrain").setLevel(logging.WARNING)`` (or ``meshtrain train --quiet``)
silences them, a handler of your own receives them. Unless configured otherwise the logger
prints the bare message to standard output on global rank zero; ``MESHTRAIN_LOG_RANKS=all``
prints every rank's, prefixed with its rank. While the bar is drawn on a terminal, the
logger's handlers that write there print above it (observe/progress.py). The files of a run
(metrics.csv, the loggers', memory.txt) do not depend on the logger.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

LOGGER = logging.getLogger("meshtrain")


class _Stdout(logging.StreamHandler):
    """Standard output as it is when a line is written (a test's or a notebook's capture)."""

    def __init__(self):
        super().__init__()
        self.setFormatter(logging.Formatter("%(message)s"))

    @property
    def stream(self):
        return sys.stdout

    @stream.setter
    def stream(self, value):  # (StreamHandler sets it once; sys.stdout is read each time)
        pass


if not LOGGER.handlers:  # a library user's own configuration wins
    LOGGER.addHandler(_Stdout())
    LOGGER.setLevel(logging.INFO)
    LOGGER.propagate = False


def _all_ranks() -> bool:
    return os.environ.get("MESHTRAIN_LOG_RANKS", "").lower() == "all"


class RunLog:
    def __init__(self, is_zero: bool):
        self.is_zero, self.loggers, self.bar, self.run_dir = is_zero, [], None, None
        self._names, self._hparams, self._finished = (), {}, False

    def open(self, run_dir: Path, logger_names, hparams: dict) -> None:
        """Create the loggers in ``run_dir`` (rank zero), recording ``hparams``."""
        self.run_dir, self._names, self._hparams = run_dir, logger_names, hparams
        if self.is_zero:
            from meshtrain.observe.loggers import make_loggers

            self.loggers = make_loggers(logger_names, run_dir, hparams)

    def print(self, *args, sep: str = " ", **_) -> None:
        """One line at INFO on the ``meshtrain`` logger (see the module's doc)."""
        every = _all_ranks()
        if not (self.is_zero or every) or not LOGGER.isEnabledFor(logging.INFO):
            return
        message = sep.join(str(a) for a in args)
        if every:
            rank = os.environ.get("RANK", "0")
            message = "\n".join(f"[rank {rank}] {line}" for line in message.split("\n"))
        LOGGER.info(message)  # above the progress bar when one is drawn (observe/progress.py)
        for handler in LOGGER.handlers:
            handler.flush()

    def log(self, metrics: dict[str, float], step: int) -> None:
        """Metrics to every logger. After ``finish`` (``test``/``validate`` after ``fit``) the
        run's loggers are opened again on the same files and runs, and closed after the row."""
        if not self.is_zero:
            return
        if not self._finished:
            for logger in self.loggers:
                logger.log_metrics(metrics, step)
            return
        from meshtrain.observe.loggers import make_loggers

        self.loggers = make_loggers(self._names, self.run_dir, self._hparams, record=False)
        try:
            for logger in self.loggers:
                logger.log_metrics(metrics, step)
        finally:
            self.finish()

    def start_progress(self, total: int, enabled: bool) -> None:
        from meshtrain.observe.progress import ProgressBar

        self.bar = ProgressBar(total, enabled=enabled and self.is_zero, logger=LOGGER)
        self.bar.start()

    def progress(self, step: int, metrics: dict, shown=()) -> None:
        """The bar's loss and throughput, and the metrics named in ``shown`` (logged with
        ``prog_bar=True``)."""
        self.bar.update(step, {"loss": metrics.get("train/loss"),
                               "tokens_per_s": metrics.get("train/tokens_per_s"),
                               "samples_per_s": metrics.get("train/samples_per_s"),
                               **{name: metrics[name] for name in shown if name in metrics}})

    def stop_progress(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def memory(self, probe) -> None:
        """Rank zero's model-state bytes after the first step, beside the ZeRO formula."""
        text = probe.summary()
        self.print(text)
        (self.run_dir / "memory.txt").write_text(text + "\n")

    def finish(self) -> None:
        for logger in self.loggers:
            logger.finalize()
        self._finished = True

    def plot(self, title: str) -> None:
        """The loss curves (``loss.png``) from ``metrics.csv``."""
        csv = self.run_dir / "metrics.csv"
        if self.is_zero and csv.exists():
            from meshtrain.observe.loggers import read_metrics_csv
            from meshtrain.observe.plots import plot_loss_curves

            plot_loss_curves(read_metrics_csv(csv), self.run_dir / "loss.png", title=title)

    def report(self, monitor) -> None:
        """``run_dir/report.html`` from what the run folder holds (rank zero; after a failure
        too, so a problem in the page must not hide the run's own error)."""
        if not self.is_zero or self.run_dir is None or monitor is None:
            return
        try:
            from meshtrain.observe.report import write_report

            path = write_report(self.run_dir)
        except Exception as error:  # noqa: BLE001 - the run's outcome matters more
            LOGGER.warning(f"warning: no report.html: {type(error).__name__}: {error}")
            return
        self.print(f"report: {path}")
