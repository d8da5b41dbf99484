"""MLflow and Weights & Biases loggers (optional extras) write values that read back through
each tool's own format: MLflow's client API, W&B's offline ``.wandb`` record log. No network:
W&B runs offline, MLflow uses a local file store."""

import json
import os
import struct
import sys
import time

import pytest
import torch
import torch.nn.functional as F
from conftest import LossRecorder, quiet_trainer, trainer_kwargs
from parity import adamw, mlp, regression_data
from torch.utils.data import TensorDataset

from meshtrain import settings
from meshtrain.errors import ConfigError
from meshtrain.observe.loggers.external import MLflowLogger, WandbLogger, wandb_mode
from meshtrain.observe.loggers import Logger, make_loggers, read_metrics_csv

pytestmark = [pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning"),
              pytest.mark.filterwarnings("ignore::DeprecationWarning"),
              pytest.mark.filterwarnings("ignore::FutureWarning")]

LOGGED = [(1, {"train/loss": 3.0, "lr": 0.5}), (2, {"train/loss": torch.tensor(2.5)}),
          (4, {"train/loss": 2.0, "val/loss": 2.75, "lr": 0.125})]
HISTORY = {"train/loss": [(1, 3.0), (2, 2.5), (4, 2.0)], "lr": [(1, 0.5), (4, 0.125)],
           "val/loss": [(4, 2.75)]}


@pytest.fixture(autouse=True)
def no_network_env(tmp_path_factory, monkeypatch):
    """W&B offline and silent, its config/cache outside $HOME; no MLflow settings from outside.
    ``MLFLOW_ALLOW_FILE_STORE`` (which the MLflow logger may set) is put back afterwards."""
    home = tmp_path_factory.mktemp("wandb_home")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_MODE", "offline")
    for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(var, str(home / var.lower()))
    for var in ("WANDB_API_KEY", "WANDB_PROJECT", "MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME",
                "MLFLOW_ALLOW_FILE_STORE"):
        monkeypatch.setenv(var, "")  # remembered as it was, restored after the test
        monkeypatch.delenv(var)


# ---- MLflow ------------------------------------------------------------------------------------
def _mlflow(uri):
    from mlflow.tracking import MlflowClient

    return MlflowClient(uri)


def _history(client, run_id, name):
    return sorted((m.step, m.value) for m in client.get_metric_history(run_id, name))


def test_mlflow_logs_params_and_metrics_to_a_store_in_the_run_folder(tmp_path):
    from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH

    log = MLflowLogger(tmp_path, experiment="job")
    assert isinstance(log, Logger)
    assert os.environ["MLFLOW_ALLOW_FILE_STORE"] == "true"  # MLflow 3 refuses file stores else
    assert log.tracking_uri == (tmp_path / "mlruns").resolve().as_uri()
    log.log_hparams({"optim": {"lr": 0.5}, "layout": "dp=2", "max_steps": None,
                     "long": "x" * (MAX_PARAM_VAL_LENGTH + 100)})
    for step, metrics in LOGGED:
        log.log_metrics(metrics, step=step)
    log.finalize()
    log.finalize()  # idempotent

    assert (tmp_path / "mlruns").is_dir()
    client = _mlflow(log.tracking_uri)
    run = client.get_run(log.run_id)
    assert run.info.status == "FINISHED"
    assert run.info.run_name == tmp_path.name
    assert client.get_experiment(run.info.experiment_id).name == "job"
    for name, expected in HISTORY.items():
        assert _history(client, log.run_id, name) == expected, name
    params = run.data.params
    assert params["optim.lr"] == "0.5" and params["layout"] == "dp=2"
    assert params["max_steps"] == "None"
    assert len(params["long"]) == MAX_PARAM_VAL_LENGTH
    assert params["long"].startswith("xxx") and params["long"].endswith("[truncated]")
    with pytest.raises(ConfigError, match="not a number"):
        log.log_metrics({"name": "abc"}, step=5)


def test_mlflow_resumed_run_folder_continues_the_same_run(tmp_path):
    first = MLflowLogger(tmp_path)
    first.log_hparams({"max_steps": 2})
    first.log_metrics({"train/loss": 1.5}, step=1)
    first.finalize()

    again = MLflowLogger(tmp_path)  # a resumed run: same folder
    assert again.run_id == first.run_id
    again.log_hparams({"max_steps": 4, "new": 1})  # MLflow params cannot change: kept, no error
    again.log_metrics({"train/loss": 1.25}, step=2)
    again.finalize()
    again.log_metrics({"test/loss": 1.0}, step=2)  # trainer.test() after fit
    client = _mlflow(again.tracking_uri)
    assert client.get_run(again.run_id).info.status == "RUNNING"
    again.finalize()

    run = client.get_run(first.run_id)
    assert run.info.status == "FINISHED"
    assert client.get_experiment(run.info.experiment_id).name == "meshtrain"  # no job name
    assert _history(client, first.run_id, "train/loss") == [(1, 1.5), (2, 1.25)]
    assert _history(client, first.run_id, "test/loss") == [(2, 1.0)]
    assert run.data.params == {"max_steps": "2", "new": "1"}
    assert len(client.search_runs([run.info.experiment_id])) == 1


def test_mlflow_tracking_uri_and_experiment_from_the_environment(tmp_path, monkeypatch):
    store = tmp_path / "elsewhere"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store.as_uri())
    (log,) = make_loggers(["mlflow"], tmp_path / "run", {"name": "job", "lr": 0.1})
    log.log_metrics({"train/loss": 0.5}, step=3)
    log.finalize()
    assert log.tracking_uri == store.as_uri()
    assert store.is_dir() and not (tmp_path / "run" / "mlruns").exists()
    client = _mlflow(store.as_uri())
    run = client.get_run(log.run_id)
    assert client.get_experiment(run.info.experiment_id).name == "job"  # the job's name
    assert run.data.params == {"name": "job", "lr": "0.1"}  # make_loggers logged the hparams
    assert _history(client, log.run_id, "train/loss") == [(3, 0.5)]

    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "team")  # beats the job's name
    (log,) = make_loggers(["mlflow"], tmp_path / "run2", {"name": "job"})
    log.finalize()
    run = client.get_run(log.run_id)
    assert client.get_experiment(run.info.experiment_id).name == "team"


# ---- Weights & Biases --------------------------------------------------------------------------
def _wandb_records(path):
    """The records of an offline run's ``.wandb`` file (a LevelDB-style log: a 7-byte header,
    then in 32 KiB blocks records of crc32, length, type; FULL=1, FIRST=2, MIDDLE=3, LAST=4)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B", data[:7]
    block, pos, pieces, records = 32 * 1024, 7, b"", []
    while pos + 7 <= len(data):
        room = block - pos % block
        if room < 7:  # the block's tail is padding
            pos += room
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        pieces += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(pieces)
            records.append(record)
            pieces = b""
    return records


def _key(item):
    return item.key or "/".join(item.nested_key)


def _wandb_run(folder):
    """``(history, config)`` of an offline run folder: history {name: [(step, value)]} without
    W&B's own ``_`` entries, config {key: value} from the run record and config updates."""
    (path,) = folder.glob("run-*.wandb")
    # W&B's service may still be writing after run.finish() returns (on a busy machine the file
    # was once read with no history yet): read it once it holds the run's exit record
    deadline = time.monotonic() + 30
    records = _wandb_records(path)
    while not any(r.WhichOneof("record_type") == "exit" for r in records) \
            and time.monotonic() < deadline:
        time.sleep(0.2)
        records = _wandb_records(path)
    history, config = {}, {}
    for record in records:
        kind = record.WhichOneof("record_type")
        if kind == "history":
            for item in record.history.item:
                if not _key(item).startswith("_"):
                    history.setdefault(_key(item), []).append(
                        (record.history.step.num, json.loads(item.value_json)))
        elif kind in ("run", "config"):
            updates = record.run.config.update if kind == "run" else record.config.update
            config.update({_key(i): json.loads(i.value_json) for i in updates})
    return history, config


def _offline_runs(run_dir, run_id):
    # (a second run in the same second gets the folder name with "-1" after it)
    return sorted((run_dir / "wandb").glob(f"offline-run-*-{run_id}*"))


def test_wandb_offline_run_holds_the_values_logged(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_MODE")  # no WANDB_API_KEY either: offline by default
    log = WandbLogger(tmp_path, project="job")
    assert isinstance(log, Logger) and log.mode == "offline"
    log.log_hparams({"optim": {"lr": 0.5}, "layout": "dp=2"})
    for step, metrics in LOGGED:
        log.log_metrics(metrics, step=step)
    log.finalize()
    log.finalize()  # idempotent

    (folder,) = _offline_runs(tmp_path, log.run_id)
    history, config = _wandb_run(folder)
    assert history == HISTORY
    assert config["optim"] == {"lr": 0.5} and config["layout"] == "dp=2"
    assert (tmp_path / "wandb_run_id").read_text().strip() == log.run_id


def test_wandb_resumed_folder_and_log_after_finalize_keep_the_run_id(tmp_path):
    log = WandbLogger(tmp_path)
    log.log_metrics({"train/loss": 1.5}, step=1)
    log.finalize()
    log.log_metrics({"test/loss": 1.0}, step=1)  # trainer.test() after fit: the same run id
    log.finalize()
    again = WandbLogger(tmp_path)  # a resumed run: same folder
    assert again.run_id == log.run_id
    again.log_metrics({"train/loss": 1.25}, step=2)
    again.finalize()

    folders = _offline_runs(tmp_path, log.run_id)
    assert len(folders) == 3, folders  # `wandb sync` puts them together under one run id
    logged = {}
    for folder in folders:
        for name, points in _wandb_run(folder)[0].items():
            logged.setdefault(name, []).extend(points)
    assert {k: sorted(v) for k, v in logged.items()} == {
        "train/loss": [(1, 1.5), (2, 1.25)], "test/loss": [(1, 1.0)]}


def test_wandb_mode(monkeypatch):
    monkeypatch.delenv("WANDB_MODE")
    assert wandb_mode() == "offline"
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    assert wandb_mode() == "online"
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert wandb_mode() == "disabled"


# ---- a missing package -------------------------------------------------------------------------
@pytest.mark.parametrize("name, package", [("mlflow", "mlflow-skinny"), ("wandb", "wandb")])
def test_missing_package_says_what_to_install(tmp_path, monkeypatch, name, package):
    monkeypatch.setitem(sys.modules, name, None)  # `import name` fails, find_spec finds nothing
    hint = rf"pip install 'meshtrain\[loggers\]' \(or pip install {package}\)"
    logger = {"mlflow": MLflowLogger, "wandb": WandbLogger}[name]
    with pytest.raises(ConfigError, match=hint):
        logger(tmp_path / "direct")
    with pytest.raises(ConfigError, match=hint):
        make_loggers(["csv", name], tmp_path / "made", {})
    # the settings check rejects it before a Trainer starts anything
    with pytest.raises(ConfigError, match=rf"loggers: the '{name}' logger needs .*{hint}"):
        settings.check({"loggers": ["csv", name]})
    from meshtrain import Trainer

    with pytest.raises(ConfigError, match=hint):
        Trainer(**trainer_kwargs(tmp_path / "trainer", loggers=("csv", name)))
    assert not (tmp_path / "trainer").exists()


def test_settings_accept_the_external_loggers():
    values = settings.check({"loggers": ["csv", "mlflow", "wandb"]})
    assert list(values["loggers"]) == ["csv", "mlflow", "wandb"]
    with pytest.raises(ConfigError, match="unknown logger 'neptune'.*'mlflow', 'wandb'"):
        settings.check({"loggers": ["neptune"]})


# ---- a fit -------------------------------------------------------------------------------------
@pytest.mark.usefixtures("one_thread")
def test_fit_logs_train_loss_to_mlflow_beside_the_csv(tmp_path):
    recorder = LossRecorder()
    trainer = quiet_trainer(tmp_path, max_steps=3, micro_batch_size=4, log_every_n_steps=1,
                            loggers=["csv", "mlflow"], callbacks=[recorder])
    trainer.fit(mlp, regression_data(), optimizer=adamw, loss_fn=F.mse_loss)
    x, y = regression_data().tensors
    test_loss = trainer.test(TensorDataset(x[:8], y[:8]))["test/loss"]

    client = _mlflow((tmp_path / "mlruns").resolve().as_uri())
    run_id = (tmp_path / "mlflow_run_id").read_text().strip()
    run = client.get_run(run_id)
    csv_losses = [(r["step"], r["train/loss"]) for r in read_metrics_csv(tmp_path / "metrics.csv")
                  if r.get("train/loss") is not None]
    assert [step for step, _ in csv_losses] == [1, 2, 3]
    mlflow_losses = _history(client, run_id, "train/loss")
    assert mlflow_losses == [(s, pytest.approx(v, rel=1e-6)) for s, v in csv_losses]
    assert mlflow_losses == [(s, pytest.approx(v, rel=1e-6)) for s, v in recorder.losses.items()]
    assert _history(client, run_id, "test/loss") == [(3, pytest.approx(test_loss, rel=1e-6))]
    assert client.get_experiment(run.info.experiment_id).name == trainer.name
    assert run.data.params["max_steps"] == "3"
    assert run.data.params["micro_batch_size"] == "4"
