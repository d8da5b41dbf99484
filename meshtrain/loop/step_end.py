"""What the Trainer's loop does at the end of a step and of an epoch: at each logging interval
the loss averaged over the ranks, throughput and MFU, the values logged with ``trainer.log``,
the time limit (``max_time_minutes``, by rank 0's clock); then the callbacks. At an epoch's
end: the values logged ``on_epoch``, the validation of ``val_every_n_epochs``, the
``checkpoint_every_n_epochs`` snapshot and an epoch-interval scheduler's step."""

from __future__ import annotations

import time

from meshtrain.module.configure import step_at_epoch_end
from meshtrain.module.hooks import at_epoch_end


def end_step(t, total: int) -> None:
    """Every ``log_every_n_steps``: average the window's loss over ranks and log it."""
    window, step, metrics = t.state.window, t.global_step, {}
    if t._log_due(total):
        elapsed = time.perf_counter() - window.start
        if window.num_steps:  # every rank skips alike, so this agrees
            metrics["train/loss"] = t.mesh.mean_loss(window.loss / window.num_steps)
        unit = t.engine.unit  # tokens for token ids, samples for other inputs
        metrics[f"train/{unit}_per_s"] = window.tokens * t.layout.batch_degree / elapsed
        items = window.tokens * t.layout.batch_degree
        metrics.update(t.monitor.interval_metrics(items / elapsed, unit, items, elapsed))
        metrics["epoch"] = t.current_epoch
        if t.max_time_minutes and t.monitor.time_up(t.max_time_minutes):
            t.should_stop, t.stop_reason = True, "max_time"
            t.print(f"step {step}: max_time_minutes={t.max_time_minutes:g} reached; "
                    "stopping with a checkpoint (run again to continue)")
        metrics.update(t._logs.take("window", t.mesh.loss_group(), t.device,
                                    t.mesh.stage_group()))
        metrics.update(getattr(t.engine, "moe_metrics", {}))  # an MoE model's last step
        counts = getattr(getattr(t.engine, "router_loss", None), "last_counts", None)
        if counts is not None and t.is_global_zero and t.run_dir is not None:
            from meshtrain.observe import run_files

            run_files.append_expert_load(t.run_dir, step, counts.tolist())
        if t.log_grad_norm and t.grad_norm is not None:
            metrics["train/grad_norm"] = float(t.grad_norm)
        if t.num_skipped_steps:
            metrics["train/skipped_steps"] = t.num_skipped_steps
        window.reset()
    t._call("on_train_step_end", metrics)
    if metrics:
        t.callback_metrics.update(metrics)
        t.log_metrics(metrics)
        t.run_log.progress(step, metrics, t._logs.prog_bar)


def end_epoch(t, total: int) -> int | None:
    """At a whole epoch's end the validation ``val_every_n_epochs`` asks for (at the last step
    too, in Lightning's order, unless the ranks' models are averaged when the loop ends:
    fit's own validation comes then) and the module's ``on_train_epoch_end``; then the values
    logged ``on_epoch`` go out (every rank takes part), the snapshot, the callbacks' hook and
    an epoch scheduler's step (Lightning's order). Returns the step validated at, if it did."""
    whole, validated = t.state.epoch_done(), None
    by_steps = t.val_every_n_steps and t.global_step % t.val_every_n_steps == 0  # just done
    if whole and t._val_data is not None and t.val_every_n_epochs and not by_steps and \
            (t.current_epoch + 1) % t.val_every_n_epochs == 0 and \
            (t.global_step < total or t.engine.averager is None):
        with t.monitor.timer.paused(), t.state.window.paused():  # not a training step
            t._run_validation()
        validated = t.global_step
    at_epoch_end(t)
    if epoch := t._logs.take("epoch", t.mesh.loss_group(), t.device, t.mesh.stage_group()):
        t.callback_metrics.update(epoch)
        t.log_metrics(epoch)
    t.engine.batch_idx = 0
    every = t.checkpoint_every_n_epochs
    if every and (t.current_epoch + 1) % every == 0:  # a snapshot (collective)
        t.checkpoints.save(t.global_step, t.model, t.optimizer, *t.checkpoint_state())
    t._call("on_train_epoch_end")
    if whole:
        step_at_epoch_end(t)
    return validated
