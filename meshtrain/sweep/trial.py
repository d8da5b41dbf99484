"""Inside a trial: report the objective's metric at each validation to the study (so that its
pruner can stop a bad trial early) and write the trial's result for the sweep.

A trial is an ordinary ``meshtrain train`` run that the sweep starts with the environment
variable ``MESHTRAIN_SWEEP_TRIAL`` (storage, study, trial id, metric, result file); the Trainer
then adds :class:`TrialReporter` to its callbacks. Rank 0 talks to the database and tells the
other ranks whether to stop, so every rank stops at the same step."""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import torch

from meshtrain.callbacks import Callback

ENV = "MESHTRAIN_SWEEP_TRIAL"
RESULT = "sweep_result.json"


def trial_callbacks() -> list[Callback]:
    """[a TrialReporter] inside a sweep's trial, else []."""
    text = os.environ.get(ENV)
    return [TrialReporter(json.loads(text))] if text else []


class TrialReporter(Callback):
    def __init__(self, info: dict):
        self.info, self.trial, self.pruned = info, None, False
        self.value, self.step = None, 0

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
        """Every rank's searched values, as its own command line gave them, gathered to rank 0
        and checked against the study's (a dp=2 trial must not train two models)."""
        from meshtrain.config import parse_override

        keys = set(self.info.get("params", {}))
        mine = {}
        for arg in sys.argv[1:]:
            if arg.startswith("--") and "=" in arg and arg[2:].split("=")[0] in keys:
                section, key, value = parse_override(arg)
                mine[f"{section}.{key}"] = value
        group = trainer.mesh.everyone() if trainer.mesh is not None else None
        seen = [mine]
        if group is not None:
            import torch.distributed as dist

            seen = [None] * dist.get_world_size(group)
            dist.all_gather_object(seen, mine, group=group)
        self.ranks_params = seen
        want = self.info.get("params", {})
        if trainer.is_global_zero and any(s != want for s in seen):
            from meshtrain.errors import ConfigError

            raise ConfigError(f"the trial's ranks read different hyperparameters: {seen} "
                              f"(the study drew {want})")

    def on_validation_end(self, trainer, metrics: dict) -> None:
        value = metrics.get(self.info["metric"])
        self.step = trainer.global_step
        prune = torch.zeros(1)
        if trainer.is_global_zero and value is not None:
            self.value = float(value)
            trial = self._trial()
            trial.report(self.value if math.isfinite(self.value) else float("inf")
                         if self.info["direction"] == "minimize" else float("-inf"), self.step)
            prune[0] = float(trial.should_prune() or not math.isfinite(self.value))
        group = trainer.mesh.everyone() if trainer.mesh is not None else None
        if group is not None:  # every rank stops at the same step
            import torch.distributed as dist

            flag = prune.to(trainer.device)
            dist.broadcast(flag, group=group, group_src=0)
            prune = flag.cpu()
        if prune.item() and trainer.global_step < trainer.total_steps():
            self.pruned = True
            trainer.should_stop, trainer.stop_reason = True, "pruned"
            message = (f"{self.info['metric']} = {value}: pruned by the sweep's pruner; "
                       "stopping this trial")
            trainer.print(f"step {trainer.global_step}: {message}")
            trainer.monitor.event("pruned", message, trainer.global_step)  # the run's events

    def on_fit_end(self, trainer) -> None:
        if not trainer.is_global_zero:
            return
        value = trainer.callback_metrics.get(self.info["metric"], self.value)
        result = {"value": None if value is None else float(value), "pruned": self.pruned,
                  "step": trainer.global_step, "run_dir": str(trainer.run_dir),
                  "ranks_params": getattr(self, "ranks_params", None)}
        path = Path(self.info["result"])
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(result))
        os.replace(tmp, path)
