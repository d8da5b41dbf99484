"""What the loop calls around each optimizer step to survive faults.

:class:`StepGuard`:

* before the update, :meth:`~StepGuard.decide` checks for NaN/Inf and carries the checkpoint
  flags in one small all-reduce, so every rank takes the same decision ("ok", "skip" or
  "rollback", by ``nan_policy``);
* after the step, :meth:`~StepGuard.after_step` commits a finished asynchronous checkpoint and
  starts the next periodic one when it is due (by steps, or by rank 0's clock);
* :meth:`~StepGuard.rollback` restores the last checkpoint and remembers the batch to skip;
* the stall watchdog is armed for every step but the first, after which the collective timeout
  drops from ``init_timeout_s`` to ``collective_timeout_s``;
* with ``sdc_check_every_n_steps``, :meth:`~StepGuard.decide` first replays a micro-batch and
  compares its gradients (``sdc.py``); a mismatch is one more flag of the exchange;
* faults armed by name (``inject.py``, ``MESHTRAIN_FAULT``) fire at their points; a failure
  that ends the loop is recorded, so that a restart repeating it stops (``restarts.py``);
* with ``stop_on_signal``, a signal handler marks the request; a one-int all-reduce on a gloo
  group of its own, started each step and read at the next, tells every rank (no wait for the
  device), and all stop after the same step (the loop then saves a resumable checkpoint).

It sees the loop only through :class:`Loop` and its settings through :class:`FaultOptions`.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import threading
import time
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Protocol

import torch
import torch.distributed as dist

MAX_ROLLBACKS = 10  # nan_policy="rollback" gives up after this many in one fit


class Loop(Protocol):
    """What the guard needs of the training loop (the Trainer is one)."""

    state: object  # meshtrain.loop.state.LoopState: step, epoch, data position, counters
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer

    should_stop: bool
    stop_reason: str | None  # "signal" when stop_on_signal stopped it

    def checkpoint_state(self) -> tuple[dict, dict]: ...  # (trainer state, summary)
    def load_checkpoint(self, path) -> None: ...
    def print(self, message: str) -> None: ...  # rank zero only


@dataclasses.dataclass(frozen=True)
class FaultOptions:
    """The settings the guard acts on (``fault`` and ``checkpoint`` sections; defaults and
    docs in :mod:`meshtrain.settings`)."""

    nan_policy: str | None
    collective_timeout_s: float
    init_timeout_s: float
    stall_timeout_s: float | None
    mtbf_hours: float
    checkpoint_every_n_minutes: float | None
    save_final_checkpoint: bool
    stop_on_signal: str | None
    sdc_check_every_n_steps: int | None = None

    @classmethod
    def from_settings(cls, settings) -> FaultOptions:
        """From a dict of settings, or an object that has them as attributes (a Trainer, whose
        attributes a caller such as lr_find may have changed)."""
        if isinstance(settings, dict):
            return cls(**{f.name: settings[f.name] for f in dataclasses.fields(cls)})
        return cls(**{f.name: getattr(settings, f.name) for f in dataclasses.fields(cls)})


def set_collective_timeout(timeout: timedelta, skip=None) -> None:
    """On every process group but ``skip`` (the group of background checkpoint writes)."""
    from meshtrain.fault.desync import set_collective_timeout as set_on

    groups = [g for g in dist.distributed_c10d._world.pg_map if g is not skip]
    with warnings.catch_warnings():  # under debug_collectives: a note on torch's wrapper
        warnings.simplefilter("ignore")
        set_on(timeout.total_seconds(), groups)


class StepGuard:
    """Checkpoints, NaN/Inf decisions, rollback, watchdog and timeouts for one fit.

    ``checkpoints``: the run's checkpoint writer (:class:`~meshtrain.checkpoint.manager.
    CheckpointManager`); ``gradients_identical``: the layout leaves every rank the same full
    gradients after the sync (then, without fp16's scaler, a local NaN check is everyone's
    answer); ``grad_scaler``: fp16's scaler skips inf-gradient steps itself.
    """

    def __init__(self, loop: Loop, options: FaultOptions, checkpoints, *, run_dir: Path,
                 rank: int, world_size: int, device: torch.device,
                 gradients_identical: bool, grad_scaler: bool):
        from meshtrain.fault.nonfinite import StepFlags

        self.loop, self.options, self.checkpoints = loop, options, checkpoints
        self.gradients_identical = gradients_identical and not grad_scaler
        self.grad_scaler = grad_scaler
        # on a GPU, nan_policy="error" reads a step's flag during the next step (the device
        # is not drained every step); a checkpoint or the end of fit reads it at once
        self.defer = device.type == "cuda"
        self.pending: tuple[torch.Tensor, str] | None = None  # (flag, "step N (epoch E)")
        if rank == 0:
            checkpoints.cleanup_partial()
        from meshtrain.fault import inject

        inject.load()  # MESHTRAIN_FAULT (a malformed one is refused here)
        inject.set_rank(rank)
        self.rank = rank
        self.sdc = None  # the GradientReplay of sdc_check_every_n_steps (sdc.py)
        if options.sdc_check_every_n_steps:
            from meshtrain.fault.sdc import GradientReplay

            self.sdc = GradientReplay(loop.engine, options.sdc_check_every_n_steps)
        self.current_step = 0  # the step under way (its checkpoint's too)
        self.flags = StepFlags(rank, world_size, device)
        self.watchdog = None
        if options.stall_timeout_s is not None:
            from meshtrain.fault.watchdog import StallWatchdog

            self.watchdog = StallWatchdog(options.stall_timeout_s, Path(run_dir) / "stacks", rank,
                                          world_size)
        self.time_due = self.write_pending = False
        self.bad_batches: set[tuple[int, int]] = set()  # (epoch, consumed_samples) to skip
        self.steps_here = 0  # optimizer steps run by this process (a resumed run starts at 0)
        self.save_cost_reported = False
        self.stop_signal = stop_signal(options.stop_on_signal, world_size)
        self.signalled = False  # set by the handler: this rank got the stop signal
        self._previous_handler = None
        self._signal_group = None  # gloo group of the stop flag's all-reduce (several ranks)
        self._stop_exchange: tuple | None = None  # (work, flag) started by the last step

    # -- around each step ---------------------------------------------------------------------
    def start(self) -> None:
        from meshtrain.fault.inject import ARMED, fault_point

        if "optimizer_step" in ARMED and self.loop.optimizer is not None:
            self.loop.optimizer.register_step_pre_hook(
                lambda *_: fault_point("optimizer_step"))
        if self.watchdog is not None:
            self.watchdog.start()
        if self.stop_signal is not None and threading.current_thread() is threading.main_thread():
            self._previous_handler = signal.signal(self.stop_signal, self._on_signal)
        if self.stop_signal is not None and self.flags.world_size > 1:
            self._signal_group = dist.new_group(backend="gloo")  # collective: every rank

    def _on_signal(self, signum, frame) -> None:
        self.signalled = True

    def step_begins(self) -> None:
        from meshtrain.fault import inject

        step = self.current_step = self.loop.state.global_step + 1
        if self.watchdog is not None and self.steps_here > 0:  # not the slow first step
            self.watchdog.arm(step)
        if self.sdc is not None:
            self.sdc.begin_step(step)
        if inject.ARMED:
            inject.set_step(step)
            inject.fault_point("step_start")
            if inject.armed("gradient_allreduce", corrupting=True):
                inject.corrupt_first_gradient(self.loop.model)

    def step_ends(self, outcome: str) -> None:
        if self.watchdog is not None:
            self.watchdog.disarm()
        if outcome == "rollback":
            return
        self.steps_here += 1
        options = self.options
        if self.steps_here == 1 and dist.is_initialized() and (
                options.collective_timeout_s != options.init_timeout_s):
            # past start-up: a collective that waits longer than this means a hang
            set_collective_timeout(timedelta(seconds=options.collective_timeout_s),
                                   skip=self.checkpoints.process_group)

    def stop(self) -> None:
        import sys

        error = sys.exc_info()[1]  # (in the loop's finally: what ends it, if anything)
        if error is not None and not isinstance(error, KeyboardInterrupt):
            from meshtrain.fault.restarts import record_failure

            record_failure(error, self.current_step, self.rank)
        if self.watchdog is not None:
            self.watchdog.stop()
        if self._stop_exchange is not None:  # the last step's, not to be left in flight
            self._stop_exchange[0].wait()
            self._stop_exchange = None
        if self._previous_handler is not None:
            signal.signal(self.stop_signal, self._previous_handler)
            self._previous_handler = None

    # -- NaN/Inf --------------------------------------------------------------------------------
    def decide(self, loss: torch.Tensor) -> str:
        """"ok", "skip" or "rollback" for this step, the same on every rank."""
        from meshtrain.fault.nonfinite import describe, nonfinite_flag

        policy, manager, state = self.options.nan_policy, self.checkpoints, self.loop.state
        what = f"step {state.global_step + 1} (epoch {state.current_epoch})"
        if self.stop_signal is not None:
            self._exchange_stop(what)
        replayed = self.sdc is not None and self.sdc.captured  # (the same step on every rank)
        need_flags = bool(self.options.checkpoint_every_n_minutes or manager.in_flight
                          or replayed)
        self.settle()
        if not (policy or need_flags):
            return "ok"
        flag = None
        if policy is not None:
            # under fp16 the grad scaler itself skips steps with inf gradients: check the loss
            flag = nonfinite_flag(loss, self.loop.model.parameters(),
                                  check_grads=not self.grad_scaler)
            if replayed:
                self.sdc_mismatch = self.sdc.verify()
                flag = flag + 4 * int(self.sdc_mismatch is not None)
            if not need_flags and self.gradients_identical:
                # every rank holds the same averaged gradients, so this local check is already
                # everyone's answer: no all-reduce (a NaN found here is exchanged, by all)
                if policy == "error" and self.defer:
                    self.pending = (flag, what)
                    return "ok"
                if not flag.item() & 2:
                    return "ok"
        bad_ranks, self.time_due, self.write_pending = self.flags.exchange(
            flag, manager.due_by_time(), not manager.poll())
        if not bad_ranks:
            return "ok"
        if policy == "error":
            _raise_nonfinite(what, bad_ranks, self._sdc_note(bad_ranks))
        if policy == "skip":
            state.num_skipped_steps += 1
            self.loop.print(f"{what}: {describe(bad_ranks)}; update skipped on every rank "
                            "(nan_policy='skip')")
            return "skip"
        self.rollback_reason = describe(bad_ranks)
        return "rollback"

    sdc_mismatch: str | None = None  # the parameter this rank's last replay found different
    rollback_reason = "non-finite loss or gradients"

    def _sdc_note(self, bad_ranks: dict[int, int]) -> str:
        """What this rank's replay found, when it found something."""
        if not bad_ranks.get(self.rank, 0) & 4:
            return ""
        return (f"; on rank {self.rank} {self.sdc_mismatch}'s gradient differed first (a "
                "faulty device, or a non-deterministic kernel)")

    def _exchange_stop(self, what: str) -> None:
        """Alone: stop after this step if signalled. Several ranks: read the stop flags that
        the last step's all-reduce gathered (stop after this step if any rank was signalled),
        then start this step's. Every rank reads the same exchange at the same step."""
        if self._signal_group is None:
            if self.signalled:
                self._stop(what)
            return
        if self._stop_exchange is not None:
            work, flag = self._stop_exchange
            work.wait()
            if flag.item():
                self._stop(what)
        flag = torch.tensor([int(self.signalled)], dtype=torch.int32)
        work = dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._signal_group,
                               async_op=True)
        self._stop_exchange = (work, flag)

    def _stop(self, what: str) -> None:
        if not self.loop.should_stop:
            self.loop.should_stop, self.loop.stop_reason = True, "signal"
            self.loop.print(f"{what}: {self.stop_signal.name} received; stopping after this "
                            "step with a checkpoint (stop_on_signal; run again to continue)")

    def settle(self) -> None:
        """Read the flag that ``decide`` left pending (nan_policy="error" on a GPU): by now the
        device has usually finished that step, so this rarely waits."""
        if self.pending is None:
            return
        flag, what = self.pending
        self.pending = None
        if flag.item() & 2:  # identical gradients: every rank sees this alike and exchanges
            bad_ranks, _, _ = self.flags.exchange(flag, False, False)
            _raise_nonfinite(what, bad_ranks)

    def rollback(self) -> None:
        """nan_policy='rollback': restore the last checkpoint; the offending batch is skipped."""
        from meshtrain.checkpoint.manager import latest_complete
        from meshtrain.fault.nonfinite import NonFiniteError

        state = self.loop.state
        step, epoch = state.global_step + 1, state.current_epoch
        self.checkpoints.wait()
        path = latest_complete(self.checkpoints.directory)
        if path is None:
            raise NonFiniteError(
                f"step {step}: non-finite loss or gradients and nan_policy='rollback', but no "
                "checkpoint has been saved yet; checkpoint earlier (checkpoint_every_n_steps) "
                "or use nan_policy='skip'")
        state.num_rollbacks += 1
        if state.num_rollbacks > MAX_ROLLBACKS:
            raise NonFiniteError(
                f"step {step}: non-finite values again after {MAX_ROLLBACKS} rollbacks; the "
                "problem is not a few bad batches: lower the learning rate or clip gradients")
        self.bad_batches.add((epoch, state.sampler.consumed_samples))
        self.loop.load_checkpoint(path)
        self.loop.print(f"step {step}: {self.rollback_reason}; rolled back to {path} (step "
                        f"{self.loop.state.global_step}); the batch of step {step} will be "
                        "skipped")

    def skip_bad_batch(self) -> bool:
        """Pass over a batch that a rollback ruled out (it counts as a step, with no update)."""
        state = self.loop.state
        if (state.current_epoch, state.sampler.consumed_samples) not in self.bad_batches:
            return False
        state.advance()
        state.num_skipped_steps += 1
        return True

    # -- checkpoints ----------------------------------------------------------------------------
    def after_step(self, total: int) -> None:
        """Commit a finished background save; start the next periodic one when it is due."""
        manager, step = self.checkpoints, self.loop.state.global_step
        if manager.in_flight and not self.write_pending:  # written on every rank: commit
            manager.commit()
        due = manager.due_by_steps(step) or self.time_due
        self.time_due = False
        if not due or (step == total and self.options.save_final_checkpoint):
            return
        self.settle()  # no checkpoint of a step that is about to fail
        start = time.perf_counter()
        saved = manager.save(step, self.loop.model, self.loop.optimizer,
                             *self.loop.checkpoint_state())
        if saved and not self.save_cost_reported:
            self.save_cost_reported = True
            self._report_save_cost(step, time.perf_counter() - start)

    def _report_save_cost(self, step: int, blocked_s: float) -> None:
        """Young/Daly: the checkpoint interval that loses the least time is sqrt(2 C M)."""
        from meshtrain.checkpoint.manager import young_daly_interval_s

        mtbf_hours = self.options.mtbf_hours
        interval = young_daly_interval_s(blocked_s, mtbf_hours * 3600)
        self.loop.print(
            f"checkpoint at step {step} blocked training for {blocked_s:.2f} s. With a "
            f"failure every {mtbf_hours:g} h on average (mtbf_hours), the Young/Daly interval "
            f"sqrt(2 x save cost x MTBF) is {interval / 60:.1f} min; a failure loses the steps "
            "since the last checkpoint")


def stop_signal(setting: str | None, world_size: int) -> signal.Signals | None:
    """The signal ``stop_on_signal`` names; "auto": SIGUSR1 in one process (no collective
    needed) or under Slurm (``--signal`` / ``scancel --signal`` send it), else none."""
    if setting == "auto":
        setting = "SIGUSR1" if world_size == 1 or "SLURM_JOB_ID" in os.environ else None
    return None if setting is None else signal.Signals[setting]


def _raise_nonfinite(what: str, bad_ranks: dict[int, int], note: str = ""):
    from meshtrain.fault.nonfinite import NonFiniteError, SilentDataCorruption, describe

    if any(flag & 4 for flag in bad_ranks.values()):
        raise SilentDataCorruption(
            f"{what}: {describe(bad_ranks)}{note}. Take the rank's device out of service (or "
            "run it again to see whether it repeats), or set nan_policy='skip' or 'rollback'")
    raise NonFiniteError(
        f"{what}: {describe(bad_ranks)}. Lower the learning rate, clip gradients "
        "(grad_clip_norm=1.0), check the data of this step, or set nan_policy='skip' or "
        "'rollback'")
