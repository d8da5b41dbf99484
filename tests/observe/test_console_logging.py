"""A fit's lines go through Python's `logging` (the `meshtrain` logger): silenced, raised or
redirected as any library's, while the run's files are written as always."""

import io
import logging
import sys

import pytest
import torch
from conftest import trainer_kwargs
from parity import mlp, regression_data, sgd

from meshtrain import Trainer


def _fit(run_dir):
    Trainer(**trainer_kwargs(run_dir, max_steps=2, global_batch_size=8,
                             loggers=("csv",))).fit(mlp, regression_data(), optimizer=sgd,
                                                    loss_fn=torch.nn.functional.mse_loss)


def test_silencing_the_logger_silences_the_console_not_the_files(tmp_path, capsys):
    logger = logging.getLogger("meshtrain")
    _fit(tmp_path / "loud")
    assert "run folder:" in capsys.readouterr().out  # by default: printed on rank zero
    level = logger.level
    logger.setLevel(logging.WARNING)
    try:
        _fit(tmp_path / "quiet")
    finally:
        logger.setLevel(level)
    out = capsys.readouterr().out
    assert "run folder:" not in out and "fit:" not in out, out
    assert (tmp_path / "quiet" / "metrics.csv").read_text().count("\n") >= 2


def test_a_handler_of_your_own_receives_the_lines(tmp_path):
    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    handler = Keep()
    logging.getLogger("meshtrain").addHandler(handler)
    try:
        _fit(tmp_path)
    finally:
        logging.getLogger("meshtrain").removeHandler(handler)
    assert any(line.startswith("run folder:") for line in records)
    assert any(line.startswith("fit: 2 steps") for line in records)


class _Terminal(io.StringIO):
    def isatty(self):
        return True


@pytest.mark.timeout(120)
def test_with_the_progress_bar_your_handler_gets_every_line_and_the_console_each_once(
        tmp_path, capsys, monkeypatch):
    """The bar on (the default), as plain lines (not a terminal) and drawn (a terminal): a
    handler of your own receives the memory table, the validation lines and the summary, and
    standard output shows each of them once, the drawn bar cleared before it."""
    for terminal in (False, True):
        records = []

        class Keep(logging.Handler):
            def emit(self, record):
                records.append(record.getMessage())

        if terminal:
            monkeypatch.setattr(sys, "stdout", _Terminal())
        handler = Keep()
        logging.getLogger("meshtrain").addHandler(handler)
        try:
            data = regression_data()
            Trainer(**trainer_kwargs(tmp_path / str(terminal), max_steps=4, global_batch_size=8,
                                     val_every_n_steps=2, progress_bar=True)).fit(
                mlp, data, data, optimizer=sgd, loss_fn=torch.nn.functional.mse_loss)
        finally:
            logging.getLogger("meshtrain").removeHandler(handler)
        shown = sys.stdout.getvalue() if terminal else capsys.readouterr().out
        assert ("\x1b[2K" in shown) == terminal, shown  # the bar drawn, or plain lines
        logged = "\n".join(records)
        for start in ("model state on this rank", "step 2: val/loss", "step 4: val/loss",
                      "fit: 4 steps", "final: ", "run folder: ") + (() if terminal else
                                                                  ("step 4/4 | loss",)):
            assert any(line.startswith(start) for line in logged.splitlines()), (start, logged)
        for line in logged.splitlines():
            assert shown.count(line) == logged.count(line), (line, shown)
        if terminal:
            line = next(line for line in records if line.startswith("step 2: val/loss"))
            assert "\x1b[?25l" in shown[:shown.index(line)]  # the bar was live
            assert shown[:shown.index(line)].endswith("\x1b[2K")
