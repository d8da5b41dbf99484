"""Turning a plain model into a parallel one, in one fixed order; the result is an Engine.

The order (as in torchtitan) is: pipeline split (:func:`apply_layout`, then :func:`parallelize`
on each stage), the float8 swap (float8.py), tensor parallel, context parallel, synchronised
BatchNorm, activation checkpointing, ``torch.compile``, then the data-parallel wrapper (FSDP or
DDP) last, because it must see the final parameters.
Each strategy is one ``apply_*`` function in its own module; this file only decides which ones
run, and in what order.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from meshtrain.errors import ConfigError
from meshtrain.parallel.compile import compile_mode
from meshtrain.parallel.engine import Engine
from meshtrain.parallel.layout import Layout
from meshtrain.parallel.mesh import ParallelMesh

BlocksFn = Callable[[torch.nn.Module], Iterable[torch.nn.Module]]


@dataclass(frozen=True)
class ParallelOptions:
    """Knobs of the strategies, taken from the Trainer's arguments."""

    bucket_cap_mb: float = 25.0
    comm_hook: str | None = None
    powersgd_rank: int = 1
    precision: str = "fp32"
    float8: str | None = None  # torchao's recipe: "tensorwise", "rowwise" (float8.py)
    float8_emulate: bool = False
    offload: str | None = None
    shard_unit_mb: float | None = None  # FSDP units of at least this many MiB (fully_shard.py)
    activation_checkpointing: str | None = None
    compile: str | None = None  # "blocks", "model" or None (compile.py)
    blocks: BlocksFn | None = None
    sequence_parallel: bool = False
    loss_parallel: bool = False
    # a plan, or a function module -> plan or None (None: the module's own ``tp_plan``)
    tp_plan: dict | Callable[[torch.nn.Module], dict | None] | None = None
    tp_check_steps: int = 1  # steps whose replicated gradients are compared (tp_debug.py)
    # module -> what makes it context parallel, or None: the module itself (context_parallel.py)
    context_parallel: Callable[[torch.nn.Module], object | None] | None = None
    # module -> how to count its own loss's items (step_loss.loss_counter), or None
    loss_items: Callable[[torch.nn.Module], Callable | None] | None = None
    # module -> the router loss meshtrain adds to the model's own loss (meshtrain.moe), or None
    router_loss: Callable[[torch.nn.Module], object | None] | None = None
    # module -> its MoE layers ep can split, where it has no meshtrain MoE layers (expert/)
    expert_layers: Callable[[torch.nn.Module], list] | None = None
    # module -> keyword arguments of its training forward, when it returns its own loss
    call_kwargs: Callable[[torch.nn.Module], dict] | None = None
    sync_batchnorm: bool = True
    local_sgd_every: int | None = None  # local SGD (local_sgd.py): average parameters every H
    outer_lr: float | None = None
    outer_momentum: float = 0.9
    # model -> None: what fills a model built on the meta device once this rank's shards are
    # allocated (None: the model's own init_weights(); fully_shard.initializer_of)
    initializer: Callable[[torch.nn.Module], None] | None = None

    @classmethod
    def from_settings(cls, s: dict, tp_plan=None, context_parallel=None,
                      loss_items=None, router_loss=None, expert_layers=None, call_kwargs=None
                      ) -> ParallelOptions:
        """From the Trainer's settings (meshtrain.settings); ``tp_plan`` replaces a missing one,
        ``context_parallel`` adapts models that lack the methods (see ``cp_support``),
        ``loss_items`` counts the loss items of models that return their loss,
        ``router_loss`` carries a router loss they would add (meshtrain.moe)."""
        tp_plan = s["tp_plan"] if s["tp_plan"] is not None else tp_plan
        return cls(bucket_cap_mb=25.0 if s["bucket_cap_mb"] is None else s["bucket_cap_mb"],
                   comm_hook=s["comm_hook"], powersgd_rank=s["powersgd_rank"],
                   precision=s["precision"], offload=s["offload"],
                   float8=s["float8"], float8_emulate=s["float8_emulate"],
                   shard_unit_mb=s["shard_unit_mb"],
                   activation_checkpointing=s["activation_checkpointing"], blocks=s["blocks"],
                   compile=compile_mode(s["compile"]),
                   sequence_parallel=s["sequence_parallel"], loss_parallel=s["loss_parallel"],
                   tp_plan=tp_plan, tp_check_steps=s["tp_check_steps"],
                   context_parallel=context_parallel, loss_items=loss_items,
                   router_loss=router_loss, expert_layers=expert_layers,
                   call_kwargs=call_kwargs,
                   sync_batchnorm=s["sync_batchnorm"], local_sgd_every=s["local_sgd_every"],
                   outer_lr=s["outer_lr"], outer_momentum=s["outer_momentum"])


def model_blocks(model: torch.nn.Module, options: ParallelOptions) -> list[torch.nn.Module]:
    """The repeated blocks that FSDP shards one by one and checkpointing recomputes."""
    from meshtrain.parallel.data.fully_shard import find_blocks

    if options.blocks is not None:
        return list(options.blocks(model))
    return find_blocks(model)


def check_model(model: torch.nn.Module | None, layout: Layout, options: ParallelOptions, *,
                pipeline=None, loss_fn=None, num_microbatches: int = 1,
                batch_size: int = 1, sample_inputs=None, original=None) -> None:
    """Checks that need the model but no process group (run on a meta-device copy; None when
    the model cannot be built there: then only what needs no model). ``sample_inputs`` and
    ``original`` (the user's module or factory): the pipeline's check against the model's
    forward, run once before the processes start (pipeline/check.py)."""
    if layout.degree("pp") > 1 and pipeline is not None:
        from meshtrain.parallel.pipeline.engine import SHARDING_BREAKS, check_pipeline_layout

        if options.activation_checkpointing and pipeline.schedule in SHARDING_BREAKS:
            raise ConfigError(
                f"pp_schedule={pipeline.schedule!r} with activation_checkpointing="
                f"{options.activation_checkpointing!r} fails in torch 2.13: the schedule's "
                "separate weight backward re-enters the checkpoint's recomputation "
                "('_GeneratorContextManager' object has no attribute 'args'). Use 1f1b, gpipe "
                "or interleaved-1f1b with activation checkpointing, or turn it off")

        check_pipeline_layout(model, layout, pipeline, loss_fn=loss_fn,
                              num_microbatches=num_microbatches, batch_size=batch_size,
                              sample_inputs=sample_inputs, original=original)
    if options.compile is not None:  # blocks unknown without a model: then checked on the ranks
        from meshtrain.parallel.compile import check_compile

        check_compile(options.compile,
                      has_blocks=model is None or bool(model_blocks(model, options)),
                      activation_checkpointing=options.activation_checkpointing)
    if model is None:
        return
    if options.float8 is not None:
        from meshtrain.parallel.float8 import check_float8_model

        check_float8_model(model, options.float8)
    if loss_fn is None and options.loss_items is not None:  # the model's own loss: one it can
        options.loss_items(model)  # carry (a term meshtrain would scale wrongly is refused)
    if layout.expert_degree > 1:
        from meshtrain.parallel.expert import check_expert_parallel

        check_expert_parallel(model, layout.expert_degree, options.expert_layers,
                              ranks=layout.loss_degree)
        edp = layout.expert_data_degree
        if options.compile is not None and options.activation_checkpointing == "selective" \
                and (layout.zero_stage == 3 or layout.zero_stage == 2 and edp == 1) and any(
                    callable(getattr(m, "split_experts", None)) for m in model.modules()):
            raise ConfigError(  # (seen: dp_shard=2,ep=2, zero2=2,ep=2, dp_shard=4,ep=2 failed)
                f"compile={options.compile!r} with activation_checkpointing='selective' fails "
                f"in the first backward under '{layout}' in torch 2.13: meshtrain's MoE "
                f"experts are FSDP2 units of their own (over the {edp} rank(s) holding the "
                "same experts) inside each checkpointed block, and their hooks run differently "
                "in the recompute than in the forward ('... encountered during backward but "
                "not found in storage'). Use activation_checkpointing='full', compile=False, "
                "dp instead of dp_shard/zero2/zero3 beside ep (e.g. dp=2,ep=2), or zero2 with "
                "each expert on several ranks (e.g. zero2=4,ep=2: kept gathered)")
    from meshtrain.moe.balance import check_router_loss

    check_router_loss(model, layout, options.router_loss if loss_fn is None else None,
                      experts=options.expert_layers)
    if not options.sync_batchnorm and not any(
            isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in model.modules()):
        raise ConfigError("sync_batchnorm=False keeps BatchNorm statistics per rank, and the "
                          "model has no BatchNorm module, so it would do nothing; drop "
                          "sync_batchnorm")
    tp = layout.degree("tp")
    plan = tp_plan_of(model, options) if tp > 1 else None
    if plan is not None:
        from meshtrain.parallel.tensor.tensor_parallel import check_plan_keys

        check_plan_keys(model, plan)
    elif tp > 1:
        from meshtrain.parallel.tensor.tensor_parallel import check_tp, model_tp_plan

        # the model's own checks, and a plan it must supply
        check_tp(model, tp, sequence_parallel=options.sequence_parallel)
        plan = model_tp_plan(model, tp, sequence_parallel=options.sequence_parallel,
                             loss_parallel=options.loss_parallel)
    if plan is not None:  # a forward that reshapes with the whole model's head count
        from meshtrain.parallel.tensor.tp_shapes import check_local_shapes

        check_local_shapes(model, plan, tp, sample_inputs)
    if layout.degree("cp") > 1:
        from meshtrain.parallel.context.context_parallel import check_cp_model

        check_cp_model(model, layout.degree("cp"), options.context_parallel, sample_inputs,
                       pipeline=layout.degree("pp") > 1)
    if not any(p.requires_grad for p in model.parameters()):
        raise ConfigError(
            "the model has no trainable parameters (requires_grad=True), so there is nothing "
            f"to train{' or shard' if layout.is_sharded else ''}"
        )
    if layout.num_servers:
        from meshtrain.parallel.ps.layout import check_ps_model

        check_ps_model(model, layout.num_servers)
    if options.activation_checkpointing and not model_blocks(model, options):
        raise ConfigError(
            f"activation_checkpointing={options.activation_checkpointing!r} needs the model's "
            "repeated blocks (e.g. an nn.ModuleList of layers) and none were found; pass "
            "blocks=lambda model: [...] to the Trainer, or set activation_checkpointing=None"
        )


def tp_plan_of(module: torch.nn.Module, options: ParallelOptions) -> dict | None:
    """The plan given for ``module`` (a dict, or what the function returns for it); None means
    the module supplies its own (``module.tp_plan``)."""
    plan = options.tp_plan
    return plan(module) if callable(plan) else plan


def parallelize(model: torch.nn.Module, mesh: ParallelMesh, *, device: torch.device,
                options: ParallelOptions = ParallelOptions(), ddp: bool = True) -> torch.nn.Module:
    """Apply the layout to ``model`` in place; return the module to call for training steps.

    The returned module may be a wrapper (DDP) used only inside the Engine; ``model`` itself
    keeps its parameters, so user code reads and saves ``model`` as it is. Under ``pp`` this is
    called once per pipeline stage. ``ddp=False`` leaves the DDP wrapper out (a simulated world
    on the meta device: DDP holds no model state of its own, its gradients are bucket views).
    """
    layout = mesh.layout
    styles = None  # the plan's styles as they are
    if options.float8 is not None:
        from meshtrain.parallel.float8 import apply_float8, float8_tp_plan, uses_float8_styles

        apply_float8(model, options.float8, emulate=options.float8_emulate,
                     sharded=layout.is_sharded)
        if uses_float8_styles(options.float8, sequence_parallel=options.sequence_parallel,
                              device=device):
            styles = float8_tp_plan
    if layout.degree("tp") > 1:
        from meshtrain.parallel.tensor.tensor_parallel import apply_tp

        apply_tp(model, mesh.axis("tp"), plan=tp_plan_of(model, options),
                 sequence_parallel=options.sequence_parallel, loss_parallel=options.loss_parallel,
                 grads_per_step=True,  # summed once per step: Engine.sync_gradients
                 styles=styles)
    if layout.degree("cp") > 1:
        from meshtrain.parallel.context.context_parallel import apply_cp

        apply_cp(model, mesh.axis("cp"), options.context_parallel)
    if layout.expert_degree > 1:  # (the expert parameters data parallelism leaves alone)
        from meshtrain.parallel.expert import apply_expert_parallel

        apply_expert_parallel(model, mesh, options.expert_layers)
    if options.sync_batchnorm and mesh.loss is not None:
        from meshtrain.parallel.data.sync_batchnorm import apply_sync_batchnorm

        apply_sync_batchnorm(model, mesh.loss.get_group())
    needs_blocks = options.activation_checkpointing or layout.is_sharded or options.compile
    blocks = model_blocks(model, options) if needs_blocks else []
    if options.activation_checkpointing:
        from meshtrain.parallel.activation_checkpointing import (
            apply_activation_checkpointing, checkpoint_hooks_first)

        checkpoint_hooks = apply_activation_checkpointing(model, options.activation_checkpointing,
                                                          blocks)
    if options.compile is not None:
        from meshtrain.parallel.compile import apply_compile

        apply_compile(model, options.compile, blocks, tensor_parallel=layout.degree("tp") > 1)
    if layout.is_sharded:  # 1-D: FSDP; 2-D (replicate, shard): HSDP
        from meshtrain.module.core import is_manual
        from meshtrain.parallel.data.fully_shard import apply_fsdp

        # a manual module's step calls its submodules (generator, discriminator), never its
        # own forward: each submodule with parameters is then an FSDP root of its own
        roots = ([child for child in model.children() if any(True for _ in child.parameters())]
                 if is_manual(model) else [model])
        # FSDP's collectives through shared memory (CPU processes of one host)
        p2p = mesh.local_p2p(mesh.shard_axes, device)
        for root in roots:
            inside = [b for b in blocks if b is not root and any(b is m for m in root.modules())]
            apply_fsdp(root, mesh.shard, reshard_after_forward=layout.zero_stage == 3,
                       precision=options.precision, offload=options.offload,
                       blocks=inside or None, unit_mb=options.shard_unit_mb, p2p=p2p)
        if options.activation_checkpointing == "selective":
            checkpoint_hooks_first(checkpoint_hooks)
        return model
    if ddp and layout.uses_ddp and options.local_sgd_every is None:  # local SGD: no sync
        from meshtrain.parallel.data.data_parallel import apply_ddp

        from meshtrain.module.core import TrainingStep, has_steps, is_manual

        if is_manual(model):  # several backward passes per step: manual_backward averages
            return model
        wrapped = TrainingStep(model) if has_steps(model) else model  # DDP runs the step
        return apply_ddp(wrapped, mesh.mesh, axis="dp", bucket_cap_mb=options.bucket_cap_mb,
                         comm_hook=options.comm_hook, powersgd_rank=options.powersgd_rank,
                         device=device, whole_block_graphs=options.compile == "blocks"
                         and options.activation_checkpointing == "selective")
    return model


def apply_layout(model: torch.nn.Module, mesh: ParallelMesh, *, device: torch.device,
                 options: ParallelOptions, pipeline, precision, loss_fn, grad_accum_steps: int,
                 on_meta: bool = False, sample_inputs=None, log=print, run_dir=None) -> Engine:
    """The whole layout applied to ``model`` (built on the meta device when ``on_meta``: each
    rank then allocates only its shards): the Engine the training loop drives."""
    if not on_meta:
        model = model.to(device)
    common = dict(device=device, options=options, precision=precision, loss_fn=loss_fn)
    if mesh.layout.degree("pp") > 1:
        from meshtrain.parallel.pipeline.engine import apply_pipeline

        engine = apply_pipeline(model, mesh, pipeline=pipeline, num_microbatches=grad_accum_steps,
                                sample_inputs=sample_inputs, log=log, run_dir=run_dir,
                                parallelize=parallelize, **common)
    else:
        train_module = parallelize(model, mesh, device=device, options=options)
        engine = Engine(model, train_module, mesh, grad_accum_steps=grad_accum_steps, **common)
        if options.local_sgd_every is not None:
            from meshtrain.parallel.data.local_sgd import LocalSGD

            engine.averager = LocalSGD(model, mesh.axis("dp").get_group(),
                                       options.local_sgd_every, outer_lr=options.outer_lr,
                                       outer_momentum=options.outer_momentum)
            log(f"local SGD: parameters averaged every {options.local_sgd_every} steps, "
                f"{engine.averager.bytes_per_step / 2**20:.3f} MiB per step on average (DDP: "
                f"{engine.averager.param_bytes / 2**20:.3f} MiB of gradients every step)")
    if options.float8 is not None:
        from meshtrain.parallel.float8 import describe_float8

        log(describe_float8(getattr(getattr(engine, "runner", None), "modules", None)
                            or [engine.model], options, mesh.layout, device))
    if options.compile is not None:
        what = "each repeated block" if options.compile == "blocks" else "the whole forward"
        log(f"torch.compile: {what} (Inductor); the first steps include compiling")
    if mesh.layout.num_servers:  # the optimizer (ps/layout.py's ServerOptimizer) ends the training
        log(f"parameter servers: {mesh.layout.num_servers} server(s), "
            f"{mesh.layout.world_size} worker(s); the optimizer runs on the servers")
    tied = getattr(engine, "tied", None)
    if on_meta:  # (under pp each stage: it holds its modules under their full-model names)
        from meshtrain.parallel.data.meta_init import materialize_checked

        runner = getattr(engine, "runner", None)  # (checked: the ranks' parts make the whole;
        materialize_checked(  # a tied copy on the first stage takes the last's: not checked)
            runner.modules if runner is not None else [engine.model], device,
            options.initializer, mesh.everyone(),
            skip={n for g in tied.ties for n in g} if tied is not None else ())
    if tied is not None:  # pipeline/tied.py: the first stage's copy starts as the last's
        tied.start()
    return engine


def build_optimizer(model: torch.nn.Module, factory, mesh: ParallelMesh):
    """The user's optimizer, or for ZeRO-1 the same optimizer with its state sharded (a
    factory marked ``takes_names`` gets (name, parameter) pairs: meshtrain.optim)."""
    from meshtrain.optim import params_factory

    factory = params_factory(factory, model)
    if mesh.layout.zero_stage == 1 and mesh.layout.degree("dp") > 1:
        from meshtrain.parallel.data.zero1 import make_zero1_optimizer

        return make_zero1_optimizer(model.parameters(), factory, mesh.axis("dp").get_group())
    return factory(model.parameters())
