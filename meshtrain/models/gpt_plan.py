"""meshtrain's GPT under tensor parallelism: its Megatron plan and the sizes that must divide.

:class:`~meshtrain.models.gpt.GPT` exposes these as ``GPT.tp_plan`` and ``GPT.check_tp``, the
protocol through which a model supplies its own plan (see :mod:`meshtrain.parallel.tensor.tensor_parallel`).
They read only the module structure, so they also serve a pipeline stage of a GPT (a copy whose
``layers`` is a ModuleDict keyed by the blocks' indices in the full model, and whose ``tok_emb``
or ``head`` may be None) and a model built on the meta device.
"""

from __future__ import annotations

import torch.nn as nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ParallelStyle, PrepareModuleInput, PrepareModuleInputOutput,
    PrepareModuleOutput, RowwiseParallel,
)

from meshtrain.moe.tensor_parallel import expert_sizes, moe_tp_plan
from meshtrain.parallel.tensor.sequence_parallel import ColwiseFromSequence
from meshtrain.parallel.tensor.tensor_parallel import (
    ReplicateParallel, attention_plan, check_divides, dropout_entries, mlp_plan, replicate_the_rest,
)


def _blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, block) pairs of ``model.layers``: a ModuleList, or a stage's ModuleDict."""
    layers = model.layers
    items = layers.items() if isinstance(layers, nn.ModuleDict) else enumerate(layers)
    return [(str(name), block) for name, block in items]


def _is_moe(block: nn.Module) -> bool:
    return hasattr(block.mlp, "experts")


def gpt_sizes(model: nn.Module) -> dict[str, int]:
    """The sizes tensor parallel splits: heads, d_model, MLP width, vocabulary."""
    block = _blocks(model)[0][1]
    sizes = {
        "num_heads": block.attn.wq.out_features // block.attn.head_dim,
        "d_model": block.attn.wq.in_features,
    }
    if _is_moe(block):  # every expert split by hidden unit (meshtrain.moe.tensor_parallel)
        sizes.update(expert_sizes(block.mlp))
    else:
        sizes["mlp_hidden_dim"] = block.mlp.fc_in.out_features
    if model.tok_emb is not None:
        sizes["vocab_size"] = model.tok_emb.num_embeddings
    elif model.head is not None:
        sizes["vocab_size"] = model.head.out_features
    return sizes


def check_gpt_tp(model: nn.Module, tp_degree: int, *, sequence_parallel: bool,
                 seq_len: int | None = None) -> None:
    """Heads, d_model, the MLP width and the vocabulary must divide by tp; with
    ``sequence_parallel`` the sequence length too (``seq_len``, default ``config.seq_len``)."""
    sizes = gpt_sizes(model)
    if sequence_parallel:
        sizes["seq_len"] = seq_len if seq_len is not None else model.config.seq_len
    check_divides(sizes, tp_degree, hint={"seq_len": "or turn sequence_parallel off"})


def gpt_tp_plan(model: nn.Module, *, sequence_parallel: bool,
                loss_parallel: bool) -> dict[str, ParallelStyle]:
    """The Megatron plan for meshtrain's GPT (or a pipeline stage of it).

    Without sequence parallel the residual stream is replicated. With it, the stream between
    blocks is sharded on the sequence dim: the embedding's output is all-reduced (replicated,
    as the learned position embedding is added to the full sequence, as in Megatron) and sliced
    by the first block only (no communication), each block then hands its sequence shard to the
    next, and the final norm's output is all-gathered by the head. The norms run on plain
    sequence shards (``ReplicateParallel(local_input=True)``: no DTensor dispatch; their weights'
    partial gradients are summed once per step), as Megatron's do.
    """
    sp = sequence_parallel
    blocks = _blocks(model)
    plan: dict[str, ParallelStyle] = {}
    if model.tok_emb is not None:
        plan["tok_emb"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
    if sp:  # Slice the replicated stream at the first block only (later blocks get shards);
        # a pipeline stage before the last all-gathers its last block's output, so stages
        # hand each other the whole sequence, as without sequence parallel
        slice_in = dict(input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),))
        gather_out = dict(output_layouts=(Shard(1),), desired_output_layouts=(Replicate(),),
                          use_local_output=True)
        first, last = f"layers.{blocks[0][0]}", f"layers.{blocks[-1][0]}"
        plan[first] = PrepareModuleInput(**slice_in, use_local_output=True)
        if model.head is None:
            plan[last] = PrepareModuleInputOutput(**slice_in, use_local_input=True, **gather_out) \
                if first == last else PrepareModuleOutput(**gather_out)
    for name, block in blocks:
        prefix = f"layers.{name}"
        if sp:
            plan[f"{prefix}.norm1"] = ReplicateParallel(local_input=True)
            plan[f"{prefix}.norm2"] = ReplicateParallel(local_input=True)
            plan.update(dropout_entries(block.attn, f"{prefix}.attn"))
            plan.update(dropout_entries(block.mlp, f"{prefix}.mlp"))
        plan.update(attention_plan(f"{prefix}.attn", "wq", "wk", "wv", "wo", sequence_parallel=sp))
        if _is_moe(block):
            plan.update(moe_tp_plan(f"{prefix}.mlp", block.mlp, sequence_parallel=sp))
        else:
            plan.update(mlp_plan(f"{prefix}.mlp", "fc_in", "fc_out", sequence_parallel=sp))
    if sp and model.norm is not None:
        plan["norm"] = ReplicateParallel(local_input=True)
    if model.head is not None:
        plan["head"] = ColwiseFromSequence(
            input_layouts=Shard(1) if sp else Replicate(),
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,  # loss parallel needs the DTensor
        )
    return replicate_the_rest(model, plan)  # pos_emb, and the norms without SP
