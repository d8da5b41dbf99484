"""A fit's lines go through Python's `logging` (the `meshtrain` logger): silenced, raised or
redirected as any library's, while the run's files are written as always."""

import logging

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
