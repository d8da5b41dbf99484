"""What ``Trainer.fit`` does before its loop: check the inputs, start the processes, build the
model under the layout, the optimizer and the data loaders, and resume when a checkpoint is due.

Under a ``ps`` layout (meshtrain/parallel/ps/layout.py) the server processes stop after the
checks and the world: :func:`serve` keeps them answering the workers until training ends.
"""

from __future__ import annotations

import dataclasses
import os

from datetime import timedelta

import torch

from meshtrain import checks
from meshtrain.check_skips import collecting
from meshtrain.checkpoint.hf_weights import load_hf_weights
from meshtrain.checkpoint.manager import CheckpointManager
from meshtrain.checkpoint.restarted import note_start
from meshtrain.checkpoint.resume import callback_states, model_shapes, resolve_run_dir, resume_fit
from meshtrain.checkpoint.safe_load import check_plain
from meshtrain.data.sampler import train_loaders
from meshtrain.errors import ConfigError
from meshtrain.fault import FaultOptions, StepGuard, set_collective_timeout
from meshtrain.fault.restarts import start_failed
from meshtrain.launch.world import start_world
from meshtrain.loop.compiled_model import unwrap_compiled
from meshtrain.loop.layout_settings import take_loader_settings
from meshtrain.loop.seeding import agree_on_initial_state, check_seed_agrees
from meshtrain.loop.state import loader_options
from meshtrain.module.configure import Schedule
from meshtrain.module.core import (
    attach, check_module, configured_optimizers, is_manual, linked,
)
from meshtrain.module.data_hooks import defines
from meshtrain.module.hparams import logged
from meshtrain.observe.flops import FirstBatchCount, flops_per_item
from meshtrain.observe.monitor import RunMonitor
from meshtrain.parallel.apply import apply_layout, build_optimizer, check_model
from meshtrain.parallel.layout import Layout
from meshtrain.parallel.mesh import ParallelMesh
from meshtrain.parallel.whole_state import skeleton
from meshtrain.precision import Precision


def prepare(trainer, model, train_data, val_data=None, *, optimizer=None, loss_fn=None,
            lr_scheduler=None) -> None:
    """Everything ``fit`` needs before its loop (see the module's docstring)."""
    t = trainer
    model = unwrap_compiled(t, model)  # (torch.compile's wrapper: its module, compiled here)
    train_set, meta_model = check_before_start(t, model, train_data, val_data,
                                               optimizer=optimizer, loss_fn=loss_fn,
                                               lr_scheduler=lr_scheduler)
    t._model_shapes = model_shapes(meta_model)  # None: known once built
    setup_world(t)
    if t.ps_server is not None:
        t._loss_fn = loss_fn
        return
    try:
        setup_run_dir(t, logged(model if isinstance(model, torch.nn.Module) else meta_model))
        prepare_data(t, meta_model if meta_model is not None else model)
        if checks.is_data_factory(train_data):  # built now that the data is there
            train_data = train_data()
            take_loader_settings(t, train_data)
            train_set = checks.check_data(train_data, t.global_batch_size, t.max_steps)
            t._train_size = len(train_set) if hasattr(train_set, "__len__") else None
        if checks.is_data_factory(val_data):
            val_data = val_data()
            checks.dataset_of(val_data, "val_data")
        t._val_data = val_data
        for note in [*t.loader_notes, *t.skipped_checks]:  # (once: a Trainer fitted again
            if note not in t.start_notes:  # keeps its start notes)
                t.start_notes += "\n" + note
        setup_model(t, model, meta_model, optimizer, lr_scheduler, loss_fn,
                    checks.first_inputs(train_set, t.micro_batch_size))
        t.state.sampler, t.train_loader = train_loaders(
            train_set, train_data, global_batch_size=t.global_batch_size,
            micro_batch_size=t.batch_plan.loader_batch_size, dp_rank=t.dp_rank,
            dp_degree=t.layout.batch_degree, shuffle=t.shuffle, seed=t.seed,
            piece_size=t.batch_plan.micro_batch_size if t.layout.degree("pp") > 1 else None,
            max_batches=t.limit_train_batches, **loader_options(t))
        t.checkpoints = CheckpointManager.from_settings(t.run_dir / "checkpoints", t._settings)
        t.checkpoints.on_commit = lambda path, step, seconds: t.monitor.event(
            "checkpoint", f"saved ({seconds:.2f} s from start to commit)", step, path)
        t._guard = StepGuard(
            t, FaultOptions.from_settings(t), t.checkpoints,
            run_dir=t.run_dir, rank=t.rank, world_size=t.world_size,
            device=t.device, grad_scaler=t.precision.scaler is not None,
            gradients_identical=t.engine.gradients_identical)
        check_plain(t.checkpoint_state()[0], "the trainer state")  # now, not at the first save
        t._call("setup")  # callbacks build their state on the laid-out model (before a resume)
        t.checkpoints.extra_state = lambda: callback_states(t.callbacks)
        if t._resume_from is not None:
            resume_fit(t, t._resume_from)
            t.monitor.event("restart", f"resumed at step {t.global_step}", t.global_step,
                            t._resume_from)
        note_start(t)  # a restart with no checkpoint says what is lost (checkpoint/restarted.py)
    except BaseException as error:
        start_failed(t, error)  # recorded (a repeat stops restarts), run folder given back
        if t._workers is not None:
            t._workers.raise_if_failed(error)
        raise


def check_before_start(t, model, train_data, val_data=None, *, optimizer=None, loss_fn=None,
                       lr_scheduler=None):
    """Every check ``fit`` makes before any process starts (``Trainer.check``; ``--dry-run``):
    the inputs, then the model against the layout on a meta-device copy of a factory's model
    (no weights). Returns (the training dataset, that copy or None); ``t.skipped_checks``: the
    checks that could not run, and why (check_skips.py; printed at start)."""
    with collecting() as t.skipped_checks:
        return _check_before_start(t, model, train_data, val_data, optimizer=optimizer,
                                   loss_fn=loss_fn, lr_scheduler=lr_scheduler)


def _check_before_start(t, model, train_data, val_data=None, *, optimizer=None, loss_fn=None,
                        lr_scheduler=None):
    model = unwrap_compiled(t, model)
    take_loader_settings(t, train_data)  # (a DataLoader's batch size and order)
    train_set = checks.check_fit_inputs(model, train_data, val_data, optimizer=optimizer,
                                        lr_scheduler=lr_scheduler,
                                        global_batch_size=t.global_batch_size,
                                        max_steps=t.max_steps)
    meta_model = checks.inspect_model(model)
    if meta_model is not model and defines(meta_model, "setup"):  # a factory's module
        raise ConfigError(f"{type(meta_model).__name__}.setup(stage) would not run on a model "
                          "fit builds from a function; pass the module object (its setup runs "
                          "before its own train_dataloader()), or move it to __init__")
    checks.check_monitors(t.callbacks, meta_model, val_data, t._settings)  # (a typo: now)
    layout = t.layout or Layout()  # (layout="auto": checked again once planned)
    t._train_size = len(train_set) if hasattr(train_set, "__len__") else \
        "later" if train_set is None else None  # (None: a stream)
    if t.limit_train_batches and t._train_size is None:
        raise ConfigError("limit_train_batches needs a map-style dataset (this one is a "
                          "stream: an IterableDataset); stop by max_steps instead")
    with linked(meta_model, t):
        check_module(meta_model, optimizer=optimizer, loss_fn=loss_fn, val_data=val_data,
                     pp=layout.degree("pp"), metrics=t.metrics,
                     zero1=layout.zero_stage == 1 and layout.degree("dp") > 1, layout=t.layout,
                     settings={**t._settings, "grad_accum_steps": t.grad_accum_steps})
    if layout.degree("pp") > 1 and train_set is not None:
        checks.check_pipeline_reads(train_set, train_data, t.num_workers)
    sample_inputs = checks.first_inputs(train_set, 2) if train_set is not None else None
    if t.layout is None:  # layout="auto": the planner's pick that these checks accept
        from meshtrain.plan.auto import plan_layout

        plan_layout(t, model, meta_model, sample_inputs, lambda t: check_model_layout(
            t, meta_model, loss_fn, sample_inputs, model), loss_fn=loss_fn,
            example=(lambda: checks.first_batch(train_set, 1)) if train_set is not None
            else None)
    else:
        check_model_layout(t, meta_model, loss_fn, sample_inputs, model)
    return train_set, meta_model


def prepare_data(t, model) -> None:
    """The model's and the DataModule's ``prepare_data()`` (download, unpack, tokenize: once per
    job) on global rank 0 while the other ranks wait in a barrier; then every rank reads the
    data. With ``prepare_data_per_node = True`` on the model or DataModule (nodes without a
    shared disk; Lightning's DataModule default), on each node's local rank 0."""
    sources = [s for s in (model if isinstance(model, torch.nn.Module) else None, t.datamodule)
               if s is not None and callable(getattr(s, "prepare_data", None))]
    for source in sources:
        if getattr(source, "prepare_data_per_node", False):
            first = (t._env.local_rank if t._env is not None else 0) == 0
        else:
            first = t.rank == 0
        if first:
            source.prepare_data()
    group = t.mesh.everyone()
    if sources and group is not None:
        torch.distributed.barrier(group=group)


def setup_world(t) -> None:
    """Start the other processes if needed; create the process group and mesh (once)."""
    if t.mesh is not None:
        return
    world = start_world(t.layout.num_processes, t._env, t.device_type,
                        init_timeout_s=t.init_timeout_s, num_servers=t.layout.num_servers,
                        collective_timeout_s=t.collective_timeout_s,
                        debug_collectives=t.debug_collectives, log=t.print)
    t.rank, t.device, t._env, t._workers = world.rank, world.device, world.env, world.workers
    t.start_notes = world.notes  # threads and network, printed by fit below the run folder
    t.ps_server = world.server
    t._store = world.store
    if t.ps_server is not None:  # a parameter server: in no process group, evaluates alone
        t.mesh = ParallelMesh(Layout(), t.device_type)
        return
    from meshtrain.plan.auto import agree

    agree(t)  # layout="auto": rank 0's pick
    t.mesh = ParallelMesh(t.layout, t.device_type, local_comm=t._settings["local_comm"])
    check_seed_agrees(t.seed, t.mesh.everyone())  # (a seed per rank would split data wrongly)
    if t.world_size > 1:  # the mesh's sub-groups get torch's 30-minute default
        set_collective_timeout(timedelta(seconds=t.init_timeout_s))


def setup_run_dir(t, hparams: dict | None = None) -> None:
    """The run folder and the loggers (they record the settings and a module's ``hparams``)."""
    if t.run_dir is None:
        t.run_dir, t._resume_from = resolve_run_dir(
            t.resume, run_dir=t._run_dir_arg, root_dir=t.root_dir, name=t.name,
            rank=t.rank, shapes=t._model_shapes)
        t.run_log.open(t.run_dir, t.loggers, {**t.hparams(), **(hparams or {})})
        if torch.distributed.is_initialized() and "nccl" in str(torch.distributed.get_backend()):
            from meshtrain.launch.spawn import flight_recorder_defaults

            flight_recorder_defaults(os.environ, str(t.run_dir))  # its dumps: the run folder


def check_model_layout(t, model, loss_fn, sample_inputs=None, original=None) -> None:
    """The model against the layout (``model`` may be a meta-device copy, or None)."""
    check_model(model, t.layout, t.parallel_options, pipeline=t.pipeline_options,
                loss_fn=loss_fn, num_microbatches=t.grad_accum_steps,
                batch_size=t.global_batch_size // t.layout.batch_degree,
                sample_inputs=sample_inputs, original=original)


def setup_model(t, model, meta_model, optimizer_factory, scheduler_factory, loss_fn,
                sample_inputs) -> None:
    """Build (or take) the model, apply the layout, then create the optimizer."""
    torch.manual_seed(t.seed)  # identical initial parameters on every rank
    measures = t.pipeline_options.balance != "params" and not t.pipeline_options.split_points
    choice = choose_build(t.layout, t.meta_init, model, meta_model, t.seed, measures)
    if choice.factory is not model:  # the same values in every layout, sharded where split
        t.print(f"model: {choice.factory.model_class.__name__} from a factory, initialised "
                f"module by module from seed {choice.factory.seed} (meshtrain's seeded values, "
                "equal under every layout; not those of transformers' own initialisation)")
    factory, on_meta, why = choice.factory, choice.on_meta, choice.why_whole
    if on_meta and choice.initializer is not None:  # the factory fills the shards
        t.parallel_options = dataclasses.replace(t.parallel_options,
                                                 initializer=choice.initializer)
    model = meta_model if on_meta else build(factory)
    if why is not None:
        count = sum(p.numel() for p in model.parameters())
        size = sum(p.numel() * p.element_size() for p in model.parameters())
        t.print(f"model: each rank builds the whole model first ({count:,} parameters, "
                f"{size / 2**20:,.1f} MiB per rank) and then keeps its part: {why}")
    elif on_meta:
        t.print("model: built on the meta device; each rank allocates and initialises only "
                "its part")
    if not on_meta:  # a model object built before the Trainer: rank 0's weights everywhere
        agree_on_initial_state(model, t.mesh.everyone(), t.device, t.print)
    with linked(model, t):  # a factory built for real
        check_module(model, optimizer=optimizer_factory, loss_fn=loss_fn, val_data=t._val_data,
                     pp=t.layout.degree("pp"), metrics=t.metrics)
    with collecting():  # (what could not be checked was said before start)
        check_model_layout(t, model, loss_fn)
    t._model_shapes = model_shapes(model)  # before a pipeline keeps only its stages
    # what Trainer.whole_model fills with the trained weights (a factory: built again)
    t._whole_template = factory if on_meta else skeleton(model)
    t.precision = Precision(t.precision_name, t.device_type)
    t.engine = apply_layout(
        model, t.mesh, device=t.device, options=t.parallel_options,
        pipeline=t.pipeline_options, precision=t.precision, loss_fn=loss_fn,
        grad_accum_steps=t.grad_accum_steps, on_meta=on_meta,
        sample_inputs=sample_inputs, log=t.print, run_dir=t.run_dir)
    t.model = t.engine.model
    start_monitor(t, flops_per_item(model),  # model: whole, before a pipeline split
                  None if callable(getattr(model, "flops_per_token", None)) or t.rank != 0
                  else FirstBatchCount(t._whole_template))
    if t.init_from is not None:  # pretrained weights: each rank reads its own shards
        load_hf_weights(t.model, t.init_from, partial=t.layout.degree("pp") > 1)
    stages = getattr(getattr(t.engine, "runner", None), "modules", [])  # (under pp)
    for module in {id(m): m for m in [model, t.model, *stages]}.values():
        attach(module, t)  # its self.log and self.trainer (and what laid it out)
    t.lr_schedule = Schedule()  # fit(lr_scheduler=...): stepped after every optimizer step
    if optimizer_factory is None:  # the model's own, on the parameters as laid out
        optimizer_factory, own_scheduler, own_schedule = configured_optimizers(
            t.model, zero1=t.layout.zero_stage == 1 and t.layout.degree("dp") > 1)
        if scheduler_factory is None and own_scheduler is not None:
            scheduler_factory, t.lr_schedule = own_scheduler, own_schedule
    if is_manual(t.model):  # its own optimizers, several, stepped by its training_step
        t.optimizer = optimizer_factory(None)
    else:
        t.optimizer = build_optimizer(t.model, optimizer_factory, t.mesh)
        checks.check_optimizer(t.optimizer)
    if t.layout.num_servers:  # the optimizer runs on the servers
        from meshtrain.parallel.ps.layout import start_servers

        t.optimizer = t.engine.averager = start_servers(t.model, t.optimizer, t.layout,
                                                        t._settings)
    t.lr_scheduler = scheduler_factory(t.optimizer) if scheduler_factory else None
    # dropout: different per rank (a tp or cp group's alike: mesh.random_rank), reproducible
    torch.manual_seed(t.seed + 1 + (t.mesh.random_rank if t.mesh is not None else t.rank))


@dataclasses.dataclass(frozen=True)
class BuildChoice:
    """How a layout builds the model (the Trainer's and the planner's simulated world's
    choice): ``factory`` (the user's, or ``HFCausalLM`` for a factory returning a Hugging Face
    model), ``on_meta`` (each rank materialises only its part, filled by ``initializer`` or
    the model's ``init_weights``), else ``why_whole`` (None: the layout splits nothing)."""

    factory: object
    on_meta: bool
    why_whole: str | None
    initializer: object = None


def choose_build(layout, meta_init, model, meta_model, seed: int,
                 measures_blocks: bool = False) -> BuildChoice:
    """:class:`BuildChoice` for ``model`` (a module or a factory; ``meta_model``: its copy on
    the meta device, None when it could not be built there)."""
    from meshtrain.models.hf.init import from_factory
    from meshtrain.parallel.data.meta_init import (builds_on_meta, initializer_of,
                                                   whole_build_reason)

    hf = from_factory(model, meta_model, seed) if meta_model is not None else None
    factory = hf if hf is not None else model
    on_meta = builds_on_meta(layout, meta_init, factory, meta_model, measures_blocks)
    return BuildChoice(factory, on_meta,
                       whole_build_reason(layout, meta_init, factory, meta_model, measures_blocks),
                       initializer_of(factory) if on_meta else None)


def start_monitor(t, flops: float, count=None) -> None:
    """The run's measurements (meshtrain/observe/monitor.py); the engine gets its clock.
    ``count``: FLOPs to count on the first batch's shapes (a model that states none)."""
    t.monitor = RunMonitor(run_dir=t.run_dir, rank=t.rank, device=torch.device(t.device),
                           group=t.mesh.everyone(), world_size=t.world_size,
                           every=t.breakdown_every_n_steps, straggler_margin=t.straggler_margin,
                           profile_steps=t.profile_steps, log=t.print)
    t.engine.timer = t.monitor.timer
    t.monitor.start(flops_per_item=flops, peak_setting=t.peak_tflops, layout=str(t.layout),
                    settings=t.hparams(), count=count)


def build(model) -> torch.nn.Module:
    """The user's module, or what their factory returns."""
    model = model if isinstance(model, torch.nn.Module) else model()
    if not isinstance(model, torch.nn.Module):
        raise ConfigError(f"the model factory returned {type(model).__name__}, not a "
                          "torch.nn.Module")
    return model


def serve(t, model) -> torch.nn.Module:
    """(A ``ps`` server process.) Serve until the workers finish; then hold the trained model
    and evaluate alone on the whole data (``validate``/``test`` give the workers' numbers)."""
    from meshtrain.parallel.ps.layout import serve_job

    result = serve_job(t.ps_server, t.rank, t.layout.num_processes, t._store)
    t.ps_stats = result["stats"]  # bytes received and sent, optimizer steps, staleness seen
    torch.manual_seed(t.seed)
    t.model = build(model)
    if result["final"] is not None:
        t.model.load_state_dict(result["final"])
    t.precision = Precision(t.precision_name, t.device_type)
    t.engine = apply_layout(t.model, t.mesh, device=t.device, options=t.parallel_options,
                            pipeline=None, precision=t.precision, loss_fn=t._loss_fn,
                            grad_accum_steps=1, log=t.print)
    return t.model
