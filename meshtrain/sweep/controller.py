"""The sweep's loop: ask the study for a trial whenever a slot of the machine is free, run it as
``meshtrain train CONFIG --key=value ...`` in that slot, and tell the study how it ended.

Every rank of a trial reads its hyperparameters from the same command line (they are drawn
once, here), and the trial checks what each rank's Trainer and optimizer hold
(meshtrain/sweep/ranks.py). The objective metric is checked against what the job logs before
any trial when its recipe says (``metrics(config)``), else at the first trial's first validation
(meshtrain/sweep/objective.py). A trial that fails such a check (``SweepStop``) stops the sweep:
no further trial starts, the running ones end on their own, the results are written and
:func:`run_sweep` raises the reason. A restarted sweep (same command, same folder or storage)
first runs again the trials the last one left running: each has its own run folder, so
``resume="auto"`` continues it from its last checkpoint."""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from meshtrain.config import toml_value
from meshtrain.errors import ConfigError
from meshtrain.sweep.objective import declared_metrics, missing_metric
from meshtrain.sweep.slots import check_layout_fits, machine_devices, preexec, split
from meshtrain.sweep.space import SweepSpec, load_spec, param_overrides
from meshtrain.sweep.trial import ENV, RESULT


def _check_config(config: str, overrides: list[str], spec: SweepSpec):
    """Every searched key and value against the job's config (unknown keys, bad values), before
    anything runs; (the resolved base config, its Trainer keywords, the metric names the job
    logs under any searched value when its recipe says, else None)."""
    from meshtrain.recipes import resolve_config

    recipe, base, flat = resolve_config(config, list(overrides))
    configs = [base]
    for param in spec.params:
        for value in param.examples():
            try:
                configs.append(resolve_config(
                    config, [*overrides, f"--{param.key}={toml_value(value)}"])[1])
            except ConfigError as error:
                raise ConfigError(f"[params] {param.key!r} = {value!r}: {error}") from None
    return base, flat, declared_metrics(recipe, configs)


def _processes(config: str, overrides: list[str], spec: SweepSpec) -> dict[str, int]:
    """{layout: processes} over the layouts the trials may use."""
    from meshtrain.parallel.layout import Layout
    from meshtrain.recipes import resolve_config

    layouts = {}
    choices = next((p.examples() for p in spec.params if p.key == "trainer.layout"), [None])
    for layout in choices:
        extra = [f"--trainer.layout={toml_value(layout)}"] if layout is not None else []
        flat = resolve_config(config, [*overrides, *extra])[2]
        if flat.get("layout") not in (None, "auto"):
            devices = flat.get("devices")
            try:
                parsed = Layout.parse(flat["layout"], devices if isinstance(devices, int)
                                      else None)
            except ConfigError as error:
                where = "[params] 'trainer.layout'" if layout is not None else "the config's"
                raise ConfigError(f"{where} layout {flat['layout']!r}: {error}") from None
            layouts[str(flat["layout"])] = parsed.num_processes
    return layouts


class Sweep:
    """One sweep over ``config`` (a TOML job) as ``spec`` says, in ``sweep_dir``."""

    def __init__(self, config: str, spec: SweepSpec, *, overrides=(), sweep_dir=None,
                 log=print):
        from meshtrain.sweep.study import open_storage, storage_url

        self.config, self.spec, self.overrides, self.log = str(config), spec, list(overrides), log
        self.base, flat, self.metrics = _check_config(self.config, self.overrides, spec)
        if self.metrics is not None and spec.metric not in self.metrics:
            raise ConfigError(missing_metric(spec.metric, self.metrics,
                                             f"the job {Path(self.config).name}"))
        self.name = spec.study or self.base["logging"]["name"]
        self.dir = Path(sweep_dir or Path(self.base["logging"]["root_dir"]) / self.name / "sweep")
        kind, devices = machine_devices(flat.get("accelerator", "auto"))
        self.slots = split(kind, devices, spec.devices_per_trial, spec.concurrent)
        for layout, processes in _processes(self.config, self.overrides, spec).items():
            check_layout_fits(spec.devices_per_trial, kind, processes, layout)
        self.url = storage_url(spec.storage, self.dir)
        self.owner = f"{socket.gethostname()}:{self.dir.resolve()}"
        if spec.storage:  # a URL of the user's: opened now, so a bad one fails before any trial
            open_storage(self.url)
        self.stopped: str | None = None  # why a trial stopped the sweep (SweepStop)

    def describe(self) -> str:
        lines = [f"sweep {self.name!r}: {self.spec.trials} trials, {len(self.slots)} at a time, "
                 f"{self.spec.direction} {self.spec.metric}; study in {self.url}",
                 f"folder: {self.dir}", "machine split:"]
        lines += [f"  {slot.describe()}" for slot in self.slots]
        lines.append("space:")
        lines += [f"  {p.key}: {p.describe()}" for p in self.spec.params]
        if self.metrics is not None:
            lines.append(f"objective: {self.spec.metric} is logged by the job (its recipe "
                         f"logs {', '.join(self.metrics)})")
        else:
            lines.append(f"objective: {self.spec.metric} is checked at the first trial's first "
                         "validation (the job's recipe does not say what it logs: give it "
                         "metrics(config) to check before any trial)")
        lines.append(f"pruner: {self.spec.pruner}; sampler: {self.spec.sampler} (seed "
                     f"{self.spec.seed}; trial k trains with seed {self.spec.seed} + k)")
        return "\n".join(lines)

    # -- the loop -------------------------------------------------------------------------------
    def run(self):
        import optuna

        from meshtrain.sweep.study import make_study

        self.dir.mkdir(parents=True, exist_ok=True)
        study = make_study(self.spec, self.url, self.name)
        if not study.trials:
            for values in self.spec.enqueue:
                study.enqueue_trial(values)
        # this sweep's own trials that a killed run of it left running (several machines may
        # share one study through a database: each continues only its own)
        left = [t for t in study.get_trials(deepcopy=False,
                                            states=(optuna.trial.TrialState.RUNNING,))
                if t.user_attrs.get("owner") == self.owner]
        if left:
            self.log(f"sweep: continuing {len(left)} trial(s) the last sweep left running: "
                     f"{', '.join(str(t.number) for t in left)}")
        running: dict[int, tuple] = {}  # slot index -> (trial number, trial id, process, start)
        try:
            while True:
                for index, (number, trial_id, proc, start) in list(running.items()):
                    if proc.poll() is not None:
                        self._finish(study, number, trial_id, proc.returncode, start)
                        del running[index]
                for slot in self.slots:
                    if slot.index in running:
                        continue
                    if self.stopped is not None:  # a trial found a mistake: no more trials
                        break
                    if left:
                        trial = left.pop(0)
                        number, trial_id, params = trial.number, trial._trial_id, trial.params
                        if self._ended(number):  # it ended before the last sweep heard of it
                            self._finish(study, number, trial_id, 0, time.monotonic())
                            continue
                    elif self._started(study) < self.spec.trials:
                        trial = study.ask(self.spec.distributions())
                        number, trial_id, params = trial.number, trial._trial_id, trial.params
                    else:
                        break
                    busy = {d for s in self.slots if s.index in running for d in s.devices}
                    assert not busy & set(slot.devices), (slot, busy)  # trials never share
                    proc = self._launch(study, number, trial_id, params, slot)
                    running[slot.index] = (number, trial_id, proc, time.monotonic())
                if not running:
                    break
                time.sleep(0.2)
        except BaseException:  # Ctrl-C: stop the trials; a restart continues them
            for _, _, proc, _ in running.values():
                _stop(proc)
            raise
        return study

    @staticmethod
    def _started(study) -> int:
        """Trials asked for so far (not those only enqueued, which wait for their turn, nor
        those that stopped a sweep: its mistake, once fixed, costs no trial of the budget)."""
        import optuna

        waiting = optuna.trial.TrialState.WAITING
        return sum(t.state != waiting and not t.user_attrs.get("stopped_sweep")
                   for t in study.get_trials(deepcopy=False))

    def _trial_dir(self, number: int) -> Path:
        return self.dir / f"trial_{number:04d}"

    def _launch(self, study, number: int, trial_id: int, params: dict, slot):
        import optuna

        folder = self._trial_dir(number)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / RESULT).unlink(missing_ok=True)
        seed = params.get("trainer.seed", self.spec.seed + number)
        command = [sys.executable, "-m", "meshtrain", "train", self.config, *self.overrides,
                   *param_overrides(params), f"--logging.run_dir={toml_value(str(folder / 'run'))}",
                   "--logging.progress_bar=false"]
        if "trainer.seed" not in params:
            command.append(f"--trainer.seed={seed}")
        info = {"storage": self.url, "study": self.name, "trial_id": trial_id,
                "metric": self.spec.metric, "direction": self.spec.direction,
                "result": str(folder / RESULT), "params": params, "pruner": self.spec.pruner,
                "pruner_startup_trials": self.spec.pruner_startup_trials}
        env = {**os.environ, **slot.environ(), ENV: json.dumps(info)}
        trial = optuna.trial.Trial(study, trial_id)
        trial.set_user_attr("owner", self.owner)
        trial.set_user_attr("seed", seed)
        trial.set_user_attr("run_dir", str(folder / "run"))
        trial.set_user_attr("command", " ".join(command[1:]))
        trial.set_user_attr("starts", trial.user_attrs.get("starts", 0) + 1)
        trial.set_user_attr("started_at", time.time())
        trial.set_user_attr("slot", list(slot.devices))
        self.log(f"sweep: trial {number} on {slot.describe()}: "
                 f"{', '.join(f'{k}={v!r}' for k, v in sorted(params.items()))}")
        with open(folder / "log.txt", "a") as log:
            return subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT,
                                    preexec_fn=preexec(slot))

    def _ended(self, number: int) -> bool:
        folder = self._trial_dir(number)
        return (folder / RESULT).is_file() or (
            folder / "run" / "checkpoints" / "final" / "meshtrain.json").is_file()

    def _result(self, number: int) -> dict:
        """What the trial wrote at its end; else what its final checkpoint says (a trial that
        ended while the sweep was down, between its final checkpoint and its result)."""
        folder = self._trial_dir(number)
        if (folder / RESULT).is_file():
            return json.loads((folder / RESULT).read_text())
        final = folder / "run" / "checkpoints" / "final" / "meshtrain.json"
        if final.is_file():
            summary = json.loads(final.read_text())
            return {"value": summary.get("metrics", {}).get(self.spec.metric),
                    "step": summary.get("step"), "pruned": False}
        return {}

    def _finish(self, study, number: int, trial_id: int, code: int, start: float) -> None:
        import optuna

        State = optuna.trial.TrialState
        result = self._result(number)
        trial = optuna.trial.Trial(study, trial_id)
        trial.set_user_attr("wall_s", trial.user_attrs.get("wall_s", 0.0)
                            + time.monotonic() - start)
        trial.set_user_attr("ended_at", time.time())
        trial.set_user_attr("steps", result.get("step"))
        trial.set_user_attr("exit_code", code)
        value, error = result.get("value"), result.get("error")
        if result.get("pruned") and not error:
            study.tell(number, state=State.PRUNED)
            status = "pruned"
        elif code == 0 and not error and value is not None and math.isfinite(value):
            study.tell(number, value)
            status = f"{self.spec.metric} = {value:.6g}"
        else:
            log = self._trial_dir(number) / "log.txt"
            reason = error or (f"exit code {code}: {_last_line(log)} (see {log})" if code else
                               f"it ended with {self.spec.metric} = {value} (see {log})")
            stops = bool(result.get("stop_sweep")) and error is not None
            trial.set_user_attr("fail_reason", reason)
            trial.set_user_attr("stopped_sweep", stops)
            study.tell(number, state=State.FAIL)
            status = f"failed: {reason}"
            if stops and self.stopped is None:
                self.stopped = f"trial {number} failed: {reason}"
                self.log(f"sweep: trial {number} {status}")
                self.log("sweep: stopping: no further trial starts (the running ones end on "
                         "their own); fix the job or the space and run the sweep again")
                return
        self.log(f"sweep: trial {number} {status}")


def _last_line(path: Path) -> str:
    """The last line a failed trial wrote (its error), at most 300 characters."""
    try:
        lines = [line for line in path.read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        return "no log"
    return lines[-1][-300:] if lines else "no output"


def _stop(proc) -> None:
    import signal

    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)


def run_sweep(config: str, space: str | None = None, *, table: dict | None = None,
              overrides=(), sweep_dir=None, dry_run: bool = False, log=print, **flags):
    """Run (or continue) the sweep of ``space`` (a SPACE.toml path, or the same as a mapping
    ``table``) over the job ``config``; ``flags``: the ``[sweep]`` keys. Returns the Optuna
    study (None for ``dry_run``, which prints the split of the machine and the space, after
    every check made before a trial). Raises ``ConfigError`` when a check fails, before any
    trial, or when a trial stopped the sweep (after writing its results)."""
    from meshtrain.sweep.results import summarize

    spec = load_spec(space, table=table, **flags)
    sweep = Sweep(config, spec, overrides=overrides, sweep_dir=sweep_dir, log=log)
    log(sweep.describe())
    if dry_run:
        log("dry run: no trial was started")
        return None
    study = sweep.run()
    summarize(study, sweep, log=log)
    if sweep.stopped is not None:
        raise ConfigError(f"the sweep stopped: {sweep.stopped}")
    return study
