"""What the training loop drives: one object, the same calls for every layout.

Applying a layout (:func:`meshtrain.parallel.apply.apply_layout`) yields an :class:`Engine`. The
Trainer's loop calls, for each optimizer step::

    loss, tokens = engine.forward_backward(batches)   # every micro-batch of the step
    engine.sync_gradients()                           # what DDP/FSDP did not average
    norm = engine.clip_grad_norm(max_norm)            # global L2 norm over shards and stages
    optimizer.step()

and ``engine.eval_loss(batch)`` for validation, ``engine.mesh.mean_loss(x)`` for logging. This
class serves data, sharded, tensor and context parallel layouts, where the loop's micro-batches
accumulate gradients; :class:`~meshtrain.parallel.pipeline.engine.PipelineEngine` serves ``pp``,
where a schedule runs the micro-batches.
"""

from __future__ import annotations

import contextlib

import torch

from meshtrain.data.batch import (
    batch_size,
    count_tokens,
    plain,
    throughput_unit,
    to_device,
)
from meshtrain.fault.inject import fault_point
from meshtrain.module.core import has_steps, is_manual, step_loss
from meshtrain.moe.balance import (added_router_loss, end_of_step, recording, router_loss_of,
                                   routing_metrics)
from meshtrain.parallel.data.batch_gather import batch_group
from meshtrain.parallel.layout import Layout
from meshtrain.parallel.step_loss import StepItems, compute_loss, loss_counter


@contextlib.contextmanager
def gradient_sync(train_module: torch.nn.Module, model: torch.nn.Module, enabled: bool,
                  keep_gathered: bool = False):
    """Skip the gradient reduction for micro-steps that only accumulate (DDP or FSDP2); with
    ``keep_gathered`` (ZeRO-2, which holds the whole parameters from forward to backward
    anyway), FSDP2 also keeps them gathered for the next micro-batch instead of resharding and
    all-gathering them again."""
    from torch.distributed.fsdp import FSDPModule
    from torch.nn.parallel import DistributedDataParallel

    if enabled:
        yield
    elif isinstance(train_module, DistributedDataParallel):
        with train_module.no_sync():
            yield
    elif isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(False)
        if keep_gathered:
            model.set_reshard_after_backward(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)
            if keep_gathered:
                model.set_reshard_after_backward(True)
    else:
        yield


class Engine:
    """One rank's share of a training step under a layout without ``pp``.

    ``model`` is the user's module (its parameters and state_dict, sharded or not);
    ``train_module`` what to call for training (a DDP wrapper, or ``model`` itself)."""

    def __init__(self, model, train_module, mesh, *, device, precision, loss_fn, options,
                 grad_accum_steps: int):
        self.model, self.train_module, self.mesh = model, train_module, mesh
        self.layout: Layout = mesh.layout
        self.device, self.precision, self.loss_fn = device, precision, loss_fn
        self.options, self.grad_accum_steps = options, grad_accum_steps
        self.unit = "tokens"  # what forward_backward counts: "tokens" or "samples"
        self.cp = mesh.axis("cp")
        self.cp_support = None
        if self.cp is not None:
            from meshtrain.parallel.context.context_parallel import cp_support

            self.cp_support = cp_support(model, options.context_parallel)
        # a research module (meshtrain/module/): its training_step gives each micro-batch's
        # loss, called through DDP when DDP wraps it
        self.step_call = None
        if has_steps(model):
            self.step_call = train_module if train_module is not model else model.training_step
        self.batch_idx = 0  # this rank's micro-batches in the epoch (the Trainer resets it)
        self.manual = is_manual(model)  # the step drives its optimizers: see manual_backward
        # a global-mean loss: the step's items counted first (a module's steps then return sums)
        self.counter = (getattr(model, "count_loss_items", None) if self.step_call
                        else loss_counter(model, loss_fn, options.loss_items))
        # the routers' balancing: a model's own MoE layers, or the router loss a model's own
        # loss leaves to meshtrain (meshtrain.moe.balance)
        self.router_loss = router_loss_of(  # (a research module: of the MoE model it holds)
            model, None if self.step_call or loss_fn is not None else options.router_loss)
        self.model_kwargs = options.call_kwargs(model) if options.call_kwargs else {}
        # steps whose gradients are checked for a wrong tensor-parallel plan (tp_debug.py)
        self.tp_checks_left = options.tp_check_steps if self.layout.degree("tp") > 1 else 0
        if self.tp_checks_left:  # what split-input modules see, for the first steps' check
            from meshtrain.parallel.tensor.tp_debug import watch_split_inputs

            watch_split_inputs(model)
        self._steps_synced = 0
        # the ranks reading different samples: items are counted and gather_batch gathers here
        self.batch_pg = mesh.batch.get_group() if mesh.batch is not None else None

    @property
    def call_kwargs(self) -> dict | None:
        """More keyword arguments for the model's own loss (its router loss left to us; a
        Hugging Face model's use_cache=False: ParallelOptions.call_kwargs)."""
        routed = self.router_loss.call_kwargs if self.router_loss is not None else {}
        return {**self.model_kwargs, **routed}

    @property
    def loss_group(self):
        return self.mesh.loss.get_group() if self.mesh.loss is not None else None

    def global_items(self, count: torch.Tensor) -> StepItems:
        """The items of the whole step: ``count`` (this rank's) summed over the batch ranks, in
        the background while the first forward runs."""
        total = count.to(self.device, torch.int64).reshape(())
        work = None
        if self.batch_pg is not None:
            work = torch.distributed.all_reduce(total, group=self.batch_pg, async_op=True)
        return StepItems(total, work, self.layout.loss_degree)

    def parameters(self):
        return self.model.parameters()

    @contextlib.contextmanager
    def loss_context(self):
        """Where the forward, the loss and its backward run: under tp, with a plain message for
        a forward that mixes tensors and DTensors, and in ``loss_parallel()`` when the
        tensor-parallel head leaves the logits sharded over the vocabulary."""
        if self.layout.degree("tp") == 1:
            yield
            return
        from meshtrain.parallel.tensor.tensor_parallel import loss_parallel_context
        from meshtrain.parallel.tensor.tp_debug import mixed_tensor_hint

        with mixed_tensor_hint(), loss_parallel_context(self.options.loss_parallel):
            yield

    def shard(self, batch):
        """This rank's part of a batch: under ``cp`` its chunks of the sequence (dim 1)."""
        if self.cp is None:
            return batch
        from meshtrain.parallel.context.context_parallel import shard_batch

        return shard_batch(batch, self.cp, self.cp_support)

    def forward_backward(self, batches) -> tuple[torch.Tensor, int]:
        """Forward and backward over this rank's micro-batches of one step (gradients
        accumulate; synchronised on the last one). Returns (the step's loss here, tokens): a
        mean loss is divided by the micro-batches; a global-mean loss (meshtrain.losses) by the
        items of the whole step, counted first."""
        accum = self.grad_accum_steps
        total = torch.zeros((), dtype=torch.float64, device=self.device)  # float64 runs: exact
        micro = [to_device(next(batches), self.device) for _ in range(accum)]
        tokens = sum(count_tokens(batch) for batch in micro)
        self.unit = throughput_unit(micro[0])  # what tokens counts: the progress bar's unit
        if not self._checked_loss:
            self._check_loss(micro[0], accum)
        items = None
        if self.counter is not None:
            items = self.global_items(sum(self.counter(batch) for batch in micro))
        if self.replay is not None:  # sdc_check_every_n_steps (meshtrain/fault/sdc.py)
            self.replay.capture(micro[0], items, accum)
        for micro_step, batch in enumerate(micro):
            batch = self.shard(batch)
            last = micro_step == accum - 1
            with gradient_sync(self.train_module, self.model, enabled=last,
                               keep_gathered=self.layout.zero_stage == 2), self.loss_context():
                with self.precision.autocast(), batch_group(self.batch_pg):
                    if self.step_call is not None:
                        with recording(self.router_loss):
                            out = self.step_call(batch, self.batch_idx)
                        self.batch_idx += 1
                        if self.manual:  # its backward passes and updates are done
                            loss = step_loss(out, "a manual training_step")
                            total += 0 if loss is None else plain(loss.detach())
                            continue
                        loss = step_loss(out, "training_step")
                    else:
                        with recording(self.router_loss):
                            loss = compute_loss(self.train_module, batch, self.loss_fn,
                                                items is not None, call_kwargs=self.call_kwargs)
                    loss = loss / accum if items is None else loss / items.divisor()
                    if self.router_loss is not None and self.router_loss.coef:
                        loss = added_router_loss(self.router_loss, batch, self.loss_group,
                                                 self.layout.loss_degree, accum, loss)
                if last and self.timer is not None:  # the wait for reductions: exposed comm
                    self.timer.watch_backward(loss)
                if last:
                    fault_point("gradient_allreduce")  # MESHTRAIN_FAULT (fault/inject.py)
                self.precision.backward(loss)
                if last and self.timer is not None:
                    self.timer.backward_returned()
            total += plain(loss.detach())
        return total, tokens

    _checked_loss = False

    def _check_loss(self, batch, num_micro_batches: int) -> None:
        """Once: warn (rank 0) when a plain mean loss meets ignored targets (meshtrain.losses)."""
        import warnings

        from meshtrain.losses import plain_mean_warning

        self._checked_loss = True
        targets = batch[1] if isinstance(batch, (tuple, list)) and len(batch) == 2 else None
        message = plain_mean_warning(self.loss_fn, targets,
                                     num_micro_batches * self.layout.loss_degree)
        dist = torch.distributed
        if message and (not dist.is_initialized() or dist.get_rank() == 0):
            warnings.warn(message, stacklevel=2)

    def manual_backward(self, loss: torch.Tensor) -> None:
        """A manual module's backward: the gradients so far averaged over the loss ranks (the
        sum of what earlier passes averaged and this pass adds stays an average: averaging
        is linear and the earlier part is the same everywhere). Autocast is off inside, as
        around an automatic step's backward (the step runs under it)."""
        with torch.autocast(self.device.type, enabled=False):
            self.precision.backward(loss)
        if self.layout.uses_ddp:
            from meshtrain.parallel.data.data_parallel import allreduce_gradients

            allreduce_gradients(self.parameters(), self.mesh.loss.get_group())

    timer = None  # the Trainer's StepTimer (meshtrain/observe/step_timer.py), when measuring
    replay = None  # sdc_check_every_n_steps' GradientReplay (meshtrain/fault/sdc.py)

    # local SGD (local_sgd.py): parameters averaged after some steps instead; under ps the
    # ServerOptimizer (ps/layout.py), which leaves the servers when training ends
    averager = None

    @property
    def gradients_identical(self) -> bool:
        """Does every rank hold the same gradients after ``sync_gradients``?"""
        return self.averager is None and self.layout.gradients_identical_after_sync

    def after_optimizer_step(self, step: int) -> None:
        """After optimizer step ``step`` (1-based, skipped steps too): local SGD's parameter
        average, when one is due."""
        if self.averager is not None:
            self.averager.after_step(step)
        if self.router_loss is not None:  # the step's routing metrics; bias balancing
            end_of_step(self.router_loss, self.loss_group)

    @property
    def moe_metrics(self) -> dict[str, float]:
        """The last step's routing metrics (read when they are logged: host syncs)."""
        return routing_metrics(self.router_loss)

    def end_of_training(self) -> None:
        """When the loop ends (at max_steps or stopped early): local SGD averages the steps
        since its last average, so every rank ends with the same model."""
        if self.averager is not None:
            self.averager.finish()

    def sync_gradients(self) -> None:
        """Average the gradients that no wrapper averaged (see ``averages_gradients_by_hand``);
        in the first ``tp_check_steps`` steps, check that the tensor-parallel plan left every
        replicated parameter the same gradient on each tp rank (tp_debug.py). Partial
        tensor-parallel gradients (norms under sequence parallel) are summed first, all at once."""
        if self.layout.degree("tp") > 1:
            from meshtrain.parallel.tensor.tensor_parallel import complete_partial_grads

            complete_partial_grads(self.parameters())
        if self.layout.averages_gradients_by_hand:
            from meshtrain.parallel.data.data_parallel import allreduce_gradients
            from meshtrain.parallel.expert import expert_params

            split = {id(p) for p in expert_params(self.model)}  # (ep's: each rank its own)
            allreduce_gradients([p for p in self.parameters() if id(p) not in split],
                                self.mesh.loss.get_group())
        if self.layout.expert_degree > 1:
            from meshtrain.parallel.expert import sync_expert_grads

            sync_expert_grads(self.model, self.mesh)
        self._steps_synced += 1
        if self.tp_checks_left > 0:
            from meshtrain.parallel.tensor.tp_debug import check_replicated_grads, check_split_inputs

            self.tp_checks_left -= 1
            group = self.mesh.axis("tp").get_group()
            check_split_inputs(self.model, group, step=self._steps_synced,
                               last=self.tp_checks_left == 0)
            check_replicated_grads(self.model, group, step=self._steps_synced)

    def clip_grad_norm(self, max_norm: float | None, params=None) -> torch.Tensor:
        """The gradients' global L2 norm before clipping (over every shard and stage, the same
        on every rank); clips them to ``max_norm`` unless it is None. ``params``: only these
        (one optimizer's, under manual optimisation)."""
        params = list(self.parameters() if params is None else params)
        if self.layout.expert_degree > 1:  # the experts' squares summed over the ep group
            from meshtrain.parallel.expert import clip_grad_norm

            return plain(clip_grad_norm(self.model, params, max_norm, self.mesh)).detach()
        if max_norm is not None:
            norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        else:
            norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
        return plain(norm).detach()

    eval_step = "validation_step"  # what a research module evaluates with (or "test_step")
    eval_idx = 0  # its batch_idx: the batches of this evaluation so far
    @torch.no_grad()
    def evaluate(self, batches, metrics=()) -> dict[str, float]:
        """``{"loss": ..., <metric>: ...}`` over ``batches`` (this rank's of an evaluation),
        summed over the stages and loss ranks so every sample of every rank counts once. The
        loss is weighted by samples for a mean loss, by items for a global-mean loss;
        ``metrics``: names or meshtrain.metrics.Metric objects, reduced the same way."""
        from meshtrain.metrics import resolve

        metrics = resolve(metrics)
        was_training = self.model.training
        self.model.eval()
        self.eval_idx = 0
        sizes = [m.num_sums for m in metrics]
        # loss sum, weight, then every metric's sums: one all-reduce for all of them
        totals = torch.zeros(2 + sum(sizes), dtype=torch.float64, device=self.device)
        sums = list(totals[2:].split(sizes)) if metrics else []
        for batch in batches:
            batch = to_device(batch, self.device)
            loss = self.eval_loss(batch, with_output=bool(metrics))
            if loss is None:  # a pipeline rank without the last stage
                continue
            if self.counter is None:
                weight = batch_size(batch)
                totals[0] += loss.double() * weight
            else:  # the loss is this rank's sum (of its cp shard): its items counted once
                weight = self.counter(batch).double() / self.layout.degree("cp")
                totals[0] += loss.double()
            totals[1] += weight
            for metric, part in zip(metrics, sums):
                metric.update(part, *self.eval_seen)
        self.model.train(was_training)
        self.mesh.sum_over_loss_ranks(totals)
        if self.step_call is not None and not totals[1]:  # steps that only log
            return {}
        loss = float(totals[0] / totals[1].clamp(min=1))
        return {"loss": loss, **{m.name: m.compute(part, loss) for m, part in zip(metrics, sums)}}

    @torch.no_grad()
    def eval_loss(self, batch, with_output: bool = False) -> torch.Tensor | None:
        """The loss of one batch: its mean, or for a global-mean loss its sum (None on ranks
        that do not compute it). ``with_output``: (output, batch as the model saw it) kept in
        ``eval_seen`` for metrics."""
        batch = self.shard(batch)
        if self.step_call is not None:  # its validation_step / test_step (None: logs only)
            with self.precision.autocast(), self.loss_context(), batch_group(self.batch_pg):
                loss = step_loss(getattr(self.model, self.eval_step)(batch, self.eval_idx),
                                 self.eval_step)
            self.eval_idx += 1
            self.eval_seen = None
            return plain(loss) if loss is not None else None
        with self.precision.autocast(), self.loss_context(), batch_group(self.batch_pg):
            loss, output = compute_loss(self.model, batch, self.loss_fn,
                                        self.counter is not None, with_output=True,
                                        call_kwargs=self.call_kwargs)
        self.eval_seen = (output, batch) if with_output else None
        return plain(loss)


    @torch.no_grad()
    def predict_batch(self, batch, batch_idx: int):
        """The model's outputs for one batch: its ``predict_step(batch, batch_idx)``, else
        ``model(inputs)`` (None on a rank that holds no outputs: a pipeline's early stages)."""
        predict_step = getattr(self.model, "predict_step", None)
        batch = self.shard(batch)  # under cp: this rank's chunks of each sequence
        with self.precision.autocast(), batch_group(self.batch_pg):
            if callable(predict_step):
                out = predict_step(batch, batch_idx)
            else:
                out = self.model(prediction_inputs(batch))
        if self.cp is not None:  # every output of 2+ dims is per token: the whole sequence
            from meshtrain.parallel.context.context_parallel import gather_sequence

            out = gather_sequence(out, self.cp, _sequence_length(batch))
        return out


def _sequence_length(batch) -> int:
    """This rank's tokens per sequence: dim 1 of the batch's first tensor of 2+ dimensions
    (what :func:`~meshtrain.parallel.context.context_parallel.shard_batch` cuts); -1 if none."""
    values = batch.values() if isinstance(batch, dict) else (
        batch if isinstance(batch, (tuple, list)) else [batch])
    for value in values:
        if isinstance(value, torch.Tensor) and value.dim() >= 2:
            return value.size(1)
    return -1


def prediction_inputs(batch):
    """What the model is called with to predict: the first element of an ``(inputs, targets)``
    pair (or of an ``(inputs,)`` sample of a one-tensor TensorDataset), else the batch."""
    return batch[0] if isinstance(batch, (tuple, list)) and len(batch) in (1, 2) else batch
