"""CSV and TensorBoard loggers write values that can be read back."""

import csv
import math

import pytest
import torch

from meshtrain.errors import ConfigError
from meshtrain.observe.loggers import (
    CSVLogger,
    Logger,
    TensorBoardLogger,
    flatten_params,
    read_metrics_csv,
)


LOGGED = [(1, {"train/loss": 3.0, "lr": 0.5}), (2, {"train/loss": torch.tensor(2.5)}),
          (4, {"train/loss": 2.0, "val/loss": 2.75, "lr": 0.125})]
EXPECTED = sorted((name, step, float(value)) for step, metrics in LOGGED
                  for name, value in metrics.items())


def _read_csv(run_dir):
    rows = read_metrics_csv(run_dir / "metrics.csv")
    return sorted((name, row["step"], value) for row in rows
                  for name, value in row.items() if name != "step" and value is not None)


def _read_tensorboard(run_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tensorboard"))
    acc.Reload()
    return sorted((tag, e.step, e.value) for tag in acc.Tags()["scalars"]
                  for e in acc.Scalars(tag))


def _files(path):
    return sorted(str(p.relative_to(path)) for p in path.rglob("*"))


def test_base_logger_is_noop(tmp_path, monkeypatch):
    # a rank other than zero holds one and calls it unconditionally: it returns nothing, keeps
    # nothing and writes nothing (not even in the working directory)
    monkeypatch.chdir(tmp_path)
    log = Logger()
    assert log.log_hparams({"a": 1, "model": {"dim": 8}}) is None
    for step, metrics in LOGGED:
        assert log.log_metrics(metrics, step=step) is None
    assert log.finalize() is None
    assert log.finalize() is None
    assert vars(log) == {}
    assert _files(tmp_path) == []


@pytest.mark.parametrize("make, read", [
    (CSVLogger, _read_csv),
    (TensorBoardLogger, _read_tensorboard),
], ids=["csv", "tensorboard"])
def test_loggers_write_exactly_the_values_logged(tmp_path, make, read):
    log = make(tmp_path)
    assert isinstance(log, Logger)
    log.log_hparams({"optim": {"lr": 0.5}})
    for step, metrics in LOGGED:
        log.log_metrics(metrics, step=step)
    log.finalize()
    # (name, step, value) for every value logged, nothing else; the values are exact in float32
    assert read(tmp_path) == EXPECTED


def test_csv_widens_header_and_reads_back(tmp_path):
    log = CSVLogger(tmp_path)
    log.log_metrics({"train/loss": 2.5, "lr": 1e-3}, step=1)
    log.log_metrics({"train/loss": torch.tensor(2.25), "lr": 9e-4}, step=2)
    # a row written before widening is already on disk (flushed), before finalize
    assert read_metrics_csv(tmp_path / "metrics.csv")[1]["train/loss"] == 2.25
    log.log_metrics({"val/loss": 2.75}, step=2)
    log.log_metrics({"train/loss": 2.0, "lr": 8e-4}, step=3)
    log.finalize()

    with open(tmp_path / "metrics.csv", newline="") as f:
        header = next(csv.reader(f))
    assert header == ["step", "train/loss", "lr", "val/loss"]
    assert log.columns == header

    rows = read_metrics_csv(tmp_path / "metrics.csv")
    assert [r["step"] for r in rows] == [1, 2, 2, 3]
    assert rows[0] == {"step": 1, "train/loss": 2.5, "lr": 1e-3, "val/loss": None}
    assert rows[1]["train/loss"] == 2.25 and rows[1]["val/loss"] is None
    assert rows[2] == {"step": 2, "train/loss": None, "lr": None, "val/loss": 2.75}
    assert rows[3]["lr"] == 8e-4
    assert not (tmp_path / "metrics.csv.tmp").exists()


def test_csv_append_keeps_rows_and_fresh_drops_them(tmp_path):
    log = CSVLogger(tmp_path)
    log.log_metrics({"a": 1.0}, step=1)
    log.finalize()
    again = CSVLogger(tmp_path)
    again.log_metrics({"a": 2.0, "b": 3.0}, step=2)
    again.finalize()
    rows = read_metrics_csv(tmp_path / "metrics.csv")
    assert rows == [{"step": 1, "a": 1.0, "b": None}, {"step": 2, "a": 2.0, "b": 3.0}]

    fresh = CSVLogger(tmp_path, append=False)
    fresh.log_metrics({"c": 4.0}, step=1)
    fresh.finalize()
    assert read_metrics_csv(tmp_path / "metrics.csv") == [{"step": 1, "c": 4.0}]


def test_csv_keeps_nan_and_rejects_bad_metrics(tmp_path):
    log = CSVLogger(tmp_path)
    log.log_metrics({"loss": float("nan")}, step=1)
    assert math.isnan(read_metrics_csv(tmp_path / "metrics.csv")[0]["loss"])
    with pytest.raises(ConfigError, match="not a number"):
        log.log_metrics({"name": "abc"}, step=2)
    with pytest.raises(ConfigError, match="reserved"):
        log.log_metrics({"step": 1.0}, step=2)
    log.finalize()


def test_csv_refuses_foreign_file(tmp_path):
    (tmp_path / "metrics.csv").write_text("epoch,loss\n1,2.0\n")
    with pytest.raises(ConfigError, match="append=False"):
        CSVLogger(tmp_path)


def test_flatten_params_nested():
    assert flatten_params({"model": {"dim": 64, "act": "gelu"}, "lr": 0.1}) == {
        "model.dim": 64,
        "model.act": "gelu",
        "lr": 0.1,
    }


def test_tensorboard_scalars_and_text(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    log = TensorBoardLogger(tmp_path)
    log.log_hparams({"optim": {"lr": 3e-4}, "steps": 10})
    for step, loss in [(1, 3.0), (2, 2.5), (3, 2.0)]:
        log.log_metrics({"train/loss": torch.tensor(loss)}, step=step)
    log.log_metrics({"val/loss": 2.75}, step=3)
    log.finalize()
    log.finalize()  # idempotent

    tb_dir = tmp_path / "tensorboard"
    assert any(p.name.startswith("events.out.tfevents") for p in tb_dir.iterdir())
    acc = EventAccumulator(str(tb_dir))
    acc.Reload()
    assert set(acc.Tags()["scalars"]) == {"train/loss", "val/loss"}
    train = acc.Scalars("train/loss")
    assert [e.step for e in train] == [1, 2, 3]
    assert [e.value for e in train] == pytest.approx([3.0, 2.5, 2.0])
    assert [(e.step, e.value) for e in acc.Scalars("val/loss")] == [(3, 2.75)]
    text = acc.Tensors("hparams/text_summary")[0].tensor_proto.string_val[0].decode()
    assert "optim.lr" in text and "0.0003" in text

    with pytest.raises(ConfigError, match="after finalize"):
        log.log_metrics({"x": 1.0}, step=4)
