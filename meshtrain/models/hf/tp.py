"""Tensor parallel for Hugging Face models, from the plan each model declares.

``transformers`` declares per architecture how each module splits over a tensor-parallel group:
the model's ``tp_plan`` property, made of ``config.base_model_tp_plan`` under the base model's
prefix and the head's ``_tp_plan`` (e.g. ``{"model.layers.*.self_attn.q_proj": "colwise",
"model.layers.*.self_attn.q_norm": "replicated_with_grad_allreduce", "lm_head":
"colwise_gather_output"}``). :func:`hf_tp_plan` translates every style into a DTensor
``ParallelStyle`` (:data:`STYLES`) and checks that the sizes it splits divide by the degree; a
style meshtrain does not implement, a model without a plan, a mixture-of-experts model (its experts
are not split by tp: ep splits them), or a split that does not divide is a ``ConfigError`` naming
the module and the fix, before any process starts. Modules the plan does not name (norms that see
the whole hidden state, a head the plan leaves out) are replicated by ``apply_tp``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch.nn as nn
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

from meshtrain.errors import ConfigError
from meshtrain.models.hf.support import TP_STYLE_NAMES, declared_plan, others
from meshtrain.parallel.tensor.tensor_parallel import ReplicateParallel, check_divides, module_matches


def _colwise(gather: bool) -> Callable[[], ParallelStyle]:
    return lambda: ColwiseParallel(output_layouts=Replicate()) if gather else ColwiseParallel()


def _rowwise(split_input: bool) -> Callable[[], ParallelStyle]:
    return lambda: RowwiseParallel(input_layouts=Replicate()) if split_input else RowwiseParallel()


#: transformers' style name -> (the DTensor style, the module type it applies to, the attribute
#: whose size it splits, or None). Names as ``transformers.distributed.tensor_parallel`` registers
#: them; their meaning:
#: colwise: output features split, output left split (this rank's heads or MLP units);
#: rowwise: input features split (the input arrives split), outputs summed over the ranks;
#: colwise_gather_output (= colwise_rep): split, then the output gathered whole;
#: rowwise_split_input (= rowwise_rep): a whole input cut locally, outputs summed;
#: embedding_rowwise / embedding_colwise: vocabulary rows / hidden columns split, output whole;
#: replicated_with_grad_allreduce: parameters whole on every rank, the module run on this rank's
#: part of a split activation (a per-head norm after a colwise projection), gradients summed;
#: replicate: parameters whole, the module run on whole activations.
STYLES: dict[str, tuple[Callable[[], ParallelStyle], type, str | None]] = {
    "colwise": (_colwise(False), nn.Linear, "out_features"),
    "colwise_gather_output": (_colwise(True), nn.Linear, "out_features"),
    "colwise_rep": (_colwise(True), nn.Linear, "out_features"),
    "rowwise": (_rowwise(False), nn.Linear, "in_features"),
    "rowwise_split_input": (_rowwise(True), nn.Linear, "in_features"),
    "rowwise_rep": (_rowwise(True), nn.Linear, "in_features"),
    "embedding_rowwise": (lambda: RowwiseParallel(input_layouts=Replicate(),
                                                  output_layouts=Replicate()),
                          nn.Embedding, "num_embeddings"),
    "embedding_colwise": (lambda: ColwiseParallel(input_layouts=Replicate(),
                                                  output_layouts=Replicate()),
                          nn.Embedding, "embedding_dim"),
    "replicated_with_grad_allreduce": (lambda: ReplicateParallel(local_input=True), nn.Module,
                                       None),
    "replicate": (ReplicateParallel, nn.Module, None),
}

assert set(STYLES) == TP_STYLE_NAMES, "support.py's style names and STYLES differ"

#: styles whose output stays split across the ranks: the attention that follows reshapes it into
#: this rank's heads, so the head counts must divide by the degree too
_LEAVES_HEADS_SPLIT = ("colwise",)


def _refuse_no_plan(model: nn.Module) -> ConfigError:
    name = type(model).__name__
    return ConfigError(
        f"{name} declares no tensor-parallel plan (transformers' config.base_model_tp_plan is "
        f"empty for {type(model.config).__name__}), so meshtrain cannot tell which of its modules "
        f"may be split; train it without tp ({others(model, 'tp')}), or pass your own plan as "
        "Trainer(tp_plan={module name: ParallelStyle}) and check it with meshtrain parity")


#: why tp is refused for a Hugging Face MoE model (the planner says the same: plan/planner.py)
NO_EXPERT_TP = "meshtrain does not split a Hugging Face model's experts by tensor parallel"


def _refuse_experts(model: nn.Module, tp: int | None) -> ConfigError | None:
    """A mixture-of-experts model under tp: the refusal saying why and what splits it (ep),
    whatever its declared plan names (transformers' plans name the dense MLP's projections,
    which its MoE layers do not have); None for a model without experts."""
    from meshtrain.models.hf.moe import hf_expert_layers

    layers = hf_expert_layers(model)
    held = [name for name, _ in model.named_modules() if name.rsplit(".", 1)[-1] == "experts"]
    if not layers and not held:
        return None
    count = layers[0].num_experts if layers else None
    degree = tp if tp and count and count % tp == 0 else 2
    what = (f"{count} experts in each of {len(layers)} MoE layer{'s' * (len(layers) > 1)}"
            if layers else f"{held[0]}, ...")
    instead = (f"split the experts with ep: layout=\"ep={degree}\" (the rest data parallel over "
               f"the same processes) or \"dp_shard={degree},ep={degree}\" (the rest sharded); "
               if layers else "")
    return ConfigError(
        f"tp: {type(model).__name__} is a mixture-of-experts model ({what}) and {NO_EXPERT_TP} "
        f"(nor offers tp for the attention alone); {instead}layouts without tp: "
        f"{others(model, 'tp')}")


def hf_tp_plan(model: nn.Module, tp: int | None = None) -> dict[str, ParallelStyle]:
    """The model's declared plan as DTensor styles, module pattern -> ``ParallelStyle``.

    Patterns that name no module of ``model`` (a pipeline stage holds some) are dropped. With
    ``tp`` the sizes each style splits, and for a split attention the head counts, are checked
    to divide by it. Raises ``ConfigError`` for a mixture-of-experts model, a model without a
    plan, a style meshtrain does not implement, or a style on a module it cannot split.
    """
    experts = _refuse_experts(model, tp)
    if experts is not None:
        raise experts
    declared = declared_plan(model)
    if not declared:
        raise _refuse_no_plan(model)
    modules = list(model.named_modules())
    if tp is not None and any(style in _LEAVES_HEADS_SPLIT for style in declared.values()):
        config = model.config  # the attention reshapes a split projection into local heads
        heads = getattr(config, "num_attention_heads", None)
        sizes = {"num_attention_heads": heads,
                 "num_key_value_heads": getattr(config, "num_key_value_heads", None) or heads}
        check_divides({k: v for k, v in sizes.items() if isinstance(v, int)}, tp,
                      hint={k: "or change the model's config" for k in sizes})
    plan: dict[str, ParallelStyle] = {}
    for pattern, style in declared.items():
        if style not in STYLES:
            raise ConfigError(
                f"{type(model).__name__}'s tensor-parallel plan (transformers' tp_plan) marks "
                f"{pattern} as {style!r}, which meshtrain does not implement (it implements "
                f"{', '.join(sorted(STYLES))}); train it without tp ({others(model, 'tp')}), or "
                "pass your own Trainer(tp_plan=...) that leaves that module whole")
        make, kind, split_size = STYLES[style]
        for name, module in modules:
            if not module_matches(name, pattern):
                continue
            if not isinstance(module, kind):
                raise ConfigError(
                    f"{type(model).__name__}'s tensor-parallel plan marks {name} as {style!r}, "
                    f"which splits an {kind.__name__}, but {name} is a {type(module).__name__}; "
                    f"train it without tp ({others(model, 'tp')}), or pass your own "
                    "Trainer(tp_plan=...)")
            if tp is not None and split_size is not None:
                check_divides({f"{split_size} of {name}": getattr(module, split_size)}, tp)
        plan[pattern] = make()
    return plan


def default_tp_plan(model: nn.Module, tp: int | None = None, *, sequence_parallel: bool = False,
                    loss_parallel: bool = False) -> dict[str, ParallelStyle] | None:
    """The declared plan of a Hugging Face model, or ``None`` for other models (which supply
    their own); with sequence and/or loss parallel built on it (models/hf/tp_sequence.py)."""
    from meshtrain.models.hf import is_hf_model

    if not is_hf_model(model):
        return None
    plan = hf_tp_plan(model, tp)
    if sequence_parallel or loss_parallel:
        from meshtrain.models.hf.tp_sequence import sequence_plan

        plan = sequence_plan(model, plan, sequence_parallel=sequence_parallel,
                             loss_parallel=loss_parallel)
    return plan


def hf_tp_plans(tp_degree: int, sequence_parallel: bool, loss_parallel: bool):
    """For models that supply no ``tp_plan`` of their own: a function module -> meshtrain's
    plan for a Hugging Face model (None for other models); None without ``tp``."""
    def plan_for(module):
        return default_tp_plan(module, tp_degree, sequence_parallel=sequence_parallel,
                               loss_parallel=loss_parallel)
    return plan_for if tp_degree > 1 else None
