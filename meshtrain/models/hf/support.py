"""Which layouts a Hugging Face model can take, from what it declares: a tensor-parallel plan of
styles meshtrain implements (tp.py), a pipeline plan of the shape it cuts (pipeline.py). A
refusal asks here before it recommends another layout, so it never sends a model from one
refused layout to another."""

from __future__ import annotations

import torch.nn as nn

from meshtrain.errors import ConfigError

#: transformers' tensor-parallel styles meshtrain implements (tp.py's STYLES, checked there)
TP_STYLE_NAMES = frozenset({
    "colwise", "colwise_gather_output", "colwise_rep", "rowwise", "rowwise_split_input",
    "rowwise_rep", "embedding_rowwise", "embedding_colwise", "replicated_with_grad_allreduce",
    "replicate"})


def declared_plan(model: nn.Module) -> dict[str, str]:
    """The model's own plan, module pattern -> style name (``{}`` when it declares none)."""
    plan = getattr(model, "tp_plan", None)
    return dict(plan) if isinstance(plan, dict) else {}


def supports_tp(model: nn.Module) -> bool:
    """Does this Hugging Face model declare a plan of styles meshtrain implements? (A refusal
    that recommends tp asks this first.)"""
    declared = declared_plan(model)
    return bool(declared) and all(style in TP_STYLE_NAMES for style in declared.values())


def others(model: nn.Module, instead_of: str) -> str:
    """The layouts to train ``model`` with instead of ``instead_of`` ("tp" or "pp"): the other
    one only where the model supports it (StableLm declares neither; pp not while a router loss
    is on, which a pipeline cannot carry), and ep where its experts can be split."""
    from meshtrain.models.hf.moe import hf_expert_layers, hf_router_loss

    name, supported = {"tp": ("pp", supports_pp), "pp": ("tp", supports_tp)}[instead_of]
    if name == "pp":
        try:
            loss = hf_router_loss(model)
            carried = loss is None or getattr(loss, "pipelines", False)
        except ConfigError:  # (a config refused for itself: said where it is checked)
            carried = False
    else:
        carried = True
    return "dp, zero1-3" + (f", {name}" if carried and supported(model) else "") + (
        ", ep" if hf_expert_layers(model) else "")


class PipelinePlan:
    """A model's pipeline plan, read: where the layers are and what runs before and after."""

    def __init__(self, model: nn.Module):
        name = type(model).__name__
        base = getattr(model, "base_model", None)
        full = getattr(model, "pp_plan", None) or {}
        own = getattr(base, "pp_plan", None) or {}
        if base is None or base is model or not own:
            raise ConfigError(
                f"{name} declares no pipeline plan (transformers' config.base_model_pp_plan, and "
                "a head such as a ...ForCausalLM's lm_head), so meshtrain cannot tell which "
                f"modules run in which order; train it without pp ({others(model, 'pp')})")
        prefix = model.base_model_prefix
        layers = [key for key in own if isinstance(get_module(base, key), nn.ModuleList)]
        embeds = [key for key, (inputs, _) in own.items() if list(inputs) == ["input_ids"]]
        if len(layers) != 1 or len(embeds) != 1 or list(own).index(embeds[0]) != 0:
            raise ConfigError(
                f"{name}'s pipeline plan {dict(own)} does not have the shape meshtrain pipelines: "
                "first the embedding (input_ids -> inputs_embeds), one list of layers, then the "
                f"modules after it; train it without pp ({others(model, 'pp')})")
        at = list(own).index(layers[0])
        self.base, self.layers, self.embed = base, layers[0], embeds[0]
        self.pre = list(own)[1:at]  # on the first stage only, e.g. an embedding dropout
        self.post = list(own)[at + 1:]  # on the last stage only, e.g. the final norm
        self.head = [key for key in full if not key.startswith(f"{prefix}.")]  # e.g. lm_head
        self.post_modules = tuple(f"{prefix}.{k}" for k in self.post) + tuple(self.head)


def supports_pp(model: nn.Module) -> bool:
    """Does this Hugging Face model declare a pipeline plan meshtrain can cut? (A refusal that
    recommends pp asks this first.)"""
    try:
        PipelinePlan(model)
    except ConfigError:
        return False
    return True




def get_module(module: nn.Module, name: str):
    """The submodule at dotted ``name``, or None (a module a stage does not hold)."""
    for part in name.split("."):
        module = getattr(module, part, None)
    return module
