"""Tensor parallelism (Megatron-LM, Shoeybi et al. 2019) and sequence parallelism (Korthikanti et
al. 2022) with DTensor's ``parallelize_module``.

In each pair of matrices the first is split by output columns (``ColwiseParallel``: q/k/v by
heads, ``fc_in``), the second by input rows (``RowwiseParallel``: ``wo``, ``fc_out``); a pair costs
one all-reduce forward (the row-parallel outputs) and one backward (the column-parallel input
gradients): 4 per block per micro-batch. The token embedding is split by vocabulary rows, the head
by vocabulary columns; with ``loss_parallel`` the logits stay split and the cross-entropy runs on
the shards (``loss_parallel_context``). Sequence parallelism shards the activations between the
pairs (norms, dropout, residual stream) on the sequence dim: each all-reduce becomes a
reduce-scatter plus an all-gather (same volume; ``sequence_parallel.py``), and those
activations shrink by tp.

Every rank of a TP group must see the same batch and RNG state (dropout masks).

Plans come from the model, not from here: a model (and a pipeline stage of it) supplies
``model.tp_plan(tp_degree, *, sequence_parallel, loss_parallel) -> {module name: ParallelStyle}``
and may supply ``model.check_tp(tp_degree, *, sequence_parallel, seq_len=None)`` for its size
checks (meshtrain's GPT: meshtrain/models/gpt_plan.py). Otherwise the caller passes ``plan=``,
built with :func:`attention_plan`, :func:`mlp_plan` and :func:`replicate_the_rest`.
"""

from __future__ import annotations

import contextlib
import difflib
import fnmatch
import functools

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import (
    ColwiseParallel, ParallelStyle, PrepareModuleInput, SequenceParallel, loss_parallel,
    parallelize_module,
)

from meshtrain.errors import ConfigError
from meshtrain.parallel.data.meta_init import tied_names
from meshtrain.parallel.tensor.sequence_parallel import (
    ColwiseFromSequence, GatherSequenceInput, RowwiseToSequence, complete_partial_grads,
)

__all__ = [
    "ReplicateParallel", "apply_tp", "attention_plan", "check_divides", "check_plan_keys",
    "check_tp", "complete_partial_grads", "module_matches", "dropout_entries", "full_value",
    "loss_parallel_context", "mlp_plan", "model_tp_plan", "replicate_the_rest",
]


# --- Checks (no process group needed; a meta-device model is enough) ---------------------------
def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def check_divides(sizes: dict[str, int], tp_degree: int, hint: dict[str, str] | None = None
                  ) -> None:
    """``ConfigError`` naming the first of ``sizes`` that ``tp_degree`` does not divide, with
    the degrees that would (for a model's ``check_tp``)."""
    for what, size in sizes.items():
        if size % tp_degree:
            fix = (f"use a tp that divides {size} ({', '.join(map(str, _divisors(size)))}) or "
                   f"make {what} a multiple of {tp_degree} "
                   f"(e.g. {-(-size // tp_degree) * tp_degree})")
            if hint and what in hint:
                fix += f", {hint[what]}"
            raise ConfigError(
                f"tensor parallel tp={tp_degree} splits the {what} over {tp_degree} ranks, but "
                f"{what}={size} is not divisible by {tp_degree}; {fix}"
            )


def check_tp(model: nn.Module, tp_degree: int, *, sequence_parallel: bool,
             seq_len: int | None = None) -> None:
    """Raise ``ConfigError`` if ``model`` cannot be split over ``tp_degree`` ranks: the degree
    itself, then the model's own ``check_tp`` if it has one. Reads only shapes and config."""
    if not isinstance(tp_degree, int) or isinstance(tp_degree, bool) or tp_degree < 1:
        raise ConfigError(f"tp must be a positive integer, got {tp_degree!r}")
    own = getattr(model, "check_tp", None)
    if callable(own):
        own(tp_degree, sequence_parallel=sequence_parallel, seq_len=seq_len)


def model_tp_plan(model: nn.Module, tp_degree: int, *, sequence_parallel: bool = False,
                  loss_parallel: bool = False) -> dict[str, ParallelStyle]:
    """The plan the model supplies (``model.tp_plan``); ``ConfigError`` if it has none."""
    own = getattr(model, "tp_plan", None)
    if not callable(own):
        raise ConfigError(
            f"{type(model).__name__} has no tensor-parallel plan: pass Trainer(tp_plan={{...}}) "
            "(module name -> ParallelStyle; meshtrain.parallel.tensor.tensor_parallel's attention_plan(),"
            " mlp_plan() and replicate_the_rest() build one) or give the model a "
            "tp_plan(tp_degree, *, sequence_parallel, loss_parallel) method"
        )
    return own(tp_degree, sequence_parallel=sequence_parallel, loss_parallel=loss_parallel)


# --- Plans: module FQN -> ParallelStyle --------------------------------------------------------
class ReplicateParallel(ParallelStyle):
    """Parameters replicated as DTensors; no communication in the forward.

    For layers TP leaves whole (position embedding, norms without SP), so that every parameter is
    a DTensor: ``clip_grad_norm_`` and foreach optimizers refuse a mix with plain tensors. By
    default the module sees replicated DTensor inputs and returns plain outputs.

    ``local_input=True``: the module runs on this rank's part of a split activation (a per-head
    norm after a column-parallel projection, transformers' "replicated_with_grad_allreduce"):
    inputs, outputs and, during its forward, its parameters are plain local tensors, and each
    parameter's gradient, this rank's share, is marked partial, so it is summed over the tp ranks
    (by ``apply_tp``'s gradient hook, or by FSDP2 under a sharded layout).
    """

    def __init__(self, *, local_input: bool = False):
        super().__init__()
        self.local_input = local_input

    @staticmethod
    def _params(name, module, mesh):
        for p_name, param in list(module.named_parameters(recurse=False)):
            if isinstance(param, DTensor):
                continue
            replicated = DTensor.from_local(param.detach(), mesh, [Replicate()], run_check=False)
            module.register_parameter(p_name, nn.Parameter(replicated, param.requires_grad))

    @staticmethod
    def _inputs(module, inputs, mesh):
        return tuple(DTensor.from_local(t, mesh, [Replicate()], run_check=False)
                     if isinstance(t, torch.Tensor) and not isinstance(t, DTensor) else t
                     for t in inputs)

    @staticmethod
    def _outputs(module, output, mesh):
        return output.to_local() if isinstance(output, DTensor) else output

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        if self.local_input:
            distribute_module(module, device_mesh, self._params)
            run_on_local_params(module, partial_grads=True)
            return module
        return distribute_module(module, device_mesh, self._params, self._inputs, self._outputs)


def run_on_local_params(module: nn.Module, *, partial_grads: bool,
                        names: list[str] | None = None) -> None:
    """Make ``module.forward`` see its own replicated DTensor parameters (``names``, default
    all) as plain local tensors (views: gradients flow back to the DTensors). ``partial_grads``:
    each rank's gradient is its share of the whole (the module saw part of the activations) and
    is summed over the ranks; otherwise every rank computes the same gradient (the module saw
    whole activations)."""
    forward = module.forward
    module._tp_split_input = partial_grads  # declared to see split inputs: tp_debug checks it

    @functools.wraps(forward)
    def local_forward(*args, **kwargs):
        saved = {name: p for name, p in module._parameters.items()
                 if isinstance(p, DTensor) and (names is None or name in names)}
        for name, param in saved.items():
            grads = [Partial() if partial_grads else p for p in param.placements]
            module._parameters[name] = param.to_local(grad_placements=grads)
        try:
            return forward(*args, **kwargs)
        finally:
            module._parameters.update(saved)

    module.forward = local_forward


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def attention_plan(prefix: str, q: str, k: str, v: str, out: str, *,
                   sequence_parallel: bool = False,
                   extra_inputs: int = 0) -> dict[str, ParallelStyle]:
    """Heads split over TP: q/k/v column-parallel, ``out`` row-parallel.

    The attention module (``prefix``) turns its input into one DTensor shared by q, k and v, so
    their input gradients are summed before a single all-reduce (reduce-scatter with sequence
    parallel) instead of one each. The hidden states must be its first positional argument;
    ``extra_inputs`` more positional arguments (masks, ...) are passed through untouched.
    The module's forward must reshape with local sizes (``view(b, s, -1, head_dim)``).
    """
    seq = Shard(1) if sequence_parallel else Replicate()
    entries: dict[str, ParallelStyle] = {
        prefix: GatherSequenceInput(1) if sequence_parallel else PrepareModuleInput(
            input_layouts=(seq,) + (None,) * extra_inputs,
            desired_input_layouts=(Replicate(),) + (None,) * extra_inputs),
        _join(prefix, out): RowwiseToSequence(output_layouts=seq),
    }
    for name in (q, k, v):
        entries[_join(prefix, name)] = ColwiseParallel()
    return entries


def mlp_plan(prefix: str, fc_in: str, fc_out: str, *,
             sequence_parallel: bool = False) -> dict[str, ParallelStyle]:
    """Hidden units split over TP: ``fc_in`` column-parallel, ``fc_out`` row-parallel."""
    seq = Shard(1) if sequence_parallel else Replicate()
    return {
        _join(prefix, fc_in): ColwiseFromSequence(input_layouts=seq),
        _join(prefix, fc_out): RowwiseToSequence(output_layouts=seq),
    }


def dropout_entries(module: nn.Module, prefix: str) -> dict[str, ParallelStyle]:
    """Sequence-sharded dropouts that actually drop (p > 0) work on DTensors (distinct masks)."""
    return {_join(prefix, name): SequenceParallel(use_local_output=True)
            for name, child in module.named_children()
            if isinstance(child, nn.Dropout) and child.p > 0}


def module_matches(name: str, key: str) -> bool:
    """Does plan ``key`` name module ``name``? (``parallelize_module``'s rule: ``*`` patterns
    per dotted part.)"""
    parts, pattern = name.split("."), key.split(".")
    return len(parts) == len(pattern) and all(map(fnmatch.fnmatchcase, parts, pattern))


def replicate_the_rest(model: nn.Module, plan: dict[str, ParallelStyle]
                       ) -> dict[str, ParallelStyle]:
    """``plan`` plus :class:`ReplicateParallel` for every leaf module with parameters that it
    does not name (position embeddings, norms without SP), so every parameter is a DTensor."""
    plan = dict(plan)
    for name, module in model.named_modules():
        leaf = next(module.children(), None) is None
        if leaf and not any(module_matches(name, key) for key in plan) and \
                next(module.parameters(recurse=False), None) is not None:
            plan[name] = ReplicateParallel()
    return plan


def check_plan_keys(model: nn.Module, plan: dict) -> None:
    """Every key of a user's plan must name a module of ``model`` (torch only warns and skips
    one that does not, and the run then fails on a shape mismatch far away)."""
    names = [name for name, _ in model.named_modules() if name]
    for key in plan:
        if not isinstance(key, str) or not any(module_matches(name, key) for name in names):
            owner = str(key).rpartition(".")[0]  # 'fc.weight': a parameter's name
            close = [owner] if owner in names else difflib.get_close_matches(str(key), names, n=3)
            hint = f"did you mean {', '.join(map(repr, close))}? " if close else ""
            raise ConfigError(
                f"tp_plan key {key!r} names no module of {type(model).__name__}; {hint}keys are "
                f"module names as model.named_modules() gives them (e.g. {', '.join(names[:4])}"
                f"{', ...' if len(names) > 4 else ''}), '*' matches one part: 'layers.*.fc_in'")


# --- Applying ----------------------------------------------------------------------------------
def apply_tp(model: nn.Module, tp_mesh, *, plan: dict[str, ParallelStyle] | None = None,
             sequence_parallel: bool = False, loss_parallel: bool = False,
             grads_per_step: bool = False, styles=None) -> nn.Module:
    """Split ``model`` in place over the 1-D ``tp_mesh`` and return it.

    ``plan=None`` takes the model's own (``model.tp_plan``, after its ``check_tp``); a given
    ``plan`` is applied as it is, and the two flags only decide the sequence-length check. Either
    way every parameter the plan leaves out is replicated (see ``replicate_the_rest``). With
    ``loss_parallel`` the model returns vocab-sharded DTensor logits: compute the loss and call
    backward inside ``loss_parallel_context(True)``.

    Replicated parameters used on split activations (the norms under sequence parallel) get a
    partial gradient on each rank. By default a hook sums each one as soon as it is accumulated
    (one all-reduce per parameter and backward); ``grads_per_step=True`` leaves them partial
    through the micro-batches of a step, and the caller sums them all at once with
    :func:`complete_partial_grads` before using them (the Trainer: one all-reduce per step, as
    Megatron-LM's ``finalize_model_grads``).

    ``styles``: a function (model, plan) -> the plan to apply (the float8 layers' styles,
    parallel/float8.py), called on the given or the model's plan.
    """
    if tp_mesh.ndim != 1:
        raise ConfigError(
            f"apply_tp needs the 1-D tensor-parallel mesh, got a {tp_mesh.ndim}-D mesh "
            f"{tp_mesh.mesh_dim_names or ''}; pass mesh['tp']"
        )
    if plan is None:
        check_tp(model, tp_mesh.size(), sequence_parallel=sequence_parallel)
        plan = model_tp_plan(model, tp_mesh.size(), sequence_parallel=sequence_parallel,
                             loss_parallel=loss_parallel)
        if sequence_parallel:
            model.register_forward_pre_hook(functools.partial(_check_length, tp_mesh.size()))
    if styles is not None:
        plan = styles(model, plan)
    # keys checked against the whole model before any process started; a pipeline stage holds
    # some of the modules. What the plan leaves out is replicated, so that no plain tensor meets
    # a DTensor (clipping, foreach optimizers)
    names = [name for name, _ in model.named_modules()]
    plan = {k: v for k, v in plan.items() if any(module_matches(n, k) for n in names)}
    plan = replicate_the_rest(model, plan)
    ties = tied_names(model)
    parallelize_module(model, tp_mesh, plan)
    _tie_again(model, ties)
    _replicate_held_parameters(model, tp_mesh)
    if not grads_per_step:
        for param in model.parameters():
            if isinstance(param, DTensor) and param.requires_grad:
                param.register_post_accumulate_grad_hook(_complete_grad)
    return model


def _replicate_held_parameters(model: nn.Module, tp_mesh) -> None:
    """Parameters no style took (held by a module that has submodules: a positional
    ``nn.Parameter`` on the root, a class token) become replicated DTensors that their module's
    forward sees as plain tensors: it runs on whole activations, so every rank computes the same
    gradient (the first step's check, tp_check.py, verifies it)."""
    for module in model.modules():
        plain = [name for name, p in module.named_parameters(recurse=False)
                 if not isinstance(p, DTensor)]
        if plain:
            for name in plain:
                param = module._parameters[name]
                local = DTensor.from_local(param.detach(), tp_mesh, [Replicate()], run_check=False)
                module.register_parameter(name, nn.Parameter(local, param.requires_grad))
            run_on_local_params(module, partial_grads=False, names=plain)


def _tie_again(model: nn.Module, ties: list[list[str]]) -> None:
    """``parallelize_module`` gives each module its own DTensor, which would untie shared
    weights: make every name of a group hold the first one's again (they must be split alike:
    an embedding split by vocabulary rows and a head split by output rows both Shard(0))."""
    for first, *others in ties:
        shared = model.get_parameter(first)
        for name in others:
            other = model.get_parameter(name)
            same = (isinstance(shared, DTensor) and isinstance(other, DTensor)
                    and shared.placements == other.placements and shared.shape == other.shape)
            if other is not shared and not same:
                raise ConfigError(
                    f"tensor parallel splits the tied weights {first} and {name} differently "
                    f"({getattr(shared, 'placements', 'whole')} vs "
                    f"{getattr(other, 'placements', 'whole')}); split both the same way (an "
                    "embedding RowwiseParallel and a head ColwiseParallel both split the "
                    "vocabulary) or untie them")
            owner, _, attr = name.rpartition(".")
            model.get_submodule(owner).register_parameter(attr, shared)


def _check_length(tp: int, module: nn.Module, args) -> None:
    """Sequence parallel splits the tokens evenly; an uneven split would desynchronise ranks."""
    if args and isinstance(args[0], torch.Tensor) and args[0].dim() >= 2 and args[0].shape[1] % tp:
        raise ConfigError(
            f"sequence parallel splits the sequence over tp={tp} ranks, but this input has "
            f"{args[0].shape[1]} tokens; pad or crop inputs to a multiple of {tp} tokens, or "
            "turn sequence_parallel off (e.g. for generation)"
        )


def _complete_grad(param: DTensor) -> None:
    """All-reduce a ``Partial`` gradient once, as soon as it is accumulated.

    Replicated parameters used on sequence shards (norms under SP) get each rank's share of the
    gradient. Left so, AdamW reduces it again in each of its operations (seen: 3 all-reduces per
    parameter per step). Under FSDP2 (new parameters: no hook) FSDP2 does the same reduction.
    """
    grad = param.grad
    if isinstance(grad, DTensor) and grad.placements != param.placements:
        param.grad = grad.redistribute(param.device_mesh, param.placements)


@contextlib.contextmanager
def loss_parallel_context(enabled: bool):
    """``torch.distributed.tensor.parallel.loss_parallel()`` when enabled, else nothing.

    Must surround both the loss computation and ``loss.backward()``. The loss must be
    ``F.cross_entropy`` (or ``nll_loss(log_softmax(...))``) on the vocab-sharded logits, with the
    class dim last or flattened: ``cross_entropy(logits.flatten(0, 1), targets.flatten())``.
    """
    if enabled:
        with loss_parallel():
            yield
    else:
        yield


def full_value(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor (sharded parameter, loss-parallel loss) gathered whole; a tensor as it is."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
