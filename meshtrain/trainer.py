"""The Trainer: one training loop for every layout.

Research code (a model, a loss, an optimizer factory, data) goes in; the Trainer does the
engineering: processes and the device mesh, the parallel layout, micro-batching and gradient
accumulation, mixed precision, clipping, validation, logging, checkpoints.

A training step, for a global batch of G samples on ``dp`` ranks with micro-batches of M::

    for each of the G / (dp * M) micro-batches of this rank:
        loss = loss(model(x), y) / accumulation      # no gradient sync but on the last one
        loss.backward()
    clip gradients by their global norm; optimizer.step(); scheduler.step()

which is one step of one-process training on the same G samples: the parity tests check that.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
import warnings
from collections.abc import Callable, Iterable
from datetime import datetime, timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset, IterableDataset

from meshtrain.callbacks import Callback
from meshtrain.checkpoint.state import load_checkpoint, save_checkpoint
from meshtrain.data.sampler import GlobalBatchSampler
from meshtrain.errors import ConfigError, WorkerFailed
from meshtrain.fault import StepGuard, set_collective_timeout
from meshtrain.fault import check_settings as check_fault_tolerance_settings
from meshtrain.launch.spawn import DistEnv, ScriptWorkers, init_process_group
from meshtrain.parallel.data_parallel import allreduce_gradients
from meshtrain.parallel.apply import (
    ParallelOptions, build_optimizer, check_model, gradient_sync, loss_context, parallelize,
)
from meshtrain.parallel.data_parallel import check_comm_hook
from meshtrain.parallel.layout import Layout
from meshtrain.precision import Precision, check_precision

ModelLike = torch.nn.Module | Callable[[], torch.nn.Module]
DataLike = Dataset | DataLoader


def _positive(name: str, value, allow_none: bool = True) -> None:
    if value is None and allow_none:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"{name} must be a positive integer, got {value!r}")


class Trainer:
    """Train a model under a parallel ``layout`` on ``devices`` processes.

    Args:
        layout: e.g. ``"dp=2"`` (see :mod:`meshtrain.parallel.layout`); default: data parallel
            over all processes.
        devices: processes on this machine when started with plain ``python``; under
            ``meshtrain run``/torchrun the launcher decides and this must match or be ``"auto"``.
        accelerator: ``"cpu"``, ``"cuda"`` or ``"auto"``.
        max_steps / max_epochs: when to stop (at least one).
        global_batch_size: samples per optimizer step over all ranks.
        micro_batch_size: samples per forward pass on one rank; default: as large as possible
            (no accumulation). Accumulation = global / (dp * micro).
        grad_clip_norm: clip gradients by their global L2 norm.
        log_grad_norm: log ``train/grad_norm``, the global L2 norm of the gradients before
            clipping (over every shard and stage); ``trainer.grad_norm`` holds the last step's
            whenever it is computed (always when clipping, where it is free).
        precision: ``"fp32"``, ``"bf16-mixed"`` or ``"fp16-mixed"`` (GPU).
        val_every_n_steps: validate every N optimizer steps (and at the end of fit).
        limit_val_batches: use at most this many validation micro-batches per rank.
        log_every_n_steps: how often the loss is averaged over ranks and logged.
        run_dir: where logs and checkpoints go; default ``<root_dir>/<name>/<timestamp>``.
        bucket_cap_mb, comm_hook, powersgd_rank: DDP settings (``comm_hook`` in fp16, bf16,
            powersgd; ``bucket_cap_mb`` default 25); an error under a layout without DDP.
        sequence_parallel, loss_parallel, tp_plan: tensor-parallel settings (need ``tp``).
    """

    def __init__(
        self,
        *,
        layout: str | dict | Layout | None = None,
        devices: int | str = 1,
        accelerator: str = "auto",
        max_steps: int | None = None,
        max_epochs: int | None = None,
        global_batch_size: int = 32,
        micro_batch_size: int | None = None,
        grad_clip_norm: float | None = None,
        log_grad_norm: bool = False,
        precision: str = "fp32",
        seed: int = 0,
        shuffle: bool = True,
        val_every_n_steps: int | None = None,
        limit_val_batches: int | None = None,
        log_every_n_steps: int = 10,
        callbacks: Iterable[Callback] = (),
        loggers: Iterable[str] = ("csv", "tensorboard"),
        root_dir: str | os.PathLike = "runs",
        name: str = "run",
        run_dir: str | os.PathLike | None = None,
        save_final_checkpoint: bool = True,
        progress_bar: bool = True,
        num_workers: int = 0,
        bucket_cap_mb: float | None = None,
        comm_hook: str | None = None,
        powersgd_rank: int = 1,
        offload: str | None = None,
        activation_checkpointing: str | None = None,
        blocks: Callable[[torch.nn.Module], Iterable[torch.nn.Module]] | None = None,
        meta_init: bool | str = "auto",
        pp_schedule: str = "1f1b",
        stages_per_rank: int = 1,
        pp_balance: str = "params",
        split_points: list[int] | None = None,
        sequence_parallel: bool = False,
        loss_parallel: bool = False,
        tp_plan: dict | None = None,
        collective_timeout_s: float = 300.0,
        init_timeout_s: float = 600.0,
        stall_timeout_s: float | None = 240.0,
        debug_collectives: bool = False,
        checkpoint_every_n_steps: int | None = None,
        checkpoint_every_n_minutes: float | None = None,
        keep_last_k: int | None = None,
        async_checkpoint: bool = False,
        resume: str | os.PathLike | None = "auto",
        nan_policy: str | None = "error",
        mtbf_hours: float = 3.0,
    ):
        if max_steps is None and max_epochs is None:
            raise ConfigError("set max_steps or max_epochs (or both) so training knows when to stop")
        _positive("max_steps", max_steps)
        _positive("max_epochs", max_epochs)
        _positive("global_batch_size", global_batch_size, allow_none=False)
        _positive("micro_batch_size", micro_batch_size)
        _positive("val_every_n_steps", val_every_n_steps)
        _positive("limit_val_batches", limit_val_batches)
        _positive("log_every_n_steps", log_every_n_steps, allow_none=False)
        if grad_clip_norm is not None and not grad_clip_norm > 0:
            raise ConfigError(f"grad_clip_norm must be positive, got {grad_clip_norm}")
        if num_workers < 0:
            raise ConfigError(f"num_workers must be >= 0, got {num_workers}")
        check_comm_hook(comm_hook, powersgd_rank)
        if activation_checkpointing not in (None, "full", "selective"):
            raise ConfigError(
                f"activation_checkpointing must be 'full', 'selective' or None, got "
                f"{activation_checkpointing!r}"
            )
        if meta_init not in (True, False, "auto"):
            raise ConfigError(f"meta_init must be True, False or 'auto', got {meta_init!r}")

        self.device_type = _resolve_accelerator(accelerator)
        check_precision(precision, self.device_type)
        self._env = DistEnv.from_environ()
        self.world_size = self._resolve_world_size(devices)
        self.layout = Layout.parse(layout, self.world_size)
        if offload is not None:
            from meshtrain.parallel.fully_shard import check_offload

            check_offload(offload, self.device_type)
            if not self.layout.is_sharded:
                raise ConfigError(
                    f"offload={offload!r} moves sharded state to CPU memory and needs a sharded "
                    f"layout (zero2/zero3/dp_shard); the layout is {self.layout}"
                )
        _check_settings_apply(self.layout, bucket_cap_mb=bucket_cap_mb, comm_hook=comm_hook,
                              powersgd_rank=powersgd_rank, sequence_parallel=sequence_parallel,
                              loss_parallel=loss_parallel, tp_plan=tp_plan)
        dp = self.layout.dp_degree
        pp = self.layout.degree("pp")
        if pp > 1 and micro_batch_size is None and global_batch_size % dp == 0:
            # enough micro-batches to fill the pipeline: one per stage
            per_dp, fill = global_batch_size // dp, pp * stages_per_rank
            micro_batch_size = per_dp // fill if per_dp % fill == 0 else per_dp
        if micro_batch_size is None:
            if global_batch_size % dp:
                raise ConfigError(
                    f"global_batch_size={global_batch_size} does not divide over {dp} "
                    f"data-parallel ranks; use a multiple of {dp}"
                )
            micro_batch_size = global_batch_size // dp
        if global_batch_size % (dp * micro_batch_size):
            raise ConfigError(
                f"global_batch_size={global_batch_size} is not a multiple of data-parallel "
                f"degree x micro_batch_size = {dp} x {micro_batch_size} = {dp * micro_batch_size}; "
                f"choose a global batch that is a multiple of {dp * micro_batch_size}, or a "
                f"micro_batch_size that divides {global_batch_size // dp}"
            )

        self.max_steps, self.max_epochs = max_steps, max_epochs
        self.global_batch_size, self.micro_batch_size = global_batch_size, micro_batch_size
        self.grad_accum_steps = global_batch_size // (dp * micro_batch_size)
        # Under pp the pipeline schedule runs the micro-batches of a step, not the loop.
        self.num_microbatches = self.grad_accum_steps if pp > 1 else 1
        self._loader_batch_size = global_batch_size // dp if pp > 1 else micro_batch_size
        self.pp_options = dict(schedule=pp_schedule, stages_per_rank=stages_per_rank,
                               balance=pp_balance, split_points=split_points)
        if pp == 1 and (stages_per_rank != 1 or split_points is not None):
            raise ConfigError("stages_per_rank and split_points need a pipeline layout (pp=N)")
        if pp_balance not in ("params", "time", "memory"):
            raise ConfigError(f"pp_balance must be 'params', 'time' or 'memory', got {pp_balance!r}")
        self.grad_clip_norm, self.precision_name, self.seed = grad_clip_norm, precision, seed
        if not isinstance(log_grad_norm, bool):
            raise ConfigError(f"log_grad_norm must be True or False, got {log_grad_norm!r}")
        self.log_grad_norm = log_grad_norm
        self.grad_norm: torch.Tensor | None = None  # the last step's, before clipping
        self.shuffle = shuffle
        self.val_every_n_steps, self.limit_val_batches = val_every_n_steps, limit_val_batches
        self.log_every_n_steps = log_every_n_steps
        self.callbacks = list(callbacks)
        self.logger_names = _check_loggers(loggers)
        self.root_dir, self.name = Path(root_dir), name
        self._run_dir_arg = Path(run_dir) if run_dir else None
        self.save_final_checkpoint, self.progress_bar = save_final_checkpoint, progress_bar
        self.num_workers = num_workers
        self.parallel_options = ParallelOptions(
            bucket_cap_mb=25.0 if bucket_cap_mb is None else bucket_cap_mb, comm_hook=comm_hook,
            powersgd_rank=powersgd_rank,
            precision=precision, offload=offload,
            activation_checkpointing=activation_checkpointing, blocks=blocks,
            sequence_parallel=sequence_parallel, loss_parallel=loss_parallel,
            tp_plan=tp_plan if tp_plan is not None else _builtin_tp_plan(
                self.layout.degree("tp"), sequence_parallel, loss_parallel),
        )
        self.meta_init = meta_init
        check_fault_tolerance_settings(
            collective_timeout_s=collective_timeout_s, init_timeout_s=init_timeout_s,
            stall_timeout_s=stall_timeout_s, checkpoint_every_n_steps=checkpoint_every_n_steps,
            checkpoint_every_n_minutes=checkpoint_every_n_minutes, keep_last_k=keep_last_k,
            async_checkpoint=async_checkpoint, resume=resume, nan_policy=nan_policy,
            mtbf_hours=mtbf_hours,
        )
        self.collective_timeout = timedelta(seconds=collective_timeout_s)
        self.init_timeout = timedelta(seconds=init_timeout_s)
        self.stall_timeout_s, self.debug_collectives = stall_timeout_s, debug_collectives
        self.checkpoint_options = dict(
            every_n_steps=checkpoint_every_n_steps, every_n_minutes=checkpoint_every_n_minutes,
            keep_last_k=keep_last_k, async_save=async_checkpoint,
        )
        self.resume, self.nan_policy, self.mtbf_hours = resume, nan_policy, mtbf_hours

        # Set by fit / the set-up that follows it.
        self.mesh = None
        self._dp_mesh = None  # the data-parallel axes flattened into one (set with the mesh)
        self.rank = self._env.rank if self._env else 0
        self.local_rank = self._env.local_rank if self._env else 0
        self.model: torch.nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.lr_scheduler = None
        self.global_step, self.current_epoch = 0, 0
        self.should_stop = False
        self.callback_metrics: dict[str, float] = {}
        self.run_dir: Path | None = None
        self._workers: ScriptWorkers | None = None
        self._loggers: list = []
        self._train_sampler: GlobalBatchSampler | None = None
        self._val_data = None
        self._loss_fn = None
        self._pipeline = None  # PipelineRunner under pp
        self._guard: StepGuard | None = None  # checkpoints, NaN/Inf, watchdog (fault.py)
        self._resume_from: Path | None = None
        self.num_skipped_steps, self.num_rollbacks = 0, 0

    # ------------------------------------------------------------------------------------------
    # properties and small helpers
    # ------------------------------------------------------------------------------------------
    @property
    def is_global_zero(self) -> bool:
        return self.rank == 0

    @property
    def dp_rank(self) -> int:
        """This rank's index among the ranks that see different data."""
        return self._dp_mesh.get_local_rank() if self._dp_mesh is not None else 0

    def _dp_group(self):
        return self._dp_mesh.get_group()

    def print(self, *args, **kwargs) -> None:
        """``print`` on global rank zero only (through the progress bar when one is live)."""
        if not self.is_global_zero:
            return
        bar = getattr(self, "_bar", None)
        if bar is not None and bar.enabled:
            bar.log(" ".join(str(a) for a in args))
        else:
            print(*args, **kwargs, flush=True)

    def _resolve_world_size(self, devices) -> int:
        if self._env is not None:
            if devices not in ("auto", 1, self._env.world_size):
                raise ConfigError(
                    f"Trainer(devices={devices}) but the launcher started "
                    f"{self._env.world_size} processes; make them agree or use devices='auto'"
                )
            return self._env.world_size
        if devices == "auto":
            return torch.cuda.device_count() if self.device_type == "cuda" else 1
        _positive("devices", devices, allow_none=False)
        if self.device_type == "cuda" and devices > torch.cuda.device_count():
            raise ConfigError(
                f"devices={devices} but only {torch.cuda.device_count()} GPUs are visible"
            )
        return devices

    # ------------------------------------------------------------------------------------------
    # processes, mesh, model
    # ------------------------------------------------------------------------------------------
    def _setup_world(self) -> None:
        """Start the other processes if needed and create the process group and mesh (once)."""
        if self.world_size == 1 or self.mesh is not None:
            self.device = self._device(0)
            return
        env = self._env
        if env is None:  # plain `python script.py` with devices=N: become rank 0
            self._workers = ScriptWorkers(self.world_size, self.init_timeout)
            env = self._env = DistEnv.from_environ()
        if self.device_type == "cpu" and "OMP_NUM_THREADS" not in os.environ:
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // env.local_world_size))
        self.rank, self.local_rank = env.rank, env.local_rank
        self.device = self._device(env.local_rank)
        if not dist.is_initialized():
            backend = "nccl" if self.device_type == "cuda" else "gloo"
            if self.debug_collectives:
                from meshtrain.observe.desync import enable_collective_checks

                enable_collective_checks()
                self.print("debug_collectives: every collective is first checked across ranks "
                           "(a few ms each); use it to find a desync, not for speed")
            # long enough for start-up and the first step; shortened after it
            init_process_group(env, backend, self.init_timeout)
        self.mesh = self.layout.build_mesh(self.device_type)
        # the mesh's sub-groups get torch's 30-minute default, not init_process_group's timeout
        set_collective_timeout(self.init_timeout)
        if self.layout.dp_degree > 1:  # all data-parallel axes as one, built once
            self._dp_mesh = self.mesh[self.layout.data_parallel_axes]._flatten()

    def _device(self, local_rank: int) -> torch.device:
        if self.device_type == "cuda":
            torch.cuda.set_device(local_rank)
            return torch.device("cuda", local_rank)
        return torch.device("cpu")

    def _setup_run_dir(self) -> None:
        if self.run_dir is not None:
            return
        path, resume_from = self._run_dir_arg, None
        if self.is_global_zero:  # rank 0 decides; the others follow (broadcast below)
            from meshtrain.checkpoint.resume import find_checkpoint

            resume_from, resumed_run = find_checkpoint(
                self.resume, run_dir=path, root_dir=self.root_dir, name=self.name)
            path = path or resumed_run
            if path is None:
                stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
                path = self.root_dir / self.name / stamp
        if dist.is_initialized():  # every rank writes checkpoints into rank 0's folder
            box = [str(path), resume_from and str(resume_from)]
            dist.broadcast_object_list(box, src=0)
            path, resume_from = Path(box[0]), box[1] and Path(box[1])
        self.run_dir, self._resume_from = path, resume_from
        if self.is_global_zero:
            path.mkdir(parents=True, exist_ok=True)
            self._loggers = _make_loggers(self.logger_names, path)
            for logger in self._loggers:
                logger.log_hparams(self.hparams())

    def hparams(self) -> dict:
        return {
            "layout": str(self.layout), "world_size": self.world_size,
            "global_batch_size": self.global_batch_size, "micro_batch_size": self.micro_batch_size,
            "grad_accum_steps": self.grad_accum_steps, "precision": self.precision_name,
            "max_steps": self.max_steps, "max_epochs": self.max_epochs, "seed": self.seed,
            "grad_clip_norm": self.grad_clip_norm, "log_grad_norm": self.log_grad_norm,
            "comm_hook": self.parallel_options.comm_hook,
            "nan_policy": self.nan_policy, "collective_timeout_s":
            self.collective_timeout.total_seconds(), "stall_timeout_s": self.stall_timeout_s,
            **{f"checkpoint_{k}": v for k, v in self.checkpoint_options.items()},
        }

    # ------------------------------------------------------------------------------------------
    # fit
    # ------------------------------------------------------------------------------------------
    def fit(
        self,
        model: ModelLike,
        train_data: DataLike,
        val_data: DataLike | None = None,
        *,
        optimizer: Callable,
        loss_fn: Callable | None = None,
        lr_scheduler: Callable | None = None,
        ckpt_path: str | os.PathLike | None = None,
    ) -> torch.nn.Module:
        """Train ``model`` and return it (the same module object the user passed or built).

        ``optimizer`` is a factory ``params -> Optimizer``; ``lr_scheduler`` a factory
        ``optimizer -> LRScheduler`` stepped every optimizer step. With ``loss_fn`` each batch
        is ``(inputs, targets)`` and the loss is ``loss_fn(model(inputs), targets)``; without it
        the model is called on the batch and returns the loss. ``ckpt_path`` resumes training.
        """
        self._prepare(model, train_data, val_data, optimizer=optimizer, loss_fn=loss_fn,
                      lr_scheduler=lr_scheduler, ckpt_path=ckpt_path)
        self.print(f"run folder: {self.run_dir}")
        try:
            if self.debug_collectives and dist.is_initialized():
                from meshtrain.observe.desync import collective_check_context

                with collective_check_context():
                    self._fit_loop(self._train_loader)
            else:
                self._fit_loop(self._train_loader)
            _drain_collectives()
        except BaseException as error:
            self._call("on_exception", error)
            if self._workers is not None:
                self._workers.raise_if_failed(error)
            raise
        finally:
            for logger in self._loggers:
                logger.finalize()
        self.print(f"run folder: {self.run_dir}")  # again, below the training output
        return self.model

    def lr_find(self, model: ModelLike, train_data: DataLike, *, optimizer: Callable,
                loss_fn: Callable | None = None, min_lr: float = 1e-6, max_lr: float = 1.0,
                num_steps: int = 100):
        """Learning-rate range test; see :func:`meshtrain.lr_find.lr_find`."""
        from meshtrain.lr_find import lr_find

        return lr_find(self, model, train_data, optimizer=optimizer, loss_fn=loss_fn,
                       min_lr=min_lr, max_lr=max_lr, num_steps=num_steps)

    def _prepare(self, model, train_data, val_data, *, optimizer, loss_fn, lr_scheduler,
                 ckpt_path=None) -> None:
        """Check the inputs, then create processes, model, optimizer and data loaders."""
        _check_model(model)
        _check_factory("optimizer", optimizer, required=True)
        _check_factory("lr_scheduler", lr_scheduler, required=False)
        _check_optimizer_factory(optimizer)
        self._meta_model = _inspect_model(model)
        if self._meta_model is not None:
            check_model(self._meta_model, self.layout, self.parallel_options)
        if self.layout.degree("pp") > 1:
            self._check_pipeline(loss_fn)
        train_set = _dataset_of(train_data, "train_data")
        if self.layout.degree("pp") > 1 and self.pp_options["balance"] != "params":
            first = train_set[0]
            self._sample_inputs = torch.stack(
                [train_set[i][0] for i in range(min(len(train_set), self.micro_batch_size))]
            ) if isinstance(first, (tuple, list)) else None
        if val_data is not None:
            _dataset_of(val_data, "val_data")
        if len(train_set) < self.global_batch_size:
            raise ConfigError(
                f"train_data has {len(train_set)} samples, fewer than one global batch of "
                f"{self.global_batch_size}; lower global_batch_size or add data"
            )
        if ckpt_path is not None and not Path(ckpt_path).exists():
            raise ConfigError(f"ckpt_path {ckpt_path} does not exist")

        self._setup_world()
        try:
            self._setup_run_dir()
            self._loss_fn = loss_fn
            self._setup_model(model, optimizer, lr_scheduler)
            self._train_sampler = GlobalBatchSampler(
                len(train_set), global_batch_size=self.global_batch_size,
                micro_batch_size=self._loader_batch_size, dp_rank=self.dp_rank,
                dp_degree=self.layout.dp_degree, shuffle=self.shuffle, seed=self.seed,
            )
            self._train_loader = self._loader(train_set, train_data, self._train_sampler)
            self._val_data = val_data
            self._guard = StepGuard(self)
            start_from = Path(ckpt_path) if ckpt_path is not None else self._resume_from
            if start_from is not None:
                self.load_checkpoint(start_from)
                self.print(f"resumed from {start_from} at step {self.global_step}")
        except BaseException as error:
            if self._workers is not None:
                self._workers.raise_if_failed(error)
            raise

    def _setup_model(self, model: ModelLike, optimizer_factory, scheduler_factory) -> None:
        """Build (or take) the model, apply the layout, then create the optimizer."""
        torch.manual_seed(self.seed)  # identical initial parameters on every rank
        # (not under pp: a stage cannot re-run the full model's initialisation by itself)
        on_meta = (
            self.layout.is_sharded and self.meta_init is not False
            and self.layout.degree("pp") == 1
            and not isinstance(model, torch.nn.Module) and self._meta_model is not None
            and _supports_meta_init(self._meta_model)
        )
        if self.meta_init is True and not on_meta:
            raise ConfigError(
                "meta_init=True needs a sharded layout, a model factory (not a built module) "
                "and a model that supports sharded init (supports_sharded_init = True and "
                "init_weights()); use meta_init='auto' to fall back quietly"
            )
        if on_meta:  # each rank allocates only its own shards
            model = self._meta_model
        elif not isinstance(model, torch.nn.Module):
            model = model()
        if not isinstance(model, torch.nn.Module):
            raise ConfigError(
                f"the model factory returned {type(model).__name__}, not a torch.nn.Module"
            )
        check_model(model, self.layout, self.parallel_options)
        self.model = model if on_meta else model.to(self.device)
        self.precision = Precision(self.precision_name, self.device_type)
        if self.layout.degree("pp") > 1:
            self.model = self._train_module = self._setup_pipeline(self.model)
        else:
            self._train_module = parallelize(
                self.model, self.layout, self.mesh, device=self.device,
                options=self.parallel_options,
            )
        if on_meta:
            from meshtrain.parallel.fully_shard import materialize

            materialize(self.model, self.device)
        self.optimizer = build_optimizer(self.model, optimizer_factory, self.layout, self.mesh)
        if not isinstance(self.optimizer, torch.optim.Optimizer):
            raise ConfigError(
                f"the optimizer factory returned {type(self.optimizer).__name__}, not a "
                "torch.optim.Optimizer; write e.g. optimizer=lambda params: AdamW(params, lr=1e-3)"
            )
        self.lr_scheduler = scheduler_factory(self.optimizer) if scheduler_factory else None
        self._meta_model = None
        # Different dropout masks per rank, reproducible per rank.
        torch.manual_seed(self.seed + 1 + self.rank)

    # ------------------------------------------------------------------------------------------
    # pipeline parallel
    # ------------------------------------------------------------------------------------------
    def _check_pipeline(self, loss_fn) -> None:
        from meshtrain.parallel.pipeline import check_pipeline, pipeline_blocks

        if loss_fn is None:
            raise ConfigError(
                "pipeline layouts need loss_fn: the last stage computes loss_fn(output, targets) "
                "on each micro-batch; pass loss_fn= to fit"
            )
        if self._meta_model is None:
            return  # a factory that cannot build on meta: checked when it is built
        opts = self.pp_options
        check_pipeline(
            len(pipeline_blocks(self._meta_model)), self.layout.degree("pp"),
            schedule=opts["schedule"], num_microbatches=self.num_microbatches,
            stages_per_rank=opts["stages_per_rank"],
            batch_size=self.global_batch_size // self.layout.dp_degree,
        )
        if self.layout.is_sharded and opts["schedule"] in ("zero-bubble", "zbv", "dualpipev"):
            raise ConfigError(
                f"pp_schedule={opts['schedule']!r} with a sharded layout gives wrong gradients "
                "in torch 2.13 (per-block FSDP under zero-bubble schedules); use 1f1b, gpipe or "
                "interleaved-1f1b with dp_shard, or plain dp with the zero-bubble schedules"
            )

    def _setup_pipeline(self, model: torch.nn.Module) -> torch.nn.Module:
        """Split ``model`` into stages, keep this rank's, parallelize them, build the runner."""
        from meshtrain.parallel.partition import partition_blocks
        from meshtrain.parallel.pipeline import (
            PipelineRunner, merge_stages, pipeline_blocks, rank_stages, split_model,
        )

        opts, pp = self.pp_options, self.layout.degree("pp")
        num_stages = pp * opts["stages_per_rank"]
        blocks = pipeline_blocks(model)
        split = partition_blocks(blocks, num_stages, balance=opts["balance"],
                                 sample_input=self._sample_block_input(model),
                                 split_points=opts["split_points"])
        indices = rank_stages(self.mesh["pp"].get_local_rank(), pp, opts["stages_per_rank"],
                              opts["schedule"])
        stages = [split_model(model, split, i) for i in indices]
        stage_options = dataclasses.replace(self.parallel_options, blocks=pipeline_blocks)
        for stage in stages:
            parallelize(stage, self.layout, self.mesh, device=self.device, options=stage_options)
        self._pipeline = PipelineRunner(
            stages, indices, num_stages, self.mesh["pp"], self.device,
            schedule=opts["schedule"], num_microbatches=self.num_microbatches,
            loss_fn=self._loss_fn,
        )
        self._pp_split_points = split
        if self.is_global_zero:
            self.print(f"pipeline: {num_stages} stages split before blocks {split} "
                       f"({opts['balance']}-balanced), schedule {opts['schedule']}, "
                       f"{self.num_microbatches} micro-batches")
        return merge_stages(stages)

    def _sample_block_input(self, model):
        """The hidden state entering the first block, for time/memory balancing."""
        if self.pp_options["balance"] == "params" or self.pp_options["split_points"]:
            return None
        embed = getattr(model, "embed", None)
        if not callable(embed):
            raise ConfigError(
                f"pp_balance={self.pp_options['balance']!r} measures each block on a sample "
                "input, which needs model.embed(x); use pp_balance='params' or split_points="
            )
        inputs = _to_device(self._sample_inputs, self.device)
        with torch.no_grad():
            return embed(inputs[: self.micro_batch_size])

    def _loader(self, dataset, original, batch_sampler) -> DataLoader:
        collate = original.collate_fn if isinstance(original, DataLoader) else None
        workers = original.num_workers if isinstance(original, DataLoader) else self.num_workers
        # Every iter(loader) draws a worker seed from this generator; from the global one it would
        # shift the stream that dropout uses, so a resumed (or validated) run would diverge.
        generator = torch.Generator().manual_seed(self.seed + self.rank)
        return DataLoader(
            dataset, batch_sampler=batch_sampler, collate_fn=collate, num_workers=workers,
            pin_memory=self.device_type == "cuda", persistent_workers=workers > 0,
            generator=generator,
        )

    def _total_steps(self) -> int:
        per_epoch = self._train_sampler.num_global_batches
        by_epochs = self.max_epochs * per_epoch if self.max_epochs else math.inf
        return int(min(self.max_steps or math.inf, by_epochs))

    def _fit_loop(self, loader: DataLoader) -> None:
        from meshtrain.observe.memory import MemoryProbe
        from meshtrain.observe.progress import ProgressBar

        total = self._total_steps()
        self.should_stop = False
        self._call("on_fit_start")
        self._bar = ProgressBar(total, enabled=self.progress_bar and self.is_global_zero)
        self._bar.start()
        memory = MemoryProbe(self.model, self.optimizer, self.layout) if self.is_global_zero else None
        sampler = self._train_sampler
        epoch_samples = sampler.num_global_batches * self.global_batch_size
        tokens = 0
        window_loss = torch.zeros((), device=self.device)
        window_steps, window_start = 0, time.perf_counter()
        validated_at = None  # the step of the last validation
        guard = self._guard
        guard.start()
        try:
            while self.global_step < total and not self.should_stop:
                if sampler.consumed_samples >= epoch_samples:
                    self.current_epoch += 1
                    sampler.set_epoch(self.current_epoch)
                self._call("on_train_epoch_start")
                batches = iter(loader)
                while self.global_step < total and not self.should_stop:
                    if sampler.consumed_samples >= epoch_samples:
                        break
                    if guard.skip_bad_batch():  # a batch that a rollback ruled out
                        batches = iter(loader)
                        continue
                    self._call("on_train_step_start")
                    guard.step_begins()
                    loss, step_tokens, outcome = self._train_step(batches)
                    guard.step_ends(outcome)
                    if outcome == "rollback":
                        guard.rollback()
                        batches = iter(loader)
                        window_loss.zero_()
                        window_steps, tokens, window_start = 0, 0, time.perf_counter()
                        continue
                    sampler.advance()
                    self.global_step += 1
                    if memory is not None and memory.row is not None:
                        self._report_memory(memory)
                        memory = None
                    if outcome == "ok":
                        window_loss += loss
                        window_steps += 1
                    tokens += step_tokens
                    metrics: dict[str, float] = {}
                    if self.global_step % self.log_every_n_steps == 0 or self.global_step == total:
                        elapsed = time.perf_counter() - window_start
                        if window_steps:  # every rank skips alike, so this agrees
                            metrics["train/loss"] = self._mean_over_dp(window_loss / window_steps)
                        metrics["train/tokens_per_s"] = tokens * self.layout.dp_degree / elapsed
                        metrics["epoch"] = self.current_epoch
                        if self.log_grad_norm and self.grad_norm is not None:
                            metrics["train/grad_norm"] = float(self.grad_norm)
                        if self.num_skipped_steps:
                            metrics["train/skipped_steps"] = self.num_skipped_steps
                        window_loss.zero_()
                        window_steps, tokens, window_start = 0, 0, time.perf_counter()
                    self._call("on_train_step_end", metrics)
                    if metrics:
                        self.callback_metrics.update(metrics)
                        self.log_metrics(metrics)
                        self._bar.update(self.global_step, {
                            "loss": metrics.get("train/loss"),
                            "tokens_per_s": metrics.get("train/tokens_per_s"),
                        })
                    if self._val_data is not None and self.val_every_n_steps and (
                        self.global_step % self.val_every_n_steps == 0
                    ) and self.global_step < total:
                        self._run_validation()
                        validated_at = self.global_step
                    guard.after_step(total)
                self._call("on_train_epoch_end")
            # not again when a validation just stopped training early (same weights)
            if self._val_data is not None and validated_at != self.global_step:
                self._run_validation()
            guard.checkpoints.wait()
            if self.save_final_checkpoint:
                self.save_checkpoint(self.run_dir / "checkpoints" / "final")
            self._call("on_fit_end")
        finally:
            guard.stop()
            self._bar.close()
            if memory is not None:  # fit ended before the first step: take the hooks off
                memory.remove()
            self._bar = None
        if self.is_global_zero:
            self._plot_losses()

    def _report_memory(self, probe) -> None:
        """Rank zero's model-state bytes after the first step, beside the ZeRO formula."""
        text = probe.summary()
        self.print(text)
        (self.run_dir / "memory.txt").write_text(text + "\n")

    def _train_step(self, batches) -> tuple[torch.Tensor, int, str]:
        """One optimizer step over this rank's micro-batches.

        Returns (loss, tokens seen here, outcome): outcome "ok", "skip" (update dropped) or
        "rollback" (nothing changed yet; the caller restores the last checkpoint)."""
        if self._pipeline is not None:
            return self._pipeline_step(batches)
        module, accum = self._train_module, self.grad_accum_steps
        total_loss = torch.zeros((), device=self.device)
        num_tokens = 0
        for micro_step in range(accum):
            batch = _to_device(next(batches), self.device)
            num_tokens += _count_tokens(batch)
            last = micro_step == accum - 1
            with gradient_sync(module, self.model, enabled=last), self._loss_context():
                with self.precision.autocast():
                    loss = self._compute_loss(module, batch) / accum
                self.precision.backward(loss)
            total_loss += _plain(loss.detach())
        outcome = self._finish_step(total_loss)
        return total_loss, num_tokens, outcome

    def _pipeline_step(self, batches) -> tuple[torch.Tensor, int, str]:
        """One optimizer step: the schedule runs this rank's stages over all micro-batches."""
        inputs, targets = _to_device(next(batches), self.device)
        record = self.global_step == 1  # the second step: past one-time start-up costs
        with self.precision.autocast(), self._loss_context():
            if record:
                loss, events = self._pipeline.timed_step(inputs, targets)
            else:  # None unless this rank has the last stage
                loss = self._pipeline.step(inputs, targets)
        if record and self.is_global_zero:
            self._report_timeline(events)
        loss = loss.detach() if loss is not None else torch.zeros((), device=self.device)
        outcome = self._finish_step(loss)
        return loss, _count_tokens(inputs), outcome

    def _finish_step(self, loss: torch.Tensor) -> str:
        """Reduce what DDP/FSDP did not, agree on the step's fate, clip by the global norm, step,
        zero the gradients. Returns "ok", "skip" or "rollback" (see ``nan_policy``)."""
        if self._needs_grad_allreduce():
            allreduce_gradients(self.model.parameters(), self._dp_group())
        outcome = self._guard.decide(loss)
        if outcome != "ok":
            self.optimizer.zero_grad(set_to_none=True)
            self.precision.skip_step()
            return outcome
        measure = self.grad_clip_norm is not None or self.log_grad_norm
        if measure:
            self.precision.unscale(self.optimizer)
        self._call("on_before_optimizer_step")
        self.grad_norm = self._clip_gradients() if measure else None
        self.precision.step(self.optimizer)
        self.optimizer.zero_grad(set_to_none=True)
        if self.lr_scheduler is not None:
            self.lr_scheduler.step()
        return "ok"

    def _clip_gradients(self) -> torch.Tensor:
        """The gradients' global L2 norm before clipping (over every shard and pipeline stage,
        the same on every rank); clips them to ``grad_clip_norm`` when it is set."""
        params = list(self.model.parameters())
        if self._pipeline is not None:  # each rank holds its stages: sum over the pp group
            from meshtrain.parallel.pipeline import clip_grad_norm_

            norm = clip_grad_norm_(params, self.grad_clip_norm, self.mesh["pp"])
        elif self.grad_clip_norm is not None:
            norm = torch.nn.utils.clip_grad_norm_(params, self.grad_clip_norm)
        else:
            norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
        return _plain(norm).detach()

    def _report_timeline(self, events) -> None:
        """The pipeline diagram of one step, and its measured bubble beside the formula."""
        from meshtrain.parallel.pipeline import (
            bubble_fraction, ideal_bubble_fraction, plot_timeline,
        )

        opts, pp = self.pp_options, self.layout.degree("pp")
        ideal = ideal_bubble_fraction(pp, self.num_microbatches, opts["stages_per_rank"])
        measured = bubble_fraction(events)
        path = self.run_dir / "pipeline_timeline.png"
        plot_timeline(events, path, title=f"{opts['schedule']}, p={pp}, "
                      f"m={self.num_microbatches}: bubble {measured:.2f} (formula {ideal:.2f})")
        self.print(f"pipeline step {self.global_step + 1}: measured bubble {measured:.2f}, "
                   f"formula (p-1)/(v*m+p-1) = {ideal:.2f}; timeline: {path}")

    def _loss_context(self):
        return loss_context(self.layout, self.parallel_options)

    def _needs_grad_allreduce(self) -> bool:
        """Plain dp combined with pp or tp: DDP does not apply, gradients are averaged here."""
        return self.layout.averages_dp_gradients_by_hand

    def _compute_loss(self, module, batch) -> torch.Tensor:
        if self._loss_fn is not None:
            if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
                raise ConfigError(
                    "with loss_fn set, each batch must be (inputs, targets); got "
                    f"{type(batch).__name__}. Return such pairs from the dataset, or drop "
                    "loss_fn and let the model compute the loss"
                )
            inputs, targets = batch
            return self._loss_fn(module(inputs), targets)
        out = module(**batch) if isinstance(batch, dict) else (
            module(*batch) if isinstance(batch, (tuple, list)) else module(batch)
        )
        loss = out.get("loss") if isinstance(out, dict) else getattr(out, "loss", out)
        if not (isinstance(loss, torch.Tensor) and loss.numel() == 1):
            raise ConfigError(
                "without loss_fn the model must return the loss (a scalar tensor, or an object "
                f"with .loss / ['loss']); it returned {type(out).__name__}. Pass loss_fn="
            )
        return loss

    def _mean_over_dp(self, value: torch.Tensor) -> float:
        if self._pipeline is not None:  # only the last stage has the loss; the others hold 0
            value = value.detach().clone()
            dist.all_reduce(value, group=self.mesh.get_group("pp"))
        if self.layout.dp_degree > 1:
            value = value.detach().clone()
            dist.all_reduce(value, group=self._dp_group())
            value /= self.layout.dp_degree
        return float(value)

    # ------------------------------------------------------------------------------------------
    # validation and test
    # ------------------------------------------------------------------------------------------
    def _run_validation(self) -> dict[str, float]:
        self._call("on_validation_start")
        metrics = self._evaluate(self._val_data, prefix="val")
        self.callback_metrics.update(metrics)
        self.log_metrics(metrics)
        self._call("on_validation_end", metrics)
        if self.is_global_zero:
            self.print(f"step {self.global_step}: " + ", ".join(
                f"{k} {v:.4f}" for k, v in metrics.items()))
        return metrics

    def validate(self, val_data: DataLike | None = None) -> dict[str, float]:
        """Mean loss over ``val_data`` (default: the fit's validation data) on the fitted model."""
        data = val_data if val_data is not None else self._val_data
        if self.model is None or data is None:
            raise ConfigError("call fit(...) first, and pass val_data here or to fit")
        return self._evaluate(data, prefix="val")

    def test(self, test_data: DataLike) -> dict[str, float]:
        """Mean loss over all of ``test_data`` on the fitted model (``limit_val_batches`` is for
        validation only)."""
        if self.model is None:
            raise ConfigError("call fit(...) before test(...)")
        metrics = self._evaluate(test_data, prefix="test")
        self.log_metrics(metrics)
        return metrics

    @torch.no_grad()
    def _evaluate(self, data: DataLike, prefix: str) -> dict[str, float]:
        """Sample-weighted mean loss; every sample is seen exactly once over all ranks (in
        validation, only the first ``limit_val_batches`` micro-batches per rank)."""
        limit = self.limit_val_batches if prefix == "val" else None
        dataset = _dataset_of(data, prefix)
        dp = self.layout.dp_degree
        sampler = GlobalBatchSampler(
            len(dataset), global_batch_size=dp * self.micro_batch_size,
            micro_batch_size=self.micro_batch_size, dp_rank=self.dp_rank, dp_degree=dp,
            shuffle=False, last_batch="partial",
        )
        loader = self._loader(dataset, data, sampler)
        was_training = self.model.training
        self.model.eval()
        totals = torch.zeros(2, dtype=torch.float64, device=self.device)  # loss sum, samples
        for i, batch in enumerate(loader):
            if limit is not None and i >= limit:
                break
            batch = _to_device(batch, self.device)
            with self.precision.autocast(), self._loss_context():
                if self._pipeline is not None:
                    loss = self._pipeline.eval_loss(*batch)
                else:
                    loss = self._compute_loss(self.model, batch)
            if loss is None:  # a pipeline rank without the last stage
                continue
            size = _batch_size(batch)
            totals[0] += _plain(loss).double() * size
            totals[1] += size
        self.model.train(was_training)
        if self._pipeline is not None:
            dist.all_reduce(totals, group=self.mesh.get_group("pp"))
        if dp > 1:
            dist.all_reduce(totals, group=self._dp_group())
        return {f"{prefix}/loss": float(totals[0] / totals[1].clamp(min=1))}

    # ------------------------------------------------------------------------------------------
    # checkpoints, logging, callbacks
    # ------------------------------------------------------------------------------------------
    def _trainer_state(self) -> dict:
        return {
            "global_step": self.global_step,
            "current_epoch": self.current_epoch,
            # `is not None`: the sampler has a __len__, which is 0 (falsy) at the end of an epoch
            "sampler": (
                self._train_sampler.state_dict() if self._train_sampler is not None else None
            ),
            "lr_scheduler": self.lr_scheduler.state_dict() if self.lr_scheduler else None,
            "grad_scaler": self.precision.state_dict(),
            "num_skipped_steps": self.num_skipped_steps,
            **self._run_identity(),
        }

    def _run_identity(self) -> dict:
        """What a resumed run is compared against (see checkpoint/resume.py)."""
        return {"global_batch_size": self.global_batch_size, "seed": self.seed,
                "shuffle": self.shuffle, "world_size": self.world_size, "layout": str(self.layout)}

    def _summary(self) -> dict:
        return {
            "step": self.global_step, "epoch": self.current_epoch, "layout": str(self.layout),
            "world_size": self.world_size, "metrics": self.callback_metrics,
            "hparams": self.hparams(),
        }

    def save_checkpoint(self, path: str | os.PathLike) -> Path | None:
        """Save model, optimizer and training position (collective: call on every rank).

        Returns the folder, or None when some rank holds NaN/Inf values: such a checkpoint is
        never written."""
        from meshtrain.checkpoint.manager import all_finite

        if not all_finite(self.model, self.optimizer):
            warnings.warn(f"step {self.global_step}: the model or optimizer holds NaN/Inf "
                          f"values; {path} was not written", stacklevel=2)
            return None
        return save_checkpoint(path, self.model, self.optimizer, self._trainer_state(),
                               self._summary())

    def load_checkpoint(self, path: str | os.PathLike) -> None:
        """Restore a checkpoint saved by :meth:`save_checkpoint` into the fitted model.

        Works across layouts and world sizes: model and optimizer are resharded by DCP, and the
        data continues at the same sample of the global order."""
        from meshtrain.checkpoint.resume import check_same_run, has_randomness, warn_rng_change

        path = Path(path)
        saved = torch.load(path / "trainer_state.pt", weights_only=False) if (
            path / "trainer_state.pt").is_file() else None
        if saved is not None:  # refuse before touching the model
            check_same_run(saved, self._run_identity())
        state = load_checkpoint(path, self.model, self.optimizer)
        if not warn_rng_change(state, self._run_identity(), has_randomness(self.model)):
            # the saved per-rank streams belong to other ranks: start reproducible new ones
            torch.manual_seed(self.seed + 1 + self.rank + 1_000_003 * state["global_step"])
        self.global_step = state["global_step"]
        self.current_epoch = state["current_epoch"]
        self.num_skipped_steps = state.get("num_skipped_steps", 0)
        if state["sampler"] is not None and self._train_sampler is not None:
            self._train_sampler.load_state_dict(state["sampler"])
        if self.lr_scheduler is not None and state["lr_scheduler"] is not None:
            self.lr_scheduler.load_state_dict(state["lr_scheduler"])
        self.precision.load_state_dict(state["grad_scaler"])

    def log_metrics(self, metrics: dict[str, float]) -> None:
        """Send metrics to the loggers (rank zero); values must already agree across ranks."""
        if self.is_global_zero:
            for logger in self._loggers:
                logger.log_metrics(metrics, self.global_step)

    def _call(self, hook: str, *args) -> None:
        for callback in self.callbacks:
            getattr(callback, hook)(self, *args)

    def _plot_losses(self) -> None:
        csv = self.run_dir / "metrics.csv"
        if not csv.exists():
            return
        from meshtrain.observe.loggers import read_metrics_csv
        from meshtrain.observe.plots import plot_loss_curves

        plot_loss_curves(read_metrics_csv(csv), self.run_dir / "loss.png", title=self.name)


# ----------------------------------------------------------------------------------------------
# input checks (all run before any process group exists)
# ----------------------------------------------------------------------------------------------
def _resolve_accelerator(accelerator: str) -> str:
    if accelerator == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if accelerator not in ("cpu", "cuda"):
        raise ConfigError(f"accelerator must be 'cpu', 'cuda' or 'auto', got {accelerator!r}")
    if accelerator == "cuda" and not torch.cuda.is_available():
        raise ConfigError("accelerator='cuda' but no GPU is visible; use 'cpu' or 'auto'")
    return accelerator


def _check_loggers(names: Iterable[str]) -> list[str]:
    names = [names] if isinstance(names, str) else list(names)
    for name in names:
        if name not in ("csv", "tensorboard"):
            raise ConfigError(f"unknown logger {name!r}; choose from 'csv', 'tensorboard'")
    return names


def _make_loggers(names: list[str], run_dir: Path) -> list:
    from meshtrain.observe.loggers import CSVLogger, TensorBoardLogger

    return [CSVLogger(run_dir) if n == "csv" else TensorBoardLogger(run_dir) for n in names]


def _check_settings_apply(layout: Layout, *, bucket_cap_mb, comm_hook, powersgd_rank,
                          sequence_parallel, loss_parallel, tp_plan) -> None:
    """A setting that would do nothing under ``layout`` is an error, not silently ignored."""
    ddp_settings = {"comm_hook": comm_hook, "bucket_cap_mb": bucket_cap_mb}
    for name, value in ddp_settings.items():
        if value is not None and not layout.uses_ddp:
            raise ConfigError(
                f"{name}={value!r} is a DDP setting, but the layout {layout} does not use DDP "
                f"({layout.why_not_ddp()}); drop {name}, or use a dp/zero1 layout"
            )
    if powersgd_rank != 1 and comm_hook != "powersgd":
        raise ConfigError(f"powersgd_rank={powersgd_rank} is used by comm_hook='powersgd' only "
                          f"(comm_hook is {comm_hook!r}); set both or neither")
    tp_settings = {"sequence_parallel": sequence_parallel, "loss_parallel": loss_parallel,
                   "tp_plan": tp_plan}
    for name, value in tp_settings.items():
        if value not in (None, False) and layout.degree("tp") == 1:
            raise ConfigError(
                f"{name} is a tensor-parallel setting, but the layout {layout} has no tp axis; "
                f"add tp=N to the layout or drop {name}"
            )


def _builtin_tp_plan(tp_degree: int, sequence_parallel: bool, loss_parallel: bool):
    """For models that supply no ``tp_plan`` of their own: meshtrain's plans for Hugging Face
    models (module -> plan, None for other models)."""
    from meshtrain.models.hf import default_tp_plan

    def plan_for(module):
        return default_tp_plan(module, tp_degree, sequence_parallel=sequence_parallel,
                               loss_parallel=loss_parallel)
    return plan_for if tp_degree > 1 else None


def _check_model(model) -> None:
    if not (isinstance(model, torch.nn.Module) or callable(model)):
        raise ConfigError(
            f"model must be a torch.nn.Module or a function that builds one, got "
            f"{type(model).__name__}"
        )


def _supports_meta_init(model: torch.nn.Module) -> bool:
    from meshtrain.parallel.fully_shard import supports_meta_init

    return supports_meta_init(model)


def _drain_collectives() -> None:
    """Let every rank finish before objects holding collectives (DDP, ZeRO) can be freed: in
    torch 2.13 freeing DDP while a gloo worker thread still finishes a backward-time collective
    can deadlock (seen about 1 run in 10 without this)."""
    if dist.is_initialized():
        dist.barrier()
        time.sleep(0.05)


def _inspect_model(model) -> torch.nn.Module | None:
    """The model itself, or a factory's model built on the meta device (no memory), for checks
    before any process starts; None if the factory cannot build on meta."""
    if isinstance(model, torch.nn.Module):
        return model
    try:
        with torch.device("meta"):
            built = model()
    except Exception:  # noqa: BLE001 - such factories are simply built for real later
        return None
    return built if isinstance(built, torch.nn.Module) else None


def _check_factory(name: str, factory, required: bool) -> None:
    if factory is None and not required:
        return
    if isinstance(factory, torch.optim.Optimizer):
        raise ConfigError(
            f"{name} must be a factory, not an optimizer instance: the Trainer creates it after "
            f"placing the model; write {name}=lambda params: torch.optim.AdamW(params, lr=1e-3)"
        )
    if not callable(factory):
        raise ConfigError(f"{name} must be callable, got {type(factory).__name__}")


def _check_optimizer_factory(factory) -> None:
    """Call the factory on a throw-away parameter so a broken one fails before any process."""
    probe = [torch.nn.Parameter(torch.zeros(1))]
    try:
        made = factory(probe)
    except Exception as error:  # noqa: BLE001 - re-raised with context
        raise ConfigError(f"the optimizer factory failed on a test parameter: {error!r}") from error
    if not isinstance(made, torch.optim.Optimizer):
        raise ConfigError(
            f"the optimizer factory returned {type(made).__name__}, not a torch.optim.Optimizer; "
            "did you forget `return`? Write e.g. optimizer=lambda params: AdamW(params, lr=1e-3)"
        )


def _dataset_of(data, what: str) -> Dataset:
    dataset = data.dataset if isinstance(data, DataLoader) else data
    if isinstance(dataset, IterableDataset):
        raise ConfigError(
            f"{what} is an IterableDataset; meshtrain shards data by index, so pass a map-style "
            "Dataset (with __getitem__ and __len__)"
        )
    if not (hasattr(dataset, "__getitem__") and hasattr(dataset, "__len__")):
        raise ConfigError(
            f"{what} must be a torch Dataset or DataLoader, got {type(data).__name__}"
        )
    if len(dataset) == 0:
        raise ConfigError(f"{what} is empty")
    return dataset


def _to_device(batch, device: torch.device):
    if device.type == "cpu":
        return batch
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, (tuple, list)):
        return type(batch)(_to_device(b, device) for b in batch)
    if isinstance(batch, dict):
        return {k: _to_device(v, device) for k, v in batch.items()}
    return batch


def _plain(value: torch.Tensor) -> torch.Tensor:
    """A loss as a plain tensor (under loss parallel it is a replicated DTensor)."""
    return value.full_tensor() if hasattr(value, "full_tensor") else value


def _first_tensor(batch) -> torch.Tensor | None:
    if isinstance(batch, torch.Tensor):
        return batch
    items = batch.values() if isinstance(batch, dict) else batch
    if isinstance(items, Iterable):
        for item in items:
            found = _first_tensor(item)
            if found is not None:
                return found
    return None


def _batch_size(batch) -> int:
    first = _first_tensor(batch)
    return int(first.shape[0]) if first is not None and first.dim() > 0 else 1


def _count_tokens(batch) -> int:
    """Tokens for integer (token id) inputs, else samples: what tokens/s counts."""
    first = _first_tensor(batch)
    if first is None:
        return 1
    return first.numel() if not first.is_floating_point() else int(first.shape[0])
