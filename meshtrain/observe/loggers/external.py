"""MLflow and Weights & Biases loggers: optional extras (``pip install 'meshtrain[loggers]'``).

Selected like the built-in ones (``loggers=["csv", "mlflow"]``, ``[logging] loggers = [...]``,
``--logging.loggers=...``) and, like them, created and called on global rank zero only.
``mlflow`` and ``wandb`` are imported when a logger is created, never when meshtrain is.

Both keep the id of their run in the run folder (``mlflow_run_id``, ``wandb_run_id``), so a
resumed run (the same run folder) continues the same MLflow / W&B run, and a log after
``finalize`` (``trainer.test()`` after ``fit``) still lands in it.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import secrets
import string
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from meshtrain.errors import ConfigError
from meshtrain.observe.loggers.base import Logger, _check_metrics, flatten_params

__all__ = ["EXTERNAL_LOGGERS", "MLflowLogger", "WandbLogger", "make_external_logger",
           "missing_package"]

# logger name -> (module it imports, pip package that provides it)
EXTERNAL_LOGGERS = {"mlflow": ("mlflow", "mlflow-skinny"), "wandb": ("wandb", "wandb")}

DEFAULT_EXPERIMENT = "meshtrain"
_ID_CHARS = string.ascii_lowercase + string.digits


def missing_package(name: str) -> str | None:
    """What to install for logger ``name`` when its package is missing, else ``None`` (cheap:
    ``importlib.util.find_spec``, nothing is imported)."""
    if importlib.util.find_spec(EXTERNAL_LOGGERS[name][0]) is not None:
        return None
    return _install_hint(name)


def _install_hint(name: str) -> str:
    module, package = EXTERNAL_LOGGERS[name]
    return (f"the {name!r} logger needs the {module!r} package, which is not installed: "
            f"pip install 'meshtrain[loggers]' (or pip install {package}), or remove {name!r} "
            f"from loggers")


def _import(name: str):
    """``import`` the logger's package, or a ConfigError saying what to install."""
    module = EXTERNAL_LOGGERS[name][0]
    try:
        return importlib.import_module(module)
    except ImportError as error:
        raise ConfigError(f"{_install_hint(name)} ({error})") from None


def _read_id(path: Path) -> str | None:
    try:
        return path.read_text().strip() or None
    except FileNotFoundError:
        return None


def _experiment_name(job: str | None) -> str:
    return str(job) if job else DEFAULT_EXPERIMENT


# -- MLflow ----------------------------------------------------------------------------------------


class MLflowLogger(Logger):
    """Log to an MLflow run; by default to a local file store in ``run_dir/mlruns``.

    The tracking URI is ``tracking_uri``, else ``MLFLOW_TRACKING_URI``, else
    ``file://<run_dir>/mlruns``. MLflow 3 refuses local file stores unless
    ``MLFLOW_ALLOW_FILE_STORE`` is true; when this logger uses one and that variable is not set,
    it sets it to ``true`` in this process. View the store with ``MLFLOW_ALLOW_FILE_STORE=true
    mlflow ui --backend-store-uri <run_dir>/mlruns`` (full ``mlflow``, not ``mlflow-skinny``).
    The experiment is ``experiment``, else ``MLFLOW_EXPERIMENT_NAME``, else ``"meshtrain"``
    (``make_loggers`` passes the job's name); the MLflow run is named after the run folder.

    ``log_hparams`` records the flattened config (``model.dim``) as MLflow params, values cut to
    MLflow's length limit; a resumed run keeps the params it has (MLflow params cannot change).
    Metric names such as ``train/loss`` are kept as they are.
    """

    def __init__(self, run_dir: str | os.PathLike, *, experiment: str | None = None,
                 tracking_uri: str | None = None, run_name: str | None = None) -> None:
        _import("mlflow")
        from mlflow.tracking import MlflowClient

        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.tracking_uri = (tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
                             or (self.run_dir.resolve() / "mlruns").as_uri())
        if _is_local_file_store(self.tracking_uri):
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self._client = MlflowClient(self.tracking_uri)
        self.experiment = experiment or os.environ.get("MLFLOW_EXPERIMENT_NAME") or \
            DEFAULT_EXPERIMENT
        self._id_file = self.run_dir / "mlflow_run_id"
        self.run_id = self._resume() or self._create(run_name or self.run_dir.name)
        self._id_file.write_text(self.run_id + "\n")
        self._open = True

    def log_hparams(self, params: dict) -> None:
        from mlflow.entities import Param
        from mlflow.utils.validation import MAX_PARAMS_TAGS_PER_BATCH

        have = self._client.get_run(self.run_id).data.params
        limit = _param_value_limit()
        todo = [Param(key, _param_value(value, limit))
                for key, value in flatten_params(params).items() if key not in have]
        for i in range(0, len(todo), MAX_PARAMS_TAGS_PER_BATCH):
            self._client.log_batch(self.run_id, params=todo[i:i + MAX_PARAMS_TAGS_PER_BATCH])

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric
        from mlflow.utils.validation import MAX_METRICS_PER_BATCH

        if not self._open:  # e.g. trainer.test() after fit: the run continues
            self._client.update_run(self.run_id, status="RUNNING")
            self._open = True
        now = int(time.time() * 1000)
        rows = [Metric(name, value, now, int(step))
                for name, value in _check_metrics(metrics).items()]
        for i in range(0, len(rows), MAX_METRICS_PER_BATCH):
            self._client.log_batch(self.run_id, metrics=rows[i:i + MAX_METRICS_PER_BATCH])

    def finalize(self) -> None:
        if self._open:
            self._client.set_terminated(self.run_id, status="FINISHED")
            self._open = False

    # -- internals --
    def _experiment_id(self) -> str:
        from mlflow.exceptions import MlflowException

        found = self._client.get_experiment_by_name(self.experiment)
        if found is not None:
            return found.experiment_id
        try:
            return self._client.create_experiment(self.experiment)
        except MlflowException:  # created meanwhile by another run of the same job
            found = self._client.get_experiment_by_name(self.experiment)
            if found is None:
                raise
            return found.experiment_id

    def _create(self, run_name: str) -> str:
        run = self._client.create_run(self._experiment_id(), run_name=run_name,
                                      tags={"meshtrain.run_dir": str(self.run_dir.resolve())})
        return run.info.run_id

    def _resume(self) -> str | None:
        """The run this folder logged to before, if the store still has it (active)."""
        from mlflow.exceptions import MlflowException

        run_id = _read_id(self._id_file)
        if run_id is None:
            return None
        try:
            run = self._client.get_run(run_id)
        except MlflowException:  # another store (MLFLOW_TRACKING_URI changed) or deleted
            return None
        if run.info.lifecycle_stage != "active":
            return None
        self._client.update_run(run_id, status="RUNNING")
        return run_id


def _is_local_file_store(uri: str) -> bool:
    """A ``file:`` URI or a plain path (``C:\\...`` parses as scheme ``c``)."""
    scheme = urlparse(uri).scheme
    return scheme == "file" or len(scheme) <= 1 and not uri.startswith("databricks")


def _param_value_limit() -> int:
    try:
        from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH
    except ImportError:
        return 500  # MLflow 1.x's limit; 2.x and 3.x allow 6000
    return MAX_PARAM_VAL_LENGTH


def _param_value(value: Any, limit: int) -> str:
    text = str(value)
    if len(text) <= limit:
        return text
    marker = "...[truncated]"
    return text[:limit - len(marker)] + marker


# -- Weights & Biases ------------------------------------------------------------------------------


class WandbLogger(Logger):
    """Log to a Weights & Biases run whose files go under ``run_dir/wandb``.

    The mode is ``mode``, else ``WANDB_MODE``, else ``"online"`` when ``WANDB_API_KEY`` is set
    and ``"offline"`` when it is not: a run on a laptop never stops at a login prompt. An offline
    run's folder (``run_dir/wandb/offline-run-*``) uploads later with ``wandb sync <folder>``
    (to use the key from ``wandb login`` without ``WANDB_API_KEY``, set ``WANDB_MODE=online``).
    The project is ``project``, else ``WANDB_PROJECT``, else ``"meshtrain"`` (``make_loggers``
    passes the job's name); the W&B run is named after the run folder.

    ``log_hparams`` updates the run's config (nested tables stay nested); ``log_metrics`` logs
    at the given step. A resumed run (the same run folder) continues the same W&B run id.
    """

    def __init__(self, run_dir: str | os.PathLike, *, project: str | None = None,
                 mode: str | None = None, run_name: str | None = None,
                 config: dict | None = None) -> None:
        _import("wandb")
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.project = project or os.environ.get("WANDB_PROJECT") or DEFAULT_EXPERIMENT
        self.mode = mode or wandb_mode()
        self.run_name = run_name or self.run_dir.name
        self._id_file = self.run_dir / "wandb_run_id"
        self._run = None
        self._init(config)

    def log_hparams(self, params: dict) -> None:
        self._require_run().config.update(dict(params), allow_val_change=True)

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self._require_run().log(_check_metrics(metrics), step=int(step))

    def finalize(self) -> None:
        if self._run is not None:
            run, self._run = self._run, None
            run.finish()

    @property
    def run_id(self) -> str | None:
        return _read_id(self._id_file)

    # -- internals --
    def _init(self, config: dict | None = None) -> None:
        import wandb

        run_id = self.run_id
        if run_id is None:
            run_id = "".join(secrets.choice(_ID_CHARS) for _ in range(8))  # as wandb's ids
            self._id_file.write_text(run_id + "\n")
        self._run = wandb.init(project=self.project, dir=str(self.run_dir), config=config,
                               mode=self.mode, name=self.run_name, id=run_id, resume="allow")

    def _require_run(self):
        if self._run is None:  # e.g. trainer.test() after fit: continue the same run id
            self._init()
        return self._run


def wandb_mode() -> str:
    """``WANDB_MODE`` if set, else ``"online"`` with ``WANDB_API_KEY`` and ``"offline"``
    without."""
    mode = os.environ.get("WANDB_MODE")
    if mode:
        return mode
    return "online" if os.environ.get("WANDB_API_KEY") else "offline"


# -- make_loggers' dispatch -----------------------------------------------------------------------


def make_external_logger(name: str, run_dir: str | os.PathLike, job: str | None) -> Logger:
    """The ``mlflow`` or ``wandb`` logger for ``run_dir``. Its experiment / project:
    ``MLFLOW_EXPERIMENT_NAME`` / ``WANDB_PROJECT`` if set, else the job's name ``job``, else
    ``"meshtrain"``."""
    if name == "mlflow":
        return MLflowLogger(run_dir, experiment=os.environ.get("MLFLOW_EXPERIMENT_NAME")
                            or _experiment_name(job))
    if name == "wandb":
        return WandbLogger(run_dir, project=os.environ.get("WANDB_PROJECT")
                           or _experiment_name(job))
    raise ConfigError(f"unknown logger {name!r}; choose from 'csv', 'tensorboard', "
                      + ", ".join(repr(n) for n in EXTERNAL_LOGGERS))
