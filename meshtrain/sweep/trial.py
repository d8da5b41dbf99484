"""Inside a trial: check the job against the sweep, report the objective's metric at each
validation to the study (so that its pruner can stop a bad trial early) and write the trial's
result for the sweep.

A trial is an ordinary ``meshtrain train`` run that the sweep starts with the environment
variable ``MESHTRAIN_SWEEP_TRIAL`` (storage, study, trial id, metric, result file); the Trainer
then adds :class:`TrialReporter` to its callbacks. At the start of fit every rank's settings and
optimizer values are gathered and compared (meshtrain/sweep/ranks.py); at the first validation
(without validation data: the first log) rank 0 checks that the job logs the objective
(meshtrain/sweep/objective.py). Either mistake fails the trial with :class:`SweepStop`, whose
reason goes to the trial's result, and the sweep stops. Rank 0 talks to the database and tells
the other ranks whether to stop, so every rank stops at the same step."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import torch

from meshtrain.callbacks import Callback
from meshtrain.errors import ConfigError

ENV = "MESHTRAIN_SWEEP_TRIAL"
RESULT = "sweep_result.json"
GO, PRUNE, MISSING = 0, 1, 2  # rank 0's word at a validation


class SweepStop(ConfigError):
    """A mistake in the job or the space that every trial would repeat (the objective is not
    logged; the ranks train with different values): the trial fails with it, the sweep stops."""


def trial_callbacks() -> list[Callback]:
    """[a TrialReporter] inside a sweep's trial, else []."""
    text = os.environ.get(ENV)
    return [TrialReporter(json.loads(text))] if text else []


def _group(trainer):
    return trainer.mesh.everyone() if trainer.mesh is not None else None


class TrialReporter(Callback):
    def __init__(self, info: dict):
        self.info, self.trial, self.pruned = info, None, False
        self.value, self.step = None, 0
        self.ranks, self.error, self.checked = None, None, False

    def _trial(self):
        if self.trial is None:
            import optuna

            from meshtrain.sweep.study import make_pruner, open_storage

            optuna.logging.set_verbosity(optuna.logging.WARNING)
            pruner = make_pruner(self.info["pruner"], self.info["pruner_startup_trials"])
            study = optuna.load_study(study_name=self.info["study"], pruner=pruner,
                                      storage=open_storage(self.info["storage"]))
            self.trial = optuna.trial.Trial(study, self.info["trial_id"])
        return self.trial

    def on_fit_start(self, trainer) -> None:
        """Every rank's Trainer settings and optimizer values, gathered (every rank gets them
        all) and compared with rank 0's: a dp=2 trial must not train two models."""
        from meshtrain.sweep.ranks import mismatch_message, rank_values

        mine, group = rank_values(trainer), _group(trainer)
        seen = [mine]
        if group is not None:
            import torch.distributed as dist

            seen = [None] * dist.get_world_size(group)
            dist.all_gather_object(seen, mine, group=group)
        self.ranks = [{k: v for k, v in r.items() if k != "settings"} for r in seen]
        message = mismatch_message(seen)
        if message is not None:  # every rank holds the same list: all stop alike
            self.error = message
            raise SweepStop(message)

    def _logged(self, trainer, metrics: dict) -> set[str]:
        """What the job has logged so far, and what it logs later in the epoch (values of
        ``self.log(..., on_epoch=True)`` not yet written out)."""
        pending = getattr(trainer, "_logs", None)  # the Trainer's LogBuffer
        later = set(getattr(pending, "window", ())) | set(getattr(pending, "epoch", ()))
        return set(trainer.callback_metrics) | set(metrics) | later

    def _agree(self, trainer, word: int) -> int:
        """Rank 0's ``word``, on every rank (one broadcast)."""
        group = _group(trainer)
        if group is None:
            return word
        import torch.distributed as dist

        flag = torch.tensor([float(word)], device=trainer.device)
        dist.broadcast(flag, group=group, group_src=0)
        return int(flag.item())

    def _stop_if_missing(self, trainer, word: int) -> None:
        if word == MISSING:
            raise SweepStop(self.error or f"the objective metric {self.info['metric']!r} is "
                            "not logged by the job (rank 0 says which names it logs)")

    def on_train_step_end(self, trainer, metrics: dict) -> None:
        """Without validation data, the objective is checked at the first log."""
        if self.checked or not metrics or trainer.val_data is not None:
            return
        self.checked, metric, word = True, self.info["metric"], GO
        if trainer.is_global_zero and metric not in self._logged(trainer, metrics):
            word = MISSING
            self.error = self._missing(trainer, metrics)
        self._stop_if_missing(trainer, self._agree(trainer, word))

    def _missing(self, trainer, metrics: dict) -> str:
        from meshtrain.sweep.objective import missing_metric

        return missing_metric(self.info["metric"], self._logged(trainer, metrics), "the job")

    def on_validation_end(self, trainer, metrics: dict) -> None:
        metric = self.info["metric"]
        value = metrics.get(metric, trainer.callback_metrics.get(metric))
        self.step, word = trainer.global_step, GO
        if trainer.is_global_zero:
            if value is not None:
                self.value = float(value)
                trial = self._trial()
                trial.report(self.value if math.isfinite(self.value) else float("inf")
                             if self.info["direction"] == "minimize" else float("-inf"),
                             self.step)
                word = PRUNE if trial.should_prune() or not math.isfinite(self.value) else GO
            elif not self.checked and metric not in self._logged(trainer, metrics):
                word, self.error = MISSING, self._missing(trainer, metrics)
        self.checked = True
        word = self._agree(trainer, word)  # every rank stops at the same step
        self._stop_if_missing(trainer, word)
        if word == PRUNE and trainer.global_step < trainer.total_steps():
            self.pruned = True
            trainer.should_stop, trainer.stop_reason = True, "pruned"
            message = f"{metric} = {value}: pruned by the sweep's pruner; stopping this trial"
            trainer.print(f"step {trainer.global_step}: {message}")
            trainer.monitor.event("pruned", message, trainer.global_step)  # the run's events

    def on_exception(self, trainer, error: BaseException) -> None:
        """A SweepStop's reason goes to the trial's result (other errors: its log)."""
        if isinstance(error, SweepStop) and trainer.is_global_zero:
            self._write(trainer, None, error=str(error))

    def on_fit_end(self, trainer) -> None:
        if not trainer.is_global_zero:
            return
        metric = self.info["metric"]
        value = trainer.callback_metrics.get(metric, self.value)
        error = None
        if value is None and trainer.stop_reason is None:  # trained to its end: never logged
            error = self.error or self._missing(trainer, {})
        self._write(trainer, value, error=error)

    def _write(self, trainer, value, *, error: str | None) -> None:
        result = {"value": None if value is None else float(value), "pruned": self.pruned,
                  "step": trainer.global_step, "run_dir": str(trainer.run_dir),
                  "ranks": self.ranks, "error": error, "stop_sweep": error is not None}
        path = Path(self.info["result"])
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(result))
        os.replace(tmp, path)
