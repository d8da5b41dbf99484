"""Fault tolerance inside the training loop (see docs/fault_tolerance.md).

:class:`StepGuard` is what the Trainer's loop calls around each optimizer step:

* before the update, :meth:`~StepGuard.decide` checks for NaN/Inf and carries the checkpoint
  flags in one small all-reduce, so every rank takes the same decision ("ok", "skip" or
  "rollback", by ``nan_policy``);
* after the step, :meth:`~StepGuard.after_step` commits a finished asynchronous checkpoint and
  starts the next periodic one when it is due (by steps, or by rank 0's clock);
* :meth:`~StepGuard.rollback` restores the last checkpoint and remembers the batch to skip;
* the stall watchdog is armed for every step but the first, after which the collective timeout
  drops from ``init_timeout_s`` to ``collective_timeout_s``.
"""

from __future__ import annotations

import time
import warnings
from datetime import timedelta

import torch
import torch.distributed as dist

from meshtrain.errors import ConfigError

MAX_ROLLBACKS = 10  # nan_policy="rollback" gives up after this many in one fit


def _positive_number(name: str, value, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not (isinstance(value, (int, float)) and value > 0):
        raise ConfigError(f"{name} must be a positive number{' or None' * allow_none}, "
                          f"got {value!r}")


def check_settings(settings: dict) -> None:
    """The Trainer's fault-tolerance settings, checked together before any process starts."""
    s = settings
    collective_timeout_s, init_timeout_s = s["collective_timeout_s"], s["init_timeout_s"]
    stall_timeout_s, nan_policy, mtbf_hours = s["stall_timeout_s"], s["nan_policy"], s["mtbf_hours"]
    checkpoint_every_n_steps = s["checkpoint_every_n_steps"]
    checkpoint_every_n_minutes = s["checkpoint_every_n_minutes"]
    keep_last_k, async_checkpoint, resume = s["keep_last_k"], s["async_checkpoint"], s["resume"]
    from meshtrain.checkpoint.manager import check_options
    from meshtrain.checkpoint.resume import check_resume
    from meshtrain.observe.nonfinite import check_nan_policy

    _positive_number("collective_timeout_s", collective_timeout_s)
    _positive_number("init_timeout_s", init_timeout_s)
    _positive_number("mtbf_hours", mtbf_hours)
    _positive_number("stall_timeout_s", stall_timeout_s, allow_none=True)
    if stall_timeout_s is not None and stall_timeout_s >= collective_timeout_s:
        raise ConfigError(
            f"stall_timeout_s={stall_timeout_s} must be below collective_timeout_s="
            f"{collective_timeout_s}: otherwise the ranks waiting for a stalled one time out "
            "and exit before the watchdog can write their stacks")
    try:
        check_options(every_n_steps=checkpoint_every_n_steps, keep_last_k=keep_last_k,
                      every_n_minutes=checkpoint_every_n_minutes, async_save=async_checkpoint)
    except ConfigError as error:  # name the Trainer's arguments, not the manager's
        raise ConfigError(str(error).replace("every_n", "checkpoint_every_n")
                          .replace("async_save", "async_checkpoint")) from None
    check_resume(resume)
    check_nan_policy(nan_policy)
    if nan_policy == "rollback" and not (checkpoint_every_n_steps or checkpoint_every_n_minutes):
        raise ConfigError(
            "nan_policy='rollback' restores the last checkpoint, so it needs periodic "
            "checkpoints: set checkpoint_every_n_steps (or checkpoint_every_n_minutes)")


def set_collective_timeout(timeout: timedelta, skip=None) -> None:
    """On every process group but ``skip`` (the group of background checkpoint writes)."""
    from meshtrain.observe.desync import set_collective_timeout as set_on

    groups = [g for g in dist.distributed_c10d._world.pg_map if g is not skip]
    with warnings.catch_warnings():  # under debug_collectives: a note on torch's wrapper
        warnings.simplefilter("ignore")
        set_on(timeout.total_seconds(), groups)


class StepGuard:
    """Checkpoints, NaN/Inf decisions, rollback, watchdog and timeouts for one fit."""

    def __init__(self, trainer):
        from meshtrain.checkpoint.manager import CheckpointManager
        from meshtrain.observe.nonfinite import StepFlags

        self.trainer = t = trainer
        group = None
        if t.async_checkpoint and dist.is_initialized():
            # DCP's own collectives of a background write go over a group of their own, so
            # they never interleave with the training step's collectives.
            group = dist.new_group(backend="gloo")
        self.checkpoints = CheckpointManager(
            t.run_dir / "checkpoints", process_group=group, every_n_steps=t.checkpoint_every_n_steps,
            every_n_minutes=t.checkpoint_every_n_minutes, keep_last_k=t.keep_last_k,
            async_save=t.async_checkpoint)
        if t.is_global_zero:
            self.checkpoints.cleanup_partial()
        self.flags = StepFlags(t.rank, t.world_size, t.device)
        self.watchdog = None
        if t.stall_timeout_s is not None:
            from meshtrain.observe.watchdog import StallWatchdog

            self.watchdog = StallWatchdog(t.stall_timeout_s, t.run_dir / "stacks", t.rank,
                                          t.world_size)
        self.time_due = self.write_pending = False
        self.bad_batches: set[tuple[int, int]] = set()  # (epoch, consumed_samples) to skip
        self.steps_here = 0  # optimizer steps run by this process (a resumed run starts at 0)
        self.save_cost_reported = False

    # -- around each step ---------------------------------------------------------------------
    def start(self) -> None:
        if self.watchdog is not None:
            self.watchdog.start()

    def step_begins(self) -> None:
        if self.watchdog is not None and self.steps_here > 0:  # not the slow first step
            self.watchdog.arm(self.trainer.global_step + 1)

    def step_ends(self, outcome: str) -> None:
        if self.watchdog is not None:
            self.watchdog.disarm()
        if outcome == "rollback":
            return
        self.steps_here += 1
        if self.steps_here == 1 and dist.is_initialized():
            # past start-up: a collective that waits longer than this means a hang
            t = self.trainer
            if t.collective_timeout_s != t.init_timeout_s:
                set_collective_timeout(timedelta(seconds=t.collective_timeout_s),
                                       skip=self.checkpoints.process_group)

    def stop(self) -> None:
        if self.watchdog is not None:
            self.watchdog.stop()

    # -- NaN/Inf --------------------------------------------------------------------------------
    def decide(self, loss: torch.Tensor) -> str:
        """"ok", "skip" or "rollback" for this step, the same on every rank."""
        from meshtrain.observe.nonfinite import NonFiniteError, describe, nonfinite_flag

        t, manager = self.trainer, self.checkpoints
        need_flags = bool(t.checkpoint_every_n_minutes or manager.in_flight)
        if not (t.nan_policy or need_flags):
            return "ok"
        flag = None
        if t.nan_policy is not None:
            # under fp16 the grad scaler itself skips steps with inf gradients: check the loss
            flag = nonfinite_flag(loss, t.model.parameters(),
                                  check_grads=t.precision.scaler is None)
            if not need_flags and self._gradients_identical() and not flag.item() & 2:
                # every rank holds the same averaged gradients, so this local check is already
                # everyone's answer: no all-reduce (a NaN found here is exchanged below, by all)
                return "ok"
        bad_ranks, self.time_due, self.write_pending = self.flags.exchange(
            flag, manager.due_by_time(), not manager.poll())
        if not bad_ranks:
            return "ok"
        step = t.global_step + 1
        what = f"step {step} (epoch {t.current_epoch}): {describe(bad_ranks)}"
        if t.nan_policy == "error":
            raise NonFiniteError(
                f"{what}. Lower the learning rate, clip gradients (grad_clip_norm=1.0), check "
                "the data of this step, or set nan_policy='skip' or 'rollback'")
        if t.nan_policy == "skip":
            t.state.num_skipped_steps += 1
            t.print(f"{what}; update skipped on every rank (nan_policy='skip')")
            return "skip"
        return "rollback"

    def _gradients_identical(self) -> bool:
        """After the step's gradient sync, does every rank hold the same full gradients?
        (plain DDP and ZeRO-1, fp32/bf16; not sharded, tensor or pipeline parallel)"""
        t = self.trainer
        return t.precision.scaler is None and t.layout.gradients_identical_after_sync

    def rollback(self) -> None:
        """nan_policy='rollback': restore the last checkpoint; the offending batch is skipped."""
        from meshtrain.checkpoint.manager import latest_complete
        from meshtrain.observe.nonfinite import NonFiniteError

        t = self.trainer
        step, epoch = t.global_step + 1, t.current_epoch
        self.checkpoints.wait()
        path = latest_complete(self.checkpoints.directory)
        if path is None:
            raise NonFiniteError(
                f"step {step}: non-finite loss or gradients and nan_policy='rollback', but no "
                "checkpoint has been saved yet; checkpoint earlier (checkpoint_every_n_steps) "
                "or use nan_policy='skip'")
        t.state.num_rollbacks += 1
        if t.num_rollbacks > MAX_ROLLBACKS:
            raise NonFiniteError(
                f"step {step}: non-finite values again after {MAX_ROLLBACKS} rollbacks; the "
                "problem is not a few bad batches: lower the learning rate or clip gradients")
        self.bad_batches.add((epoch, t.state.sampler.consumed_samples))
        t.load_checkpoint(path)
        t.print(f"step {step}: non-finite loss or gradients; rolled back to {path} (step "
                f"{t.global_step}); the batch of step {step} will be skipped")

    def skip_bad_batch(self) -> bool:
        """Pass over a batch that a rollback ruled out (it counts as a step, with no update)."""
        state = self.trainer.state
        if (state.current_epoch, state.sampler.consumed_samples) not in self.bad_batches:
            return False
        state.advance()
        state.num_skipped_steps += 1
        return True

    # -- checkpoints ----------------------------------------------------------------------------
    def after_step(self, total: int) -> None:
        """Commit a finished background save; start the next periodic one when it is due."""
        t, manager = self.trainer, self.checkpoints
        if manager.in_flight and not self.write_pending:  # written on every rank: commit
            manager.commit()
        due = manager.due_by_steps(t.global_step) or self.time_due
        self.time_due = False
        if not due or (t.global_step == total and t.save_final_checkpoint):
            return
        start = time.perf_counter()
        saved = manager.save(t.global_step, t.model, t.optimizer, *t.checkpoint_state())
        if saved and not self.save_cost_reported:
            self.save_cost_reported = True
            self._report_save_cost(time.perf_counter() - start)

    def _report_save_cost(self, blocked_s: float) -> None:
        """Young/Daly: the checkpoint interval that loses the least time is sqrt(2 C M)."""
        from meshtrain.checkpoint.manager import young_daly_interval_s

        t = self.trainer
        interval = young_daly_interval_s(blocked_s, t.mtbf_hours * 3600)
        t.print(
            f"checkpoint at step {t.global_step} blocked training for {blocked_s:.2f} s. With a "
            f"failure every {t.mtbf_hours:g} h on average (mtbf_hours), the Young/Daly interval "
            f"sqrt(2 x save cost x MTBF) is {interval / 60:.1f} min; a failure loses the steps "
            "since the last checkpoint")
