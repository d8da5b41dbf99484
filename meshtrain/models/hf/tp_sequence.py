"""Sequence and loss parallel for Hugging Face causal LMs, built on the tensor-parallel plan the
model declares (models/hf/tp.py).

Sequence parallel (Korthikanti et al. 2022, as meshtrain's GPT does it: models/gpt_plan.py): the
residual stream between the layers is split on the sequence dim over the tp ranks. The model's
own forward computes the embedding, the masks and the rotary embeddings on the whole sequence as
without tp; the first layer takes its share of the tokens (a slice, whose backward gathers);
inside each layer the modules whose output a declared ``rowwise`` projection ends (the attention,
the MLP) gather the sequence at their input and the ``rowwise`` projection reduce-scatters its
sums back to shards; the layer's norms (``input_layernorm``, ``post_attention_layernorm``) and
the final norm run on the shards, their weights' partial gradients summed once per step; the head
gathers the sequence. A pipeline stage before the last gathers its last layer's output, so stages
hand each other the whole sequence. A layer module between them that is not a norm (it could mix
tokens) is refused, naming it.

Loss parallel: the head's logits stay split over the vocabulary (``colwise`` without the
gather) and the model's own cross-entropy runs in torch's ``loss_parallel()`` (the Engine's loss
context), so no rank holds the whole (tokens x vocabulary) logits.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ParallelStyle, PrepareModuleInput, PrepareModuleInputOutput, PrepareModuleOutput,
)

from meshtrain.errors import ConfigError
from meshtrain.models.hf.support import PipelinePlan, declared_plan, get_module
from meshtrain.parallel.tensor.sequence_parallel import (
    ColwiseFromSequence, RowwiseToSequence, gather_sequence,
)
from meshtrain.parallel.tensor.tensor_parallel import ReplicateParallel, module_matches

#: the layer modules that may run on the sequence shards (per-token normalisations)
_PER_TOKEN = ("RMSNorm", "LayerNorm")


class GatherHiddenStates(ParallelStyle):
    """The module's hidden states (its first positional input, or the ``hidden_states``
    keyword a Hugging Face layer passes its attention), sharded on the sequence dim, gathered
    whole (a replicated DTensor; backward: reduce-scatter); the other inputs untouched."""

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        def gather(_, args, kwargs):
            if args:
                return (gather_sequence(args[0], device_mesh, 1), *args[1:]), kwargs
            kwargs["hidden_states"] = gather_sequence(kwargs["hidden_states"], device_mesh, 1)
            return args, kwargs

        module.register_forward_pre_hook(gather, with_kwargs=True)
        return module


class TakeSequenceShard(ParallelStyle):
    """The first layer's input (the whole sequence) cut to this rank's share (backward: the
    shards' gradients gathered); ``gather_output``: the layer's output gathered whole again
    (the last layer of a pipeline stage before the last). Refuses a length tp does not divide."""

    def __init__(self, gather_output: bool = False):
        super().__init__()
        self.gather_output = gather_output

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        tp = device_mesh.size()

        def check(_, args):
            if args and isinstance(args[0], torch.Tensor) and args[0].size(1) % tp:
                raise ConfigError(
                    f"sequence_parallel splits the tokens over tp={tp} ranks, but the batch "
                    f"holds {args[0].size(1)} per sequence; use a sequence length that divides "
                    "by tp, or turn sequence_parallel off")

        module.register_forward_pre_hook(check)
        cut = dict(input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),))
        gather = dict(output_layouts=(Shard(1),), desired_output_layouts=(Replicate(),),
                      use_local_output=True)
        style = (PrepareModuleInputOutput(**cut, use_local_input=True, **gather)
                 if self.gather_output else PrepareModuleInput(**cut, use_local_output=True))
        return style._apply(module, device_mesh)


def _head(loss_parallel: bool, sequence_parallel: bool) -> ParallelStyle:
    return ColwiseFromSequence(input_layouts=Shard(1) if sequence_parallel else Replicate(),
                               output_layouts=Shard(-1) if loss_parallel else Replicate(),
                               use_local_output=not loss_parallel)


def sequence_plan(model: nn.Module, plan: dict[str, ParallelStyle], *, sequence_parallel: bool,
                  loss_parallel: bool) -> dict[str, ParallelStyle]:
    """``plan`` (models/hf/tp.py's, from the declared one) with sequence and/or loss parallel:
    see the module's doc. Raises ``ConfigError`` where the model does not fit."""
    name = type(model).__name__
    declared = declared_plan(model)
    heads = [p for p, style in declared.items() if style in ("colwise_gather_output",
                                                             "colwise_rep")]
    plan = dict(plan)
    for pattern in heads:  # the head: its logits split (loss parallel), its input gathered
        plan[pattern] = _head(loss_parallel, sequence_parallel)
    if loss_parallel and not heads:
        raise ConfigError(f"loss_parallel needs {name}'s tensor-parallel plan to split its "
                          "head (lm_head: colwise_gather_output); it does not: turn it off")
    if not sequence_parallel:
        return plan
    try:
        pipeline = PipelinePlan(model)
    except ConfigError as error:
        raise ConfigError(f"sequence_parallel for {name} needs its pipeline plan to find the "
                          f"layers and the final norm: {error}") from None
    prefix = f"{model.base_model_prefix}."
    layers = get_module(pipeline.base, pipeline.layers)
    keys = list(layers._modules)
    rowwise = [p for p, style in declared.items() if style == "rowwise"]
    for pattern in rowwise:
        plan[pattern] = RowwiseToSequence(output_layouts=Shard(1))
    for index, key in enumerate(keys):
        layer_name = f"{prefix}{pipeline.layers}.{key}"
        pairs = set()
        for child_name, child in layers[index].named_children():
            full = f"{layer_name}.{child_name}"
            if any(module_matches(f"{full}.{n}", p) for n, _ in child.named_modules() if n
                   for p in rowwise):
                pairs.add(child_name)
                plan[full] = GatherHiddenStates()
            elif any(True for _ in child.parameters()) or not type(child).__name__.endswith(
                    ("Dropout", "Identity")):
                if not type(child).__name__.endswith(_PER_TOKEN):
                    raise ConfigError(
                        f"sequence_parallel runs {name}'s layer modules between the attention "
                        f"and the MLP on a share of the tokens, but {full} is a "
                        f"{type(child).__name__}, not a norm meshtrain knows to be per token; "
                        "turn sequence_parallel off")
                plan[full] = ReplicateParallel(local_input=True)
        if len(pairs) < 1:
            raise ConfigError(f"sequence_parallel: {layer_name} holds no module that the plan "
                              "ends with a rowwise projection; turn sequence_parallel off")
    last_stage = model.get_output_embeddings() is not None
    first, last = f"{prefix}{pipeline.layers}.{keys[0]}", f"{prefix}{pipeline.layers}.{keys[-1]}"
    plan[first] = TakeSequenceShard(gather_output=first == last and not last_stage)
    if not last_stage and first != last:
        plan[last] = PrepareModuleOutput(output_layouts=(Shard(1),),
                                         desired_output_layouts=(Replicate(),),
                                         use_local_output=True)
    for key in pipeline.post:  # the final norm (on the last stage: a stand-in before it)
        module = get_module(pipeline.base, key)
        if type(module).__name__.endswith(_PER_TOKEN):
            plan[f"{prefix}{key}"] = ReplicateParallel(local_input=True)
    return plan

