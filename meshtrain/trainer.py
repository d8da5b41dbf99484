"""The Trainer: one training loop for every layout.

Research code (a model, a loss, an optimizer factory, data) goes in; the Trainer runs the loop.
Everything layout-specific sits behind one :class:`~meshtrain.parallel.engine.Engine`, which
applying the layout returns; a training step, for a global batch of G samples split over the
batch ranks, is::

    loss, tokens = engine.forward_backward(batches)   # every micro-batch of the step
    engine.sync_gradients()                           # averages what DDP/FSDP did not
    decide "ok"/"skip"/"rollback" (NaN/Inf)           # the same on every rank
    norm = engine.clip_grad_norm(grad_clip_norm)      # global norm, before clipping
    optimizer.step(); scheduler.step()

which is one step of one-process training on the same G samples: the parity tests check that.
Settings are defined once in :mod:`meshtrain.settings` (docs/reference.md lists them all).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch.utils.data import DataLoader, Dataset

from meshtrain import checks
from meshtrain.checkpoint.run_lock import release as release_run_lock
from meshtrain.data.sampler import release_workers
from meshtrain.fault import StepGuard
from meshtrain.launch.spawn import DistEnv
from meshtrain.launch.world import collective_checks, drain_collectives, resolve_world_size
from meshtrain.launch.slurm import requeue_callbacks
from meshtrain.loop.compiled_model import unwrap_compiled
from meshtrain.loop.evaluation import evaluate_and_log
from meshtrain.loop.layout_settings import use_layout
from meshtrain.loop.lightning_views import LightningViews
from meshtrain.loop.prediction import predict as predict_all
from meshtrain.loop.seeding import remember_seed, seed_everything
from meshtrain.loop.state import RESUMABLE_STOPS, LoopState, MetricWindow
from meshtrain.module.data_hooks import eval_data, fit_data, needed
from meshtrain.module.hooks import after_callbacks
from meshtrain.module.log_buffer import LogBuffer
from meshtrain.observe.run_log import RunLog
from meshtrain.observe.step_timer import TimedBatches
from meshtrain.parallel.mesh import ParallelMesh
from meshtrain.plan.auto import auto_pins
from meshtrain.sweep.trial import trial_callbacks

ModelLike = torch.nn.Module | Callable[[], torch.nn.Module]
DataLike = Dataset | DataLoader


class Trainer(LightningViews):
    """Train a model under a parallel ``layout`` on ``devices`` processes.

    Takes the settings of :mod:`meshtrain.settings` as keywords (``layout="dp=2"``,
    ``max_steps=100``, ...); docs/reference.md lists every one with its default and doc.
    Every setting is also an attribute (``trainer.max_steps``); Lightning's names of what it
    knows too (loop/lightning_views.py).
    """

    def __init__(self, **settings):
        from meshtrain.fault import check_settings as check_fault_settings

        # what the user set (a DataLoader lends the rest); Lightning's names taken as ours
        s, self._given, notes = checks.trainer_settings(settings)
        self._settings = s
        seed_everything(s["seed"])  # a model built after this starts the same on every rank
        self.device_type = checks.resolve_device_type(s)
        self._env = DistEnv.from_environ()
        check_fault_settings(s)
        self._processes = world_size = resolve_world_size(s["devices"], self._env, self.device_type)
        self._auto_pins = auto_pins(s["layout"])
        if self._auto_pins is None:
            use_layout(self, s, world_size)
        else:  # layout="auto": planned by check/fit before any process (meshtrain/plan/auto.py)
            self.layout = self.batch_plan = self.pipeline_options = self.parallel_options = None
            self.world_size, self.micro_batch_size, self.grad_accum_steps = world_size, None, None
        self.callbacks, self.precision_name = list(s["callbacks"]), s["precision"]
        # a sweep's trial reports to its study; under Slurm a stop signal requeues the job
        self.callbacks += trial_callbacks() + requeue_callbacks()
        self._run_dir_arg = s["run_dir"]
        self.rank = self._env.rank if self._env else 0
        self.mesh: ParallelMesh | None = None
        self.engine = self.model = self.optimizer = self.lr_scheduler = None
        self.state = LoopState()
        self.grad_norm: torch.Tensor | None = None  # the last step's, before clipping
        self.should_stop, self.callback_metrics = False, {}
        self.stop_reason = None  # "max_time", "signal": stopped, to be continued (resume.py)
        self.run_dir = self._resume_from = self._workers = self._val_data = None
        self.datamodule = None  # fit(..., datamodule=dm): Lightning's (module/data_hooks.py)
        self.ps_server = self._store = self.ps_stats = None  # ps=S: server index, its counters
        # printed at start: threads, network (launch/world.py); the defaults filled in
        self.start_notes, self.loader_notes, self.skipped_checks = "", notes, []
        self._model_shapes = None  # the whole model's state names and shapes (resume.py)
        self._whole_template = None  # what whole_model() fills (parallel/whole_state.py)
        self.run_log = RunLog(self.rank == 0)
        self.checkpoints = None  # the CheckpointManager: every save goes through it
        self._guard: StepGuard | None = None  # NaN/Inf, watchdog, periodic saves (fault/)
        self.monitor = None  # breakdown, MFU, events, traces (meshtrain/observe/monitor.py)
        self._logs = LogBuffer()  # what trainer.log / a module's self.log collected

    def __getattr__(self, name: str):
        settings = self.__dict__.get("_settings", {})
        if name in settings:
            return settings[name]
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    # -- where the loop stands (LoopState) ------------------------------------------------------
    global_step = property(lambda self: self.state.global_step)
    current_epoch = property(lambda self: self.state.current_epoch)
    num_skipped_steps = property(lambda self: self.state.num_skipped_steps)
    num_rollbacks = property(lambda self: self.state.num_rollbacks)
    is_global_zero = property(lambda self: self.rank == 0)
    val_data = property(lambda self: self._val_data)  # what fit validates on (None: nothing)
    # this rank's index among the ranks that see different samples
    dp_rank = property(lambda self: self.mesh.batch_rank if self.mesh is not None else 0)

    def print(self, *args, **kwargs) -> None:
        """``print`` on global rank zero only, through the ``meshtrain`` logger (run_log.py)."""
        self.run_log.print(*args, **kwargs)

    def hparams(self) -> dict:
        """The run's settings as loggers record them (plain values only)."""
        values = {k: v for k, v in self._settings.items()
                  if v is None or isinstance(v, (bool, int, float, str))}
        return {**values, "layout": str(self.layout), "world_size": self.world_size,
                "micro_batch_size": self.micro_batch_size,
                "grad_accum_steps": self.grad_accum_steps}

    # -- fit ------------------------------------------------------------------------------------
    def fit(self, model: ModelLike, train_data: DataLike | None = None,
            val_data: DataLike | None = None, *, datamodule=None, optimizer: Callable | None = None,
            loss_fn: Callable | None = None, lr_scheduler: Callable | None = None,
            **lightning) -> torch.nn.Module:
        """Train ``model`` and return it (the same module object the user passed or built).

        ``optimizer``: a factory ``params -> Optimizer`` (or the model's
        ``configure_optimizers()``); ``lr_scheduler``: ``optimizer -> LRScheduler``, stepped
        every optimizer step. With ``loss_fn`` each batch is ``(inputs, targets)``; without it
        the model returns the loss, or its ``training_step(batch, batch_idx)`` does
        (meshtrain.TrainingModule). Data may be a function that builds the dataset (after the
        model's ``prepare_data()``), a Lightning ``datamodule``, or the model's own
        ``train_dataloader()`` (module/data_hooks.py). Where it resumes from is the
        ``resume`` setting ("auto": this job's newest checkpoint; a folder; None). Lightning's
        ``train_dataloaders``, ``val_dataloaders``, ``ckpt_path`` too (module/lightning_calls.py).
        """
        model = unwrap_compiled(self, model)  # torch.compile's wrapper: its module (its hooks)
        train_data, val_data = fit_data(self, model, train_data, val_data, datamodule, lightning)
        self.prepare(model, train_data, val_data, optimizer=optimizer, loss_fn=loss_fn,
                     lr_scheduler=lr_scheduler)
        if self.ps_server is not None:  # a parameter server: serves until training ends
            from meshtrain.loop.setup import serve

            return serve(self, model)
        self.print(f"run folder: {self.run_dir}")
        self.print(self.start_notes)
        if self.model_summary:  # collective: every rank's count
            from meshtrain.observe.model_summary import model_summary

            self.print(model_summary(self.model, self.mesh.everyone(), self.world_size))
        start = time.perf_counter()
        try:
            with collective_checks(self.debug_collectives):
                self._fit_loop()
            drain_collectives()
            self.monitor.finish(stop_reason=self.stop_reason, step=self.global_step)
            self.print(self.monitor.summary(self, time.perf_counter() - start))
        except BaseException as error:
            self._call("on_exception", error)
            self.monitor.finish(error)  # the report says how far it got
            if self._workers is not None:
                self._workers.raise_if_failed(error)
            raise
        finally:
            remember_seed()  # what fit left of torch's seed is meshtrain's (loop/seeding.py)
            self.run_log.finish()
            release_workers(self.train_loader)  # the DataLoader's worker processes, if any
            self.print(f"run folder: {self.run_dir}")  # again, below the training output
            if self.report:  # run_dir/report.html, also after a failure
                self.run_log.report(self.monitor)
            release_run_lock(self.run_dir)  # another job may write it now (checkpoint/run_lock.py)
        return self.model

    def whole_model(self) -> torch.nn.Module:
        """The trained model whole, under any layout (collective: call it on every rank after
        ``fit``): the module ``fit`` returned when it is whole already (one process, dp, zero1,
        zero2), else a new one on the CPU, of the same class, holding the gathered weights
        (zero3/FSDP2 shards, tp's DTensors, every pipeline stage)."""
        from meshtrain.parallel.whole_state import whole_model

        return whole_model(self.model, self._whole_template, self.layout.degree("pp"))

    def lr_find(self, model: ModelLike, train_data: DataLike, *, optimizer: Callable,
                loss_fn: Callable | None = None, min_lr: float = 1e-6, max_lr: float = 1.0,
                num_steps: int = 100):
        """Learning-rate range test; see :func:`meshtrain.lr_find.lr_find`."""
        from meshtrain.lr_find import lr_find

        return lr_find(self, model, train_data, optimizer=optimizer, loss_fn=loss_fn,
                       min_lr=min_lr, max_lr=max_lr, num_steps=num_steps)

    def check(self, model: ModelLike, train_data: DataLike, val_data: DataLike | None = None,
              *, optimizer: Callable | None = None, loss_fn: Callable | None = None,
              lr_scheduler: Callable | None = None) -> list[str]:
        """Every check ``fit`` makes before any process starts (the inputs, the model against
        the layout on a meta-device copy) and nothing else; ConfigError names the fix. Returns
        the checks that could not run, each with why ("pipeline check skipped: ...")."""
        from meshtrain.loop.setup import check_before_start

        check_before_start(self, model, train_data, val_data, optimizer=optimizer,
                           loss_fn=loss_fn, lr_scheduler=lr_scheduler)
        return list(self.skipped_checks)

    def prepare(self, model, train_data, val_data=None, *, optimizer=None, loss_fn=None,
                lr_scheduler=None) -> None:
        """Check the inputs, then create processes, model, optimizer and data loaders, and
        resume when a checkpoint is due (what ``fit`` does before its loop; loop/setup.py)."""
        from meshtrain.loop.setup import prepare

        try:
            prepare(self, model, train_data, val_data, optimizer=optimizer, loss_fn=loss_fn,
                    lr_scheduler=lr_scheduler)
        finally:
            remember_seed()  # (its reseeding too, also for lr_find)

    # -- the loop ---------------------------------------------------------------------------------
    def _fit_loop(self) -> None:
        from meshtrain.loop.step_end import end_epoch, end_step
        from meshtrain.observe.memory.probe import MemoryProbe

        state, guard = self.state, self._guard
        total = self.total_steps()
        self.should_stop = False
        self._call("on_fit_start")
        self.run_log.start_progress(total, enabled=self.progress_bar)
        memory = MemoryProbe(self.model, self.optimizer, self.layout) if self.is_global_zero else None
        timer = self.monitor.timer
        state.window = MetricWindow(torch.zeros((), dtype=torch.float64, device=self.device))
        validated_at = None  # the step of the last validation
        guard.start()
        try:
            while state.global_step < total and not self.should_stop:
                if state.epoch_done():
                    state.next_epoch()
                self._call("on_train_epoch_start")
                batches = TimedBatches(iter(self.train_loader), timer)
                while state.global_step < total and not self.should_stop:
                    if state.epoch_done():
                        break
                    if guard.skip_bad_batch():  # a batch that a rollback ruled out
                        batches = TimedBatches(iter(self.train_loader), timer)
                        continue
                    self.monitor.step_begins(state.global_step + 1)
                    self._call("on_train_step_start")
                    guard.step_begins()
                    loss, tokens, outcome = self.train_step(batches)
                    guard.step_ends(outcome)
                    if outcome == "rollback":
                        guard.rollback()
                        self.monitor.event("rollback", "non-finite loss or gradients: rolled "
                                           "back", state.global_step)
                        batches = TimedBatches(iter(self.train_loader), timer)
                        state.window.reset()
                        continue
                    state.advance()
                    self.engine.after_optimizer_step(state.global_step)  # local SGD averages
                    if memory is not None and memory.row is not None:
                        self.run_log.memory(memory)
                        memory = None
                    state.window.add(loss, tokens, counted=outcome == "ok")
                    end_step(self, total)  # logs, callbacks (loop/step_end.py)
                    if self._val_data is not None and self.val_every_n_steps and (
                            state.global_step % self.val_every_n_steps == 0
                    ) and state.global_step < total:
                        with timer.paused(), state.window.paused():  # not a training step
                            self._run_validation()
                        validated_at = state.global_step
                    with timer.part("checkpoint"):
                        guard.after_step(total)
                    self.monitor.step_ends(state.global_step, gather=self._log_due(total))
                validated_at = end_epoch(self, total) or validated_at
            guard.settle()  # the last step's deferred NaN check (nan_policy="error" on a GPU)
            self.engine.end_of_training()  # one model on every rank again (local SGD)
            # not again when a validation just stopped training early (same weights)
            if self._val_data is not None and validated_at != state.global_step:
                self._run_validation()
            self.checkpoints.wait()
            if self.save_final_checkpoint or self.stop_reason in RESUMABLE_STOPS:
                self.save_checkpoint(self.run_dir / "checkpoints" / "final")
            self._call("on_fit_end")
        finally:
            guard.stop()
            self.run_log.stop_progress()
            if memory is not None:  # fit ended before the first step: take the hooks off
                memory.remove()
        self.run_log.plot(title=self.name)

    def total_steps(self) -> int:
        per_epoch = self.state.sampler.num_global_batches
        by_epochs = self.max_epochs * per_epoch if self.max_epochs else float("inf")
        return int(min(self.max_steps or float("inf"), by_epochs))

    def _log_due(self, total: int) -> bool:
        return self.global_step % self.log_every_n_steps == 0 or self.global_step == total

    def train_step(self, batches) -> tuple[torch.Tensor, int, str]:
        """One optimizer step over this rank's micro-batches (drawn from ``batches``).

        Returns (loss here, tokens seen here, outcome): outcome "ok", "skip" (update dropped)
        or "rollback" (nothing changed yet; the caller restores the last checkpoint)."""
        timer = self.monitor.timer  # where the time goes (meshtrain/observe/step_timer.py)
        if self.engine.manual:  # the module steps its optimizers itself, inside its step
            with timer.part("checkpoint"):
                self.checkpoints.before_update()
        with timer.part("compute"):
            loss, tokens = self.engine.forward_backward(batches)
        if self.engine.manual:  # "error" or "rollback" (the updates are made: no "skip")
            return loss, tokens, self._guard.decide(loss)
        with timer.part("comm"):
            self.engine.sync_gradients()
            outcome = self._guard.decide(loss)
        if outcome != "ok":
            self.optimizer.zero_grad(set_to_none=True)
            self.precision.skip_step()
            self.monitor.event("skip", "non-finite loss or gradients: update skipped",
                               self.global_step + 1)
            return loss, tokens, outcome
        with timer.part("optimizer"):
            measure = self.grad_clip_norm is not None or self.log_grad_norm
            if measure:
                self.precision.unscale(self.optimizer)
            self._call("on_before_optimizer_step")
            self.grad_norm = self.engine.clip_grad_norm(self.grad_clip_norm) if measure else None
            with timer.part("checkpoint"):
                self.checkpoints.before_update()  # a background save's copy of the state
            self.precision.step(self.optimizer)
            self.optimizer.zero_grad(set_to_none=True)
            if self.lr_scheduler is not None and self.lr_schedule.interval == "step":
                self.lr_scheduler.step()
        return loss, tokens, "ok"

    # -- validation and test ----------------------------------------------------------------------
    def _run_validation(self) -> dict[str, float]:
        from meshtrain.loop.evaluation import run_validation

        return run_validation(self)

    def validate(self, val_data: DataLike | None = None, dataloaders=None, *, datamodule=None,
                 ckpt_path=None, **lightning) -> dict[str, float]:
        """Loss and metrics over ``val_data`` (default: the datamodule's or model's
        ``val_dataloader()``, else the fit's validation data), logged at the current step."""
        data = eval_data(self, val_data, datamodule, "validate", dataloaders, ckpt_path, lightning)
        return evaluate_and_log(self, data if data is not None else self._val_data, "val")

    def test(self, test_data: DataLike | None = None, dataloaders=None, *, datamodule=None,
             ckpt_path=None, **lightning) -> dict[str, float]:
        """Loss and metrics over all of ``test_data`` (or of a ``test_dataloader()``)."""
        data = eval_data(self, test_data, datamodule, "test", dataloaders, ckpt_path, lightning)
        return evaluate_and_log(self, needed(data, "test"), "test")

    def predict(self, data: DataLike | None = None, dataloaders=None, *, datamodule=None,
                ckpt_path=None, **lightning):
        """The model's outputs for every sample of ``data`` (or of a ``predict_dataloader()``),
        in its order, on global rank 0 (None on the others): meshtrain/loop/prediction.py."""
        data = eval_data(self, data, datamodule, "predict", dataloaders, ckpt_path, lightning)
        outputs = predict_all(self, needed(data, "predict"))
        return None if lightning.get("return_predictions") is False else outputs

    # -- checkpoints, logging, callbacks ----------------------------------------------------------
    def checkpoint_state(self) -> tuple[dict, dict]:
        """(trainer state, summary) as a checkpoint stores them beside model and optimizer."""
        from meshtrain.checkpoint.resume import trainer_state

        return trainer_state(self)

    def save_checkpoint(self, path: str | os.PathLike) -> Path | None:
        """Save model, optimizer and training position (collective: call on every rank).

        Returns the folder, or None when some rank holds NaN/Inf values: such a checkpoint is
        never written."""
        return self.checkpoints.save_to(path, self.global_step, self.model, self.optimizer,
                                        *self.checkpoint_state())

    def load_checkpoint(self, path: str | os.PathLike) -> None:
        """Restore a checkpoint saved by :meth:`save_checkpoint` into the fitted model.

        Works across layouts and world sizes: model and optimizer are resharded by DCP, and the
        data continues at the same sample of the global order."""
        from meshtrain.checkpoint.resume import restore_trainer

        restore_trainer(self, path)

    def log(self, name: str, value, **options) -> None:
        """Log ``value`` from a step or callback, reduced over the data-parallel ranks and the
        logging interval (or evaluation, or epoch); ``options``: ``reduce``, ``prog_bar``,
        ``on_step``, ``on_epoch`` and Lightning's (meshtrain/module/log_buffer.py ``log``)."""
        self._logs.log(name, value, **options)

    def log_metrics(self, metrics: dict[str, float]) -> None:
        """Send metrics to the loggers (rank zero); values must already agree across ranks."""
        self.run_log.log(self._logs.for_loggers(metrics), self.global_step)

    def _call(self, hook: str, *args) -> None:
        for callback in self.callbacks:
            getattr(callback, hook)(self, *args)
        after_callbacks(self, hook)  # the module's own (Lightning's names)
