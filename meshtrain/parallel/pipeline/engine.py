"""Pipeline parallelism behind the :class:`~meshtrain.parallel.engine.Engine` interface.

:func:`check_pipeline_layout` refuses what cannot run before any process starts;
:func:`apply_pipeline` splits the model into stages (balanced by parameters, measured time or
memory), keeps this rank's, applies the rest of the layout to each stage and returns a
:class:`PipelineEngine`, whose ``forward_backward`` hands the whole step's batch to the schedule
(:class:`~meshtrain.parallel.pipeline.PipelineRunner`), which runs the micro-batches. On the
third to fifth steps (after two warm-up steps, as benchmarks/pipeline.py) it records the
timeline and reports the measured bubble (their median) beside the formula.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from meshtrain.data.batch import count_tokens, plain, throughput_unit, to_device
from meshtrain.errors import ConfigError
from meshtrain.parallel.data.batch_gather import batch_group
from meshtrain.module.core import has_steps
from meshtrain.parallel.engine import Engine
from meshtrain.parallel.pipeline.step_split import StepLoss, forward_input, micro_batches

SHARDING_BREAKS = ("zero-bubble", "zbv", "dualpipev")  # wrong gradients with zero3 (not zero2)


@dataclass(frozen=True)
class PipelineOptions:
    """The Trainer's pipeline settings (``pp_schedule``, ``stages_per_rank``, ``pp_balance``,
    ``split_points``). ``adapter``: a function model -> how to pipeline it, or None
    for models cut by ``model.layers`` (pipeline.py); see :func:`pipeline_adapter`."""

    schedule: str = "1f1b"
    stages_per_rank: int = 1
    balance: str = "params"
    split_points: list[int] | None = None
    adapter: Callable | None = None

    @classmethod
    def from_settings(cls, s: dict, layout, adapter=None) -> PipelineOptions:
        options = cls(s["pp_schedule"], s["stages_per_rank"], s["pp_balance"], s["split_points"],
                      adapter)
        options.check(layout)
        return options

    def check(self, layout) -> None:
        if layout.degree("pp") == 1 and (self.stages_per_rank != 1 or self.split_points):
            raise ConfigError("stages_per_rank and split_points need a pipeline layout (pp=N)")
        if self.balance not in ("params", "time", "memory"):
            raise ConfigError(f"pp_balance must be 'params', 'time' or 'memory', got "
                              f"{self.balance!r}")


def pipeline_adapter(model, options: PipelineOptions):
    """What pipelines ``model`` when its blocks are not ``model.layers`` (e.g. a Hugging Face
    model: meshtrain.models.hf.pipeline), or None. An adapter has ``blocks(model)``,
    ``split(model, split_points, stage_index)`` (as :func:`~meshtrain.parallel.pipeline.
    split_model`), ``split_batch(batch) -> (inputs, targets)``, ``loss_fn`` (used when fit gets
    none), and for pipeline/check.py ``stage_forward(model, x)``, ``model_output(output)``,
    ``example_inputs(model)`` and ``post_modules``."""
    if options.adapter is None or model is None:
        return None
    return options.adapter(model)


def check_pipeline_layout(model, layout, options: PipelineOptions, *, loss_fn,
                          num_microbatches: int, batch_size: int, sample_inputs=None,
                          original=None) -> None:
    """Checks on the model (a meta-device copy, or None when it cannot be built there) and the
    settings, before any process group exists. With ``sample_inputs`` (once, before the
    processes start), also that the stages compute the model's forward (pipeline/check.py;
    ``original``: the module or factory the user gave)."""
    from meshtrain.parallel.pipeline import check_pipeline, pipeline_blocks

    adapter = pipeline_adapter(model if model is not None else original, options)
    steps = has_steps(model if model is not None else original)  # step_split.py: the loss
    if loss_fn is None and getattr(adapter, "loss_fn", None) is None and not steps:
        raise ConfigError(
            "pipeline layouts need loss_fn: the last stage computes loss_fn(output, targets) "
            "on each micro-batch; pass loss_fn= to fit")
    from meshtrain.parallel.pipeline.tied import check_ties

    check_ties(model if model is not None else (original if isinstance(original, torch.nn.Module)
                                                else None), options.schedule)
    if layout.zero_stage == 3 and options.schedule in SHARDING_BREAKS:
        raise ConfigError(
            f"pp_schedule={options.schedule!r} with zero3/dp_shard gives wrong gradients in "
            "torch 2.13: the zero-bubble schedules run the weight gradients after FSDP has "
            "resharded a block's parameters (measured: gradient norm 0.76x one process's). "
            "Use zero2 instead (e.g. pp=2,zero2=2: parameters stay gathered from forward to "
            "backward, which matches one process), or 1f1b, gpipe or interleaved-1f1b with "
            "zero3")
    if model is not None:
        blocks = adapter.blocks(model) if adapter is not None else pipeline_blocks(model)
        check_pipeline(len(blocks), layout.degree("pp"),
                       schedule=options.schedule, num_microbatches=num_microbatches,
                       stages_per_rank=options.stages_per_rank, batch_size=batch_size)
    if sample_inputs is not None:
        from meshtrain.parallel.pipeline.check import check_before_start

        check_before_start(model, original, sample_inputs, adapter)
    else:
        from meshtrain.check_skips import skipped

        skipped("pipeline check", "no training sample before start (data built by a "
                "function), so the stages were not compared with the model's forward")


def _sample_block_input(model, options: PipelineOptions, sample_inputs, device, adapter):
    """The hidden state entering the first block, for time/memory balancing."""
    if options.balance == "params" or options.split_points:
        return None
    embed = getattr(model, "embed", None)
    inputs = sample_inputs() if sample_inputs is not None else None
    if not callable(embed) or not isinstance(inputs, torch.Tensor) or adapter is not None:
        raise ConfigError(
            f"pp_balance={options.balance!r} measures each block on a sample input, which "
            "needs model.embed(x), blocks called with the hidden state alone and (inputs, "
            "targets) samples; use pp_balance='params' or "
            "split_points=")
    with torch.no_grad():
        return embed(to_device(inputs, device))


def apply_pipeline(model, mesh, *, device, options, pipeline: PipelineOptions, precision,
                   loss_fn, num_microbatches: int, sample_inputs: Callable | None = None,
                   log: Callable[[str], None] = print, run_dir: Path | None = None,
                   parallelize: Callable) -> PipelineEngine:
    """Split ``model`` into stages, keep this rank's, ``parallelize`` each (TP, checkpointing,
    FSDP as for a whole model), and build the schedule."""
    from meshtrain.parallel.data.meta_init import tied_names
    from meshtrain.parallel.pipeline.partition import partition_blocks
    from meshtrain.parallel.pipeline.tied import TiedWeights
    from meshtrain.parallel.pipeline import (
        PipelineRunner, pipeline_blocks, rank_stages, split_model,
    )

    pp_mesh, pp = mesh.axis("pp"), mesh.layout.degree("pp")
    num_stages = pp * pipeline.stages_per_rank
    adapter = pipeline_adapter(model, pipeline)
    blocks_of = adapter.blocks if adapter is not None else pipeline_blocks
    loss_fn = loss_fn if loss_fn is not None else getattr(adapter, "loss_fn", None)
    step_loss = StepLoss() if loss_fn is None and has_steps(model) else None
    loss_fn = step_loss or loss_fn
    split = partition_blocks(blocks_of(model), num_stages, balance=pipeline.balance,
                             sample_input=_sample_block_input(model, pipeline, sample_inputs,
                                                              device, adapter),
                             split_points=pipeline.split_points,
                             group=torch.distributed.group.WORLD)  # one split on every rank
    indices = rank_stages(pp_mesh.get_local_rank(), pp, pipeline.stages_per_rank,
                          pipeline.schedule)
    stages = [(adapter.split if adapter is not None else split_model)(model, split, i)
              for i in indices]
    stage_options = dataclasses.replace(options, blocks=blocks_of)
    for stage in stages:
        parallelize(stage, mesh, device=device, options=stage_options)
    p2p_group = mesh.local_p2p(("pp",), device)
    runner = PipelineRunner(stages, indices, num_stages, pp_mesh, device,
                            schedule=pipeline.schedule, num_microbatches=num_microbatches,
                            loss_fn=loss_fn, p2p_group=p2p_group)
    log(f"pipeline: {num_stages} stages split before blocks {split} ({pipeline.balance}-"
        f"balanced), schedule {pipeline.schedule}, {num_microbatches} micro-batches, send/recv "
        f"{'through shared memory' if p2p_group is not None else 'on the process group'}")
    merged = merge_stages(stages)
    ties = tied_names(model)
    engine = PipelineEngine(merged, merged, mesh, device=device, precision=precision,
                            loss_fn=loss_fn, options=options, grad_accum_steps=1)
    engine.runner, engine.pipeline, engine.split_points = runner, pipeline, split
    engine.adapter = adapter
    if ties:  # (an embedding reused as the head: a copy on the first and on the last stage)
        engine.tied = TiedWeights(ties, stages, indices, num_stages, mesh)
    from meshtrain.moe.pipeline import pipeline_routing

    # meshtrain's MoE layers balance their routers inside the stages (moe/pipeline.py)
    engine.router_loss = pipeline_routing(model, merged, mesh, num_microbatches, device)
    if engine.router_loss is not None:
        engine.router_loss.scale_loss = lambda loss: engine.precision.scale_loss(loss)
    if step_loss is not None:  # a research module's steps, split around the pipeline
        by_index = dict(zip(indices, stages))
        step_loss.module = by_index.get(num_stages - 1)
        engine.step_loss, engine.first_stage = step_loss, by_index.get(0)
        engine.step_call = step_loss  # (what evaluation asks for: the module has steps)
        engine.counter = getattr(model, "count_loss_items", None)
    elif engine.counter is not None:  # a global-mean loss_fn: its targets may come from a dict
        engine.counter = lambda batch: loss_fn.count(engine._split(batch)[1])
    engine.num_microbatches, engine.log, engine.run_dir = num_microbatches, log, run_dir
    return engine


class PipelineEngine(Engine):
    """This rank's stages under a schedule: one loader draw is the step's whole batch."""

    runner = pipeline = split_points = log = run_dir = adapter = None
    tied = None  # weights tied between the first and the last stage: pipeline/tied.py
    step_loss = first_stage = None  # a research module's: step_split.py
    num_microbatches, _num_calls = 1, 0
    RECORDED = (3, 4, 5)  # the steps whose timeline is recorded (1-based calls)

    def forward_backward(self, batches) -> tuple[torch.Tensor, int]:
        whole = to_device(next(batches), self.device)
        batch = self.shard(whole)  # under cp: this rank's chunks of every sequence
        if self.step_loss is not None:
            inputs, targets = self._step_inputs(batch, "training_step", self.num_microbatches)
        else:
            inputs, targets = self._split(batch)
            self._set_side(whole, self.num_microbatches)  # (documents: of the whole window)
        self._num_calls += 1
        record = self._num_calls in self.RECORDED  # past one-time start-up costs
        self.runner.scale_loss = self.precision.scale_loss  # the schedule runs the backward
        if not self._checked_loss and self.step_loss is None:
            self._check_loss((inputs, targets), self.num_microbatches)
        if self.counter is not None:  # global mean: each micro-batch's sum over the step's
            # items, times the micro-batches (the schedule divides the gradients by them)
            items = self.global_items(self.counter(whole))  # (counted before the cp cut)
            self.runner.num_items = lambda: items.divisor() / self.num_microbatches
        with self.precision.autocast(), self.loss_context(), batch_group(self.batch_pg):
            if record:  # collective: every rank records the same step
                start = time.perf_counter()
                loss, events = self.runner.timed_step(inputs, targets)
                if self.timer is not None:
                    me = torch.distributed.get_rank(self.runner.group)
                    busy = sum(e.end - e.start for e in events if e.rank == me)
                    self.timer.move(time.perf_counter() - start - busy, "compute", "bubble")
                self._report_timeline(events)
            elif self.timer is not None and self.timer.active:  # the rest is its bubble
                start = time.perf_counter()
                loss, busy = self.runner.step_compute_time(inputs, targets)
                self.timer.move(time.perf_counter() - start - busy, "compute", "bubble")
            else:  # None unless this rank has the last stage
                loss = self.runner.step(inputs, targets)
        if self.step_loss is not None and self.step_loss.module is not None:
            self.step_loss.commit(self.num_microbatches)  # what the micro-batches' steps logged
        # (plain: under loss parallel the last stage's loss is a replicated DTensor)
        loss = plain(loss.detach()) if loss is not None else torch.zeros((), device=self.device)
        if self.router_loss is not None:  # the MoE balancing loss this rank's stages added
            loss = loss + self.router_loss.added_loss().to(loss.dtype)
        self.unit = throughput_unit(inputs if inputs is not None else batch)
        tokens = count_tokens(inputs if inputs is not None else batch)  # (cp's cut: 1/cp)
        return loss, tokens * self.layout.degree("cp")

    def _step_inputs(self, batch, step: str, num: int):
        """A research module's step: (the model's input for the first stage, the micro-batches'
        indices for the last, whose loss runs the rest of the step: step_split.py)."""
        micro = micro_batches(batch, num)
        first = self.batch_idx if step == "training_step" else self.eval_idx
        self.step_loss.step, self.step_loss.batches, self.step_loss.first_idx = step, micro, first
        inputs = None
        if self.first_stage is not None:
            inputs = torch.cat([forward_input(self.first_stage, step, part, first + i)
                                for i, part in enumerate(micro)])
        if step == "training_step":
            self.batch_idx += num
        return inputs, torch.arange(num, device=self.device)

    def sync_gradients(self) -> None:
        super().sync_gradients()
        if self.tied is not None:  # both copies of a tied weight get the sum of their grads
            self.tied.sum_grads()

    def clip_grad_norm(self, max_norm: float | None) -> torch.Tensor:
        """Each rank holds its stages: the squared norms are summed over the pp group (a tied
        weight's second copy left out)."""
        from meshtrain.parallel.pipeline import clip_grad_norm_

        if self.layout.expert_degree > 1:  # (and ep's experts' over the ep group)
            return super().clip_grad_norm(max_norm)
        copies = frozenset(self.tied.copies) if self.tied is not None else frozenset()
        return plain(clip_grad_norm_(list(self.parameters()), max_norm, self.mesh.axis("pp"),
                                     copies))

    @torch.no_grad()
    def eval_loss(self, batch, with_output: bool = False) -> torch.Tensor | None:
        whole, batch = batch, self.shard(batch)  # under cp: this rank's chunks
        if self.step_loss is not None:  # its validation_step / test_step around the stages
            inputs, index = self._step_inputs(batch, self.eval_step, 1)
            with self.precision.autocast(), batch_group(self.batch_pg):
                out = self.runner.forward_only(inputs)
                loss = self.step_loss(out, index) if out is not None else None
            if out is not None:
                self.step_loss.commit(1)
            self.eval_idx += 1
            self.eval_seen = None
            return loss.detach() if loss is not None else None
        self._set_side(whole, 1)
        with self.precision.autocast(), self.loss_context(), batch_group(self.batch_pg):
            loss = self.runner.eval_loss(*self._split(batch))
        loss = plain(loss) if loss is not None else None
        self.eval_seen = (self.runner.eval_output, batch) if with_output else None
        return loss

    @torch.no_grad()
    def predict_batch(self, batch, batch_idx: int):
        """The last stage's outputs (on its rank; None on the others), stage after stage."""
        from meshtrain.parallel.engine import _sequence_length, prediction_inputs

        whole, batch = batch, self.shard(batch)  # under cp: this rank's chunks
        inputs = (self.adapter.split_batch(batch)[0] if self.adapter is not None
                  else prediction_inputs(batch))
        self._set_side(whole, 1)
        with self.precision.autocast(), batch_group(self.batch_pg):
            out = self.runner.forward_only(inputs)
        if self.cp is not None and out is not None:  # (the last stage's cp group gathers)
            from meshtrain.parallel.context.context_parallel import gather_sequence

            out = gather_sequence(out, self.cp, _sequence_length(batch))
        return out

    def end_of_training(self) -> None:
        super().end_of_training()
        timeline = getattr(self, "_timeline", None)
        if timeline is not None:  # rank 0, after a recorded step
            from meshtrain.parallel.pipeline import plot_timeline

            events, path, title = timeline
            plot_timeline(events, path, title=title)
            self._timeline = None

    def _set_side(self, batch, chunks: int) -> None:
        """What the stages read beside the hidden state (the adapter's ``side_inputs``: a
        Hugging Face model's position ids of packed documents; else the model's own
        ``pipeline_side_inputs``: meshtrain's GPT's document ids), cut into ``chunks``."""
        side = getattr(self.adapter, "side_inputs", None) if self.adapter is not None else \
            getattr(self.runner.modules[0], "pipeline_side_inputs", None)
        self.runner.set_side_inputs(side(batch) if side is not None else None, chunks)

    def _split(self, batch):
        """(inputs, targets) of a batch: the adapter's split (a dict batch), else the pair."""
        return self.adapter.split_batch(batch) if self.adapter is not None else batch

    def _report_timeline(self, events) -> None:
        """The pipeline diagram of one step, and its measured bubble beside the formula."""
        from meshtrain.observe.run_files import PIPELINE, write_json
        from meshtrain.parallel.pipeline import (
            bubble_fraction, ideal_bubble_fraction, replay,
        )

        if self.run_dir is None or torch.distributed.get_rank() != 0:
            return
        pp, m = self.layout.degree("pp"), self.num_microbatches
        ideal = ideal_bubble_fraction(pp, m, self.pipeline.stages_per_rank)
        self._bubbles = [*getattr(self, "_bubbles", []), bubble_fraction(events)]
        # the same step replayed with free communication: what the stages' own times leave
        self._free = [*getattr(self, "_free", []), bubble_fraction(replay(events))]
        measured = statistics.median(self._bubbles)  # (a step killed early keeps what it has)
        free = statistics.median(self._free)
        path = self.run_dir / "pipeline_timeline.png"
        # drawn when training ends (end_of_training), not here: matplotlib's import and a
        # drawing on rank 0 in the middle of the run stalled every stage behind it
        self._timeline = (events, path, f"{self.pipeline.schedule}, p={pp}, m={m}, step "
                          f"{self._num_calls}: bubble {self._bubbles[-1]:.2f} (formula "
                          f"{ideal:.2f})")
        write_json(self.run_dir / PIPELINE, {
            "schedule": self.pipeline.schedule, "pp": pp, "microbatches": m,
            "stages_per_rank": self.pipeline.stages_per_rank, "step": self._num_calls,
            "measured_bubble": measured, "bubbles": self._bubbles, "formula_bubble": ideal,
            "free_comm_bubble": free,
            "events": [[e.rank, e.stage, e.microbatch, e.kind, e.start, e.end] for e in events]})
        if self._num_calls == self.RECORDED[-1]:
            self.log(f"pipeline steps {self.RECORDED[0]}-{self._num_calls}: measured bubble "
                     f"{measured:.2f} (median), {free:.2f} with free communication (what the "
                     f"stages' times leave), formula (p-1)/(v*m+p-1) = {ideal:.2f}; timeline "
                     f"(drawn when training ends): {path}")


def merge_stages(stages: list[torch.nn.Module]) -> torch.nn.Module:
    """One module holding all of this rank's stages under their full-model names, for the
    optimizer, checkpoints and what ``fit`` returns (its ``forward`` is not meant to be called).
    The stages' submodules are shared, not copied."""
    if len(stages) == 1:
        return stages[0]
    merged = torch.nn.Module()
    for stage in stages:
        _merge_into(merged, stage)
    return merged


def _merge_into(merged: torch.nn.Module, module: torch.nn.Module) -> None:
    """Add ``module``'s submodules to ``merged``: containers both hold (``layers``, or
    ``model`` of a Hugging Face model) become new containers holding both's children; a leaf
    both hold (a copy without parameters, such as rotary embeddings) is kept once, the one with
    parameters if either has them (a stage holds a stand-in without, e.g. ``nn.Identity`` for
    the final norm of the last stage)."""
    for name, child in module.named_children():
        have = merged._modules.get(name)
        if have is None:
            merged.add_module(name, child)
            continue
        if have is child:
            continue
        if next(child.children(), None) is None:
            if next(have.parameters(), None) is None and next(child.parameters(), None) is not None:
                merged._modules[name] = child
            continue
        if not getattr(have, "_pp_merged", False):  # a stage's own module: not changed
            nested = isinstance(have, torch.nn.ModuleDict)
            container = torch.nn.ModuleDict() if nested else torch.nn.Module()
            container._modules.update(have._modules)
            container._parameters.update(have._parameters)
            container._buffers.update(have._buffers)
            container._pp_merged = True
            merged._modules[name] = have = container
        _merge_into(have, child)
