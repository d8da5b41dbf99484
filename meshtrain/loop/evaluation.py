"""Validation and test for the Trainer: the mean loss and ``metrics`` over a dataset, every
sample seen once over the ranks, plus what a research module's ``validation_step`` /
``test_step`` logged (reduced over the ranks at the end of the evaluation)."""

from __future__ import annotations

from meshtrain import checks
from meshtrain.data.sampler import eval_loader
from meshtrain.errors import ConfigError
from meshtrain.loop.state import loader_options
from meshtrain.module.core import STEP_OF
from meshtrain.module.hooks import IN_EVALUATION, call
from meshtrain.module.log_buffer import LogBuffer


def evaluate(t, data, prefix: str) -> dict[str, float]:
    """``{prefix}/loss`` and ``{prefix}/<metric>`` over ``data`` (in validation only its first
    ``limit_val_batches`` x ``global_batch_size`` samples: the same ones under any layout),
    and the values logged meanwhile."""
    limit = t.limit_val_batches if prefix == "val" else None
    loader = eval_loader(checks.dataset_of(data, prefix), data,
                         micro_batch_size=t.micro_batch_size, dp_rank=t.dp_rank,
                         dp_degree=t.mesh.layout.batch_degree,
                         max_samples=limit and limit * t.global_batch_size,
                         **loader_options(t))
    if t.engine.step_call is not None:
        step = STEP_OF[prefix]
        if not callable(getattr(t.model, step, None)):
            raise ConfigError(f"{type(t.model).__name__} trains through training_step but has no "
                              f"{step}(batch, batch_idx); add one to evaluate it on {prefix} data")
        t.engine.eval_step = step
    training_logs, t._logs = t._logs, LogBuffer()  # what the evaluation logs, on its own
    t._logs.evaluation = True
    start, epoch_start, epoch_end, end = IN_EVALUATION["validation" if prefix == "val"
                                                       else "test"]
    try:
        call(t.model, (start, epoch_start))
        values = t.engine.evaluate(loader, t.metrics)
        call(t.model, (epoch_end,))  # (what it logs is the evaluation's)
        t._logs.whole()  # (on_epoch or not: the whole evaluation)
        logged = t._logs.take("window", t.mesh.loss_group(), t.device,
                              t.mesh.stage_group())
    finally:
        training_logs.unlogged |= t._logs.unlogged  # (logger=False: kept from the loggers)
        t._logs = training_logs
    call(t.model, (end,))
    return {**{f"{prefix}/{k}": v for k, v in values.items()}, **logged}


def evaluate_and_log(t, data, prefix: str) -> dict[str, float]:
    """``Trainer.validate`` / ``Trainer.test``: evaluate after fit, and log at the step."""
    if t.model is None or data is None:
        raise ConfigError(f"call fit(...) first, and pass the data to "
                          f"{'validate (or val_data to fit)' if prefix == 'val' else 'test'}")
    metrics = evaluate(t, data, prefix)
    t.log_metrics(metrics)
    return metrics


def run_validation(t) -> dict[str, float]:
    """Validation inside fit: callbacks around it, metrics logged and printed."""
    t._call("on_validation_start")
    metrics = evaluate(t, t._val_data, prefix="val")
    t.callback_metrics.update(metrics)
    t.log_metrics(metrics)
    t._call("on_validation_end", metrics)
    t.print(f"step {t.global_step}: " + ", ".join(f"{k} {v:.4f}" for k, v in metrics.items()))
    return metrics
