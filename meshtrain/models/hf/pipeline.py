"""Pipeline parallel for Hugging Face causal LMs, from the pipeline plan each model declares.

transformers declares per architecture the modules a pipeline runs in order and the tensors
between them: the model's ``pp_plan`` (``config.base_model_pp_plan`` under the base model's
prefix, plus the head's ``_pp_plan``), e.g. ``model.embed_tokens`` (``input_ids`` ->
``inputs_embeds``), ``model.layers`` (``hidden_states`` -> ``hidden_states``), ``model.norm``,
``lm_head`` (-> ``logits``). :class:`HFPipeline` is what the Trainer hands to parallel/ as
``PipelineOptions.adapter`` (through :func:`meshtrain.models.hf.hf_pp_support`). A stage is a
pruned deep copy of the model with full-model parameter names (``model.layers.3.mlp...``): the
layers it holds (:class:`StageLayers`), the modules before them on the first stage only, those
after them on the last stage only. It runs the model's *own* forward, so masks (causal, sliding
window, per-layer attention types), positions and rotary embeddings are computed as the model
computes them: the first stage from ``input_ids``, the others from ``inputs_embeds`` (the hidden
state), each with the config's ``layer_types`` cut to its layers; the last stage returns the
logits. pipeline/check.py verifies before any process starts, on samples of the configured
length, that stages of one layer each compose to the model's forward, and refuses the model
otherwise (e.g. a forward that scales ``inputs_embeds`` again on every stage).

The last stage's loss is :data:`causal_lm_loss` (the same as the model's own: targets shifted
by one, a mean over the global batch's tokens): batches ``{"input_ids", "labels"}`` are split into
``(input_ids, labels)``, so ``fit`` needs no ``loss_fn`` under pp either.
"""

from __future__ import annotations

import contextlib
import copy
import types

import torch
import torch.nn as nn

from meshtrain.errors import ConfigError
from meshtrain.losses import GlobalMeanLoss
from meshtrain.models.hf.support import PipelinePlan, get_module


class CausalLMLoss(GlobalMeanLoss):
    """Next-token cross-entropy as ``transformers``' ``ForCausalLMLoss`` computes it: logits
    at position ``t`` against ``labels[t + 1]`` (``-100`` ignored), in fp32; a global mean over
    the tokens with a target (meshtrain.losses: the call returns the sum, :meth:`count` the
    tokens). ``output``: the logits, or the model's output (``.logits``)."""

    def __init__(self):
        pass

    def __call__(self, output, labels: torch.Tensor) -> torch.Tensor:
        logits = getattr(output, "logits", output)
        targets = nn.functional.pad(labels[:, 1:], (0, 1), value=-100).to(logits.device)
        return nn.functional.cross_entropy(logits.float().flatten(0, 1), targets.flatten(),
                                           ignore_index=-100, reduction="sum")

    def count(self, labels: torch.Tensor) -> torch.Tensor:
        return (labels[:, 1:] != -100).sum()

    def __repr__(self) -> str:
        return "causal_lm_loss"


causal_lm_loss = CausalLMLoss()


class StageLayers(nn.ModuleList):
    """A stage's layers under their indices in the whole model (``"3"``, ``"4"``: parameter
    names stay the full model's); iterated, measured and sliced like the ``nn.ModuleList`` it
    replaces (a slice is a plain list, enough for the model's ``for layer in self.layers[:n]``)."""

    def __init__(self, layers: dict[str, nn.Module]):
        super().__init__()
        for name, layer in layers.items():
            self.add_module(name, layer)

    def __getitem__(self, index):
        return list(self._modules.values())[index]


def _set(module: nn.Module, name: str, value) -> None:
    owner, _, attr = name.rpartition(".")
    setattr(module.get_submodule(owner) if owner else module, attr, value)


def _tied(model: nn.Module) -> bool:
    """Does the output head reuse the input embedding's weight (``tie_word_embeddings``)?"""
    head, embed = model.get_output_embeddings(), model.get_input_embeddings()
    return head is not None and embed is not None and head.weight is embed.weight


@contextlib.contextmanager
def _as_stage(model: nn.Module, keep: list[int], first: bool, last: bool):
    """``model`` changed into the stage holding layers ``keep`` (and the first/last stage's
    modules), restored on exit: what :meth:`HFPipeline.split` keeps, without copying. The last
    stage of a model with tied embeddings keeps the input embedding too (never called there: it
    holds the head's weight under the model's own name, parallel/pipeline/tied.py)."""
    plan = PipelinePlan(model)
    base, config = plan.base, model.config
    layers = get_module(base, plan.layers)
    names = list(layers._modules)
    changes = {plan.layers: StageLayers({names[i]: layers[i] for i in keep})}
    if not first and not (last and _tied(model)):
        changes[plan.embed] = None  # the hidden state comes in as inputs_embeds
        changes.update({key: nn.Identity() for key in plan.pre})
    if not last:
        changes.update({key: nn.Identity() for key in plan.post})
    saved = {key: get_module(base, key) for key in changes}
    layer_types = getattr(config, "layer_types", None)
    try:
        for key, value in changes.items():
            _set(base, key, value)
        if isinstance(layer_types, list) and len(layer_types) == len(names):
            config.layer_types = [layer_types[i] for i in keep]  # the model indexes them by i
        yield plan
    finally:
        for key, value in saved.items():
            _set(base, key, value)
        if layer_types is not None:
            config.layer_types = layer_types


def run_stage(model: nn.Module, x: torch.Tensor, first: bool, last: bool,
              position_ids: torch.Tensor | None = None) -> torch.Tensor:
    """The model's own forward on a stage: from token ids when ``first``, else from the hidden
    state (``inputs_embeds``); the logits when ``last``, else the hidden state. ``position_ids``:
    the batch's (packed documents: each stage's attention keeps to them, meshtrain.packing)."""
    inputs = {"input_ids" if first else "inputs_embeds": x, "use_cache": False}
    if position_ids is not None:
        inputs["position_ids"] = position_ids.to(x.device)
    if last:
        return type(model).forward(model, **inputs).logits
    return model.base_model(**inputs)[0]


def _stage_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    side = getattr(self, "_pp_side", None)  # this micro-batch's position ids (runner.py)
    positions = side[self._pp_chunk].get("position_ids") if side else None
    if x.is_meta:  # torch's shape inference: positions change no shape
        positions = None
    return run_stage(self, x, self._pp_first, self._pp_last, positions)


class HFPipeline:
    """How parallel/pipeline*.py cuts, runs and checks a Hugging Face causal LM."""

    #: the last stage's loss when ``fit`` gets no ``loss_fn``
    loss_fn = causal_lm_loss
    #: what the stages run, for the forward check's message
    stages_doc = (
        "Each stage runs the model's own forward on its layers (meshtrain/models/hf/pipeline.py): "
        "the first from input_ids, the others from the previous stage's hidden state passed as "
        "inputs_embeds; the modules the pipeline plan (model.pp_plan) lists before the layers run "
        "on the first stage only, those after them on the last. A model whose forward does more "
        "with inputs_embeds on every stage (a scale, a norm) cannot be pipelined this way: train "
        "it without pp.")

    #: config fields that scale inputs_embeds inside the model's forward, so every stage
    #: (given the previous stage's hidden state as inputs_embeds) applies them again
    EMBEDDING_SCALES = ("embedding_multiplier", "scale_emb", "embedding_scale")

    def __init__(self, model: nn.Module):
        self.name = type(model).__name__
        self.post_modules = PipelinePlan(model).post_modules if isinstance(model, nn.Module) else ()

    def blocks(self, model: nn.Module) -> list[nn.Module]:
        """The layers (of the whole model, or of a stage from :meth:`split`)."""
        plan = PipelinePlan(model)
        return list(get_module(plan.base, plan.layers))

    def split(self, model: nn.Module, split_points: list[int], stage_index: int) -> nn.Module:
        """Stage ``stage_index``, cut before each layer index in ``split_points``."""
        n = len(self.blocks(model))
        bounds = [0, *split_points, n]
        if any(a >= b for a, b in zip(bounds, bounds[1:])) or not (
                0 <= stage_index < len(bounds) - 1):
            raise ConfigError(f"split_points {list(split_points)} / stage {stage_index} do not "
                              f"cut {n} layers into stages")
        first, last = stage_index == 0, stage_index == len(bounds) - 2
        keep = list(range(bounds[stage_index], bounds[stage_index + 1]))
        with _as_stage(model, keep, first, last) as plan:
            stage = copy.deepcopy(model)  # (its config holds the stage's layer_types)
        if not last:
            for key in plan.head:
                _set(stage, key, None)
        stage._pp_first, stage._pp_last = first, last
        stage.forward = types.MethodType(_stage_forward, stage)
        return stage

    def split_batch(self, batch) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs of the first stage, targets of the last stage's loss)."""
        if isinstance(batch, (tuple, list)) and len(batch) == 2:
            return batch[0], batch[1]
        if not isinstance(batch, dict) or not {"input_ids", "labels"} <= set(batch):
            raise ConfigError(f"pipelining {self.name} needs batches {{'input_ids', 'labels'}}"
                              f" or (input_ids, labels) pairs, got {type(batch).__name__}")
        mask = batch.get("attention_mask")
        if mask is not None and not bool(mask.all()):
            raise ConfigError("pipeline parallel of a Hugging Face model does not support "
                              "padding (an attention_mask with zeros); pack the sequences")
        extra = sorted(set(batch) - {"input_ids", "labels", "attention_mask", "position_ids"})
        if extra:
            raise ConfigError(f"pipeline parallel of {self.name} takes batches with input_ids, "
                              f"labels and position_ids only; got also {extra}")
        return batch["input_ids"], batch["labels"]

    def side_inputs(self, batch) -> dict | None:
        """What every stage reads beside the hidden state: the batch's ``position_ids`` (packed
        documents), or None."""
        if isinstance(batch, dict) and batch.get("position_ids") is not None:
            return {"position_ids": batch["position_ids"]}
        return None

    def stage_forward(self, model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """Stages of one layer each, run one after another on the whole model (changed in place
        into each stage and restored): every cut a partition could make is exercised."""
        n = len(self.blocks(model))
        for i in range(n):
            with _as_stage(model, [i], i == 0, i == n - 1):
                x = run_stage(model, x, i == 0, i == n - 1)
        return x

    def suspects(self, model: nn.Module) -> list[str]:
        """The config fields likely behind a failed forward check, for its message."""
        config = getattr(model, "config", None)
        return [f"config.{field}={getattr(config, field)!r} scales inputs_embeds in the model's "
                "forward, so every stage would scale the previous stage's hidden state again"
                for field in self.EMBEDDING_SCALES
                if getattr(config, field, None) not in (None, 1, 1.0)]

    def model_output(self, output) -> torch.Tensor:
        """The tensor of ``model(input_ids)`` that the stages' output must equal."""
        return getattr(output, "logits", output)

    def example_inputs(self, model: nn.Module) -> torch.Tensor:
        """Token ids for the forward check when no training sample is at hand: 2 sequences as
        long as the model's positions allow (at most 4096 tokens)."""
        config = model.config
        length = min(4096, getattr(config, "max_position_embeddings", 16) or 16)
        gen = torch.Generator().manual_seed(0)
        return torch.randint(0, config.vocab_size, (2, length), generator=gen)
