"""Tensor parallelism (Megatron-LM, Shoeybi et al. 2019) and sequence parallelism (Korthikanti et
al. 2022) with DTensor's ``parallelize_module``.

In each pair of matrices the first is split by output columns (``ColwiseParallel``: q/k/v by
heads, ``fc_in``), the second by input rows (``RowwiseParallel``: ``wo``, ``fc_out``); a pair costs
one all-reduce forward (the row-parallel outputs) and one backward (the column-parallel input
gradients): 4 per block per micro-batch. The token embedding is split by vocabulary rows, the head
by vocabulary columns; with ``loss_parallel`` the logits stay split and the cross-entropy runs on
the shards (``loss_parallel_context``). Sequence parallelism shards the activations between the
pairs (norms, dropout, residual stream) on the sequence dim: each all-reduce becomes a
reduce-scatter plus an all-gather (same volume), and those activations shrink by tp.

Every rank of a TP group must see the same batch and RNG state (dropout masks).
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections import defaultdict

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import (
    ColwiseParallel, ParallelStyle, PrepareModuleInput, RowwiseParallel, SequenceParallel,
    loss_parallel, parallelize_module,
)

from meshtrain.errors import ConfigError

__all__ = [
    "ReplicateParallel", "apply_tp", "attention_plan", "check_tp", "comm_counts", "full_value",
    "gpt_tp_plan", "loss_parallel_context", "mlp_plan",
]


# --- Checks (no process group needed; a meta-device model is enough) ---------------------------
def _blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, block) pairs of ``model.layers``: a ModuleList, or a pipeline stage's ModuleDict
    keyed by the blocks' indices in the full model."""
    layers = model.layers
    items = layers.items() if isinstance(layers, nn.ModuleDict) else enumerate(layers)
    return [(str(name), block) for name, block in items]


def is_gpt_like(model: nn.Module) -> bool:
    """meshtrain's GPT (or a pipeline stage of it), or any model with its attribute structure."""
    try:
        first = _blocks(model)[0][1]
        attn, mlp = first.attn, first.mlp
    except (AttributeError, IndexError, TypeError):
        return False
    names = ("tok_emb", "norm", "head")  # None on pipeline stages that do not hold them
    return (all(hasattr(model, n) for n in names) and hasattr(attn, "head_dim")
            and all(hasattr(attn, n) for n in ("wq", "wk", "wv", "wo"))
            and hasattr(mlp, "fc_in") and hasattr(mlp, "fc_out"))


def _gpt_sizes(model: nn.Module) -> dict[str, int]:
    block = _blocks(model)[0][1]
    sizes = {
        "num_heads": block.attn.wq.out_features // block.attn.head_dim,
        "d_model": block.attn.wq.in_features,
        "mlp_hidden_dim": block.mlp.fc_in.out_features,
    }
    if model.tok_emb is not None:
        sizes["vocab_size"] = model.tok_emb.num_embeddings
    elif model.head is not None:
        sizes["vocab_size"] = model.head.out_features
    return sizes


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def check_tp(model: nn.Module, tp_degree: int, *, sequence_parallel: bool,
             seq_len: int | None = None) -> None:
    """Raise ``ConfigError`` if ``model`` cannot be split over ``tp_degree`` ranks.

    For a GPT-like model: heads, d_model, the MLP hidden width and the vocabulary must divide by
    tp (each rank takes an equal slice); with ``sequence_parallel`` the sequence length too
    (``seq_len``, by default the model's ``config.seq_len``). Reads only shapes and config.
    """
    if not isinstance(tp_degree, int) or isinstance(tp_degree, bool) or tp_degree < 1:
        raise ConfigError(f"tp must be a positive integer, got {tp_degree!r}")
    sizes = _gpt_sizes(model) if is_gpt_like(model) else {}
    if sequence_parallel:
        if seq_len is None:
            seq_len = getattr(getattr(model, "config", None), "seq_len", None)
        if seq_len is not None:
            sizes["seq_len"] = seq_len
    for what, size in sizes.items():
        if size % tp_degree:
            fix = (f"use a tp that divides {size} ({', '.join(map(str, _divisors(size)))}) or "
                   f"make {what} a multiple of {tp_degree} "
                   f"(e.g. {-(-size // tp_degree) * tp_degree})")
            if what == "seq_len":
                fix += ", or turn sequence_parallel off"
            raise ConfigError(
                f"tensor parallel tp={tp_degree} splits the {what} over {tp_degree} ranks, but "
                f"{what}={size} is not divisible by {tp_degree}; {fix}"
            )


# --- Plans: module FQN -> ParallelStyle --------------------------------------------------------
class ReplicateParallel(ParallelStyle):
    """Parameters replicated as DTensors, replicated inputs, plain outputs; no communication.

    For layers TP leaves whole (position embedding, norms without SP), so that every parameter is
    a DTensor: ``clip_grad_norm_`` and foreach optimizers refuse a mix with plain tensors.
    """

    @staticmethod
    def _params(name, module, mesh):
        for p_name, param in list(module.named_parameters(recurse=False)):
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
        return distribute_module(module, device_mesh, self._params, self._inputs, self._outputs)


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
        prefix: PrepareModuleInput(input_layouts=(seq,) + (None,) * extra_inputs,
                                   desired_input_layouts=(Replicate(),) + (None,) * extra_inputs),
        _join(prefix, out): RowwiseParallel(output_layouts=seq),
    }
    for name in (q, k, v):
        entries[_join(prefix, name)] = ColwiseParallel()
    return entries


def mlp_plan(prefix: str, fc_in: str, fc_out: str, *,
             sequence_parallel: bool = False) -> dict[str, ParallelStyle]:
    """Hidden units split over TP: ``fc_in`` column-parallel, ``fc_out`` row-parallel."""
    seq = Shard(1) if sequence_parallel else Replicate()
    return {
        _join(prefix, fc_in): ColwiseParallel(input_layouts=seq),
        _join(prefix, fc_out): RowwiseParallel(output_layouts=seq),
    }


def _dropout_entries(module: nn.Module, prefix: str) -> dict[str, ParallelStyle]:
    """Sequence-sharded dropouts that actually drop (p > 0) work on DTensors (distinct masks)."""
    return {_join(prefix, name): SequenceParallel(use_local_output=True)
            for name, child in module.named_children()
            if isinstance(child, nn.Dropout) and child.p > 0}


def gpt_tp_plan(model: nn.Module, *, sequence_parallel: bool,
                loss_parallel: bool) -> dict[str, ParallelStyle]:
    """The Megatron plan for meshtrain's GPT (or a model with its attribute structure).

    Without sequence parallel the residual stream is replicated. With it, the stream between
    blocks is sharded on the sequence dim: the embedding's output is all-reduced (replicated,
    as the learned position embedding is added to the full sequence, as in Megatron) and sliced
    by the first block only (no communication), each block then hands its sequence shard to the
    next, and the final norm's output is all-gathered by the head.
    """
    if not is_gpt_like(model):
        raise ConfigError(
            f"{type(model).__name__} does not have GPT's structure (tok_emb, layers[i].attn."
            f"{{wq,wk,wv,wo}}, layers[i].mlp.{{fc_in,fc_out}}, norm, head); pass "
            "apply_tp(model, mesh, plan={...}) built with attention_plan() and mlp_plan()"
        )
    sp = sequence_parallel
    blocks = _blocks(model)
    whole = model.tok_emb is not None and model.head is not None
    if sp and not whole:
        raise ConfigError(
            "sequence_parallel is not available on pipeline stages yet (activations between "
            "stages would be sequence shards); use tensor parallel without it under pp"
        )
    plan: dict[str, ParallelStyle] = {}
    if model.tok_emb is not None:
        plan["tok_emb"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
    if sp:  # Slice the replicated stream at the first block only (later blocks get shards).
        plan[f"layers.{blocks[0][0]}"] = PrepareModuleInput(
            input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),),
            use_local_output=True)
    for name, block in blocks:
        prefix = f"layers.{name}"
        if sp:
            plan[f"{prefix}.norm1"] = SequenceParallel()
            plan[f"{prefix}.norm2"] = SequenceParallel()
            plan.update(_dropout_entries(block.attn, f"{prefix}.attn"))
            plan.update(_dropout_entries(block.mlp, f"{prefix}.mlp"))
        plan.update(attention_plan(f"{prefix}.attn", "wq", "wk", "wv", "wo", sequence_parallel=sp))
        plan.update(mlp_plan(f"{prefix}.mlp", "fc_in", "fc_out", sequence_parallel=sp))
    if sp:
        plan["norm"] = SequenceParallel()
    if model.head is not None:
        plan["head"] = ColwiseParallel(
            input_layouts=Shard(1) if sp else Replicate(),
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,  # loss parallel needs the DTensor
        )
    for name, module in model.named_modules():  # pos_emb, and the norms without SP
        leaf = next(module.children(), None) is None
        if leaf and name not in plan and next(module.parameters(recurse=False), None) is not None:
            plan[name] = ReplicateParallel()
    return plan


# --- Applying ----------------------------------------------------------------------------------
def apply_tp(model: nn.Module, tp_mesh, *, plan: dict[str, ParallelStyle] | None = None,
             sequence_parallel: bool = False, loss_parallel: bool = False) -> nn.Module:
    """Split ``model`` in place over the 1-D ``tp_mesh`` and return it.

    ``plan=None`` uses :func:`gpt_tp_plan` (GPT-like models only; checked with :func:`check_tp`
    first). A given ``plan`` is applied as it is, and the two flags are then ignored. With
    ``loss_parallel`` the model returns vocab-sharded DTensor logits: compute the loss and call
    backward inside ``loss_parallel_context(True)``.
    """
    if tp_mesh.ndim != 1:
        raise ConfigError(
            f"apply_tp needs the 1-D tensor-parallel mesh, got a {tp_mesh.ndim}-D mesh "
            f"{tp_mesh.mesh_dim_names or ''}; pass mesh['tp']"
        )
    if plan is None:
        check_tp(model, tp_mesh.size(), sequence_parallel=sequence_parallel)
        plan = gpt_tp_plan(model, sequence_parallel=sequence_parallel,
                           loss_parallel=loss_parallel)
        if sequence_parallel:
            model.register_forward_pre_hook(functools.partial(_check_length, tp_mesh.size()))
    parallelize_module(model, tp_mesh, plan)
    for param in model.parameters():
        if isinstance(param, DTensor) and param.requires_grad:
            param.register_post_accumulate_grad_hook(_complete_grad)
    return model


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


# --- Counting communication --------------------------------------------------------------------
def _collective_name(op) -> str:
    """DTensor's functional collectives by kind; direct c10d calls (FSDP2, DDP) as c10d.<op>."""
    namespace, _, name = str(op).rpartition(".")
    name = name.strip("_")
    if not namespace.endswith("c10d_functional"):
        return f"c10d.{name}"
    for short in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast"):
        if name.startswith(short):
            return short
    return name


def comm_counts(model: nn.Module, batch, loss_fn, *, loss_parallel: bool = False) -> dict[str, int]:
    """Collectives this rank issues in one forward + backward of ``batch = (inputs, targets)``.

    Counted with DTensor's ``CommDebugMode``, by kind, as ``"forward/<kind>"`` (forward and
    loss), ``"backward/<kind>"`` and the total ``"<kind>"``. TP's collectives are ``all_reduce``,
    ``all_gather``, ``reduce_scatter``; those FSDP2 or DDP call directly appear as ``c10d.<op>``
    (FSDP2: ``c10d.allgather_base``, ``c10d.reduce_scatter_base``). The optimizer step is not
    included (it needs none after TP). Gradients are left in ``.grad``.
    """
    from torch.distributed.tensor.debug import CommDebugMode

    inputs, targets = batch
    with loss_parallel_context(loss_parallel), warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Full backward hook is firing")  # CommDebugMode's
        with CommDebugMode() as forward:
            loss = loss_fn(model(inputs), targets)
        with CommDebugMode() as backward:
            loss.backward()
    result: dict[str, int] = defaultdict(int)
    for phase, mode in (("forward", forward), ("backward", backward)):
        for op, n in mode.get_comm_counts().items():
            result[f"{phase}/{_collective_name(op)}"] += n
            result[_collective_name(op)] += n
    return dict(result)


def full_value(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor (sharded parameter, loss-parallel loss) gathered whole; a tensor as it is."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
