"""Pipeline parallel for Llama-style Hugging Face causal LMs (``*ForCausalLM``: blocks at
``model.model.layers``), without changing their code.

:class:`HFPipeline` is what the Trainer hands to parallel/ as ``PipelineOptions.adapter``
(through :func:`meshtrain.models.hf.hf_pp_support`). Each stage is a pruned deep copy of the
model with full-model parameter names (``model.layers.3.self_attn.q_proj.weight``,
``lm_head.weight``); its forward does what ``LlamaModel.forward`` does for the stage's share:
the first stage embeds ``input_ids``; every stage computes the rotary embeddings (a module
without parameters: each stage keeps a copy) and the causal mask (``create_causal_mask``, no
padding) and calls its decoder layers with ``attention_mask``, ``position_embeddings`` and
``position_ids``; the last stage applies ``model.norm`` and ``lm_head`` and returns the logits.

The last stage's loss is :data:`causal_lm_loss` (the same as the model's own: targets shifted
by one, a mean over the global batch's tokens): batches ``{"input_ids", "labels"}`` are split into
``(input_ids, labels)``, so ``fit`` needs no ``loss_fn`` under pp either.
"""

from __future__ import annotations

import copy
import types

import torch
import torch.nn as nn

from meshtrain.errors import ConfigError
from meshtrain.losses import GlobalMeanLoss


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


def _positions(hidden: torch.Tensor) -> torch.Tensor:
    return torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)


def run_stage(model: nn.Module, x: torch.Tensor, first: bool, last: bool) -> torch.Tensor:
    """``LlamaModel.forward`` (no cache, no padding) for the layers ``model.model.layers``
    holds: embed when ``first``, norm and head when ``last``."""
    from transformers.masking_utils import create_causal_mask

    base = model.model
    if first:
        x = base.embed_tokens(x)
    positions = _positions(x)
    mask = create_causal_mask(config=base.config, inputs_embeds=x, attention_mask=None,
                              past_key_values=None, position_ids=positions)
    rope = base.rotary_emb(x, position_ids=positions)
    layers = base.layers.values() if isinstance(base.layers, nn.ModuleDict) else base.layers
    for layer in layers:
        x = layer(x, attention_mask=mask, position_embeddings=rope, position_ids=positions,
                  past_key_values=None, use_cache=False)
    if last:
        x = model.lm_head(base.norm(x))
    return x


def _stage_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return run_stage(self, x, self._pp_first, self._pp_last)


class HFPipeline:
    """How parallel/pipeline*.py cuts, runs and checks a Llama-style HF causal LM."""

    #: the last stage's loss when ``fit`` gets no ``loss_fn``
    loss_fn = causal_lm_loss
    #: modules run after the last block (the last stage's), for the forward check
    post_modules = ("model.norm", "lm_head")
    #: what the stages run, for the forward check's message
    stages_doc = (
        "The stages run what LlamaModel.forward does without cache or padding "
        "(meshtrain/models/hf_pipeline.py): model.embed_tokens on the first stage; rotary "
        "embeddings, the causal mask and the decoder layers (with attention_mask, "
        "position_embeddings, position_ids) on every stage; model.norm and lm_head on the last. "
        "A model whose forward does more cannot be pipelined this way: train it without pp.")

    def __init__(self, model: nn.Module):
        self.name = type(model).__name__

    def _check(self, model: nn.Module) -> None:
        from meshtrain.models.hf import is_llama_like

        if not (is_llama_like(model) and isinstance(getattr(model, "model", None), nn.Module)
                and hasattr(model.model, "rotary_emb") and hasattr(model, "lm_head")):
            raise ConfigError(
                f"{self.name} has no pipeline-parallel support: meshtrain pipelines Llama-style "
                "Hugging Face causal LMs (model.model.layers[i].self_attn with q/k/v/o_proj, "
                "model.model.rotary_emb, lm_head); train it without pp (dp, zero1-3)")

    def blocks(self, model: nn.Module) -> list[nn.Module]:
        """The decoder layers (of the whole model, or of a stage from :meth:`split`)."""
        layers = getattr(getattr(model, "model", None), "layers", None)
        if isinstance(layers, nn.ModuleDict):  # a stage
            return list(layers.values())
        self._check(model)
        return list(layers)

    def split(self, model: nn.Module, split_points: list[int], stage_index: int) -> nn.Module:
        """Stage ``stage_index``, cut before each layer index in ``split_points``."""
        n = len(self.blocks(model))
        bounds = [0, *split_points, n]
        if any(a >= b for a, b in zip(bounds, bounds[1:])) or not (
                0 <= stage_index < len(bounds) - 1):
            raise ConfigError(f"split_points {list(split_points)} / stage {stage_index} do not "
                              f"cut {n} layers into stages")
        head, embed = model.lm_head.weight, model.model.embed_tokens.weight
        if head is embed:
            raise ConfigError(
                f"{self.name} ties lm_head to embed_tokens (tie_word_embeddings=True), but the "
                "first and last pipeline stages cannot share a weight; build it with "
                "tie_word_embeddings=False, or train without pp")
        first, last = stage_index == 0, stage_index == len(bounds) - 2
        stage = copy.deepcopy(model)
        base = stage.model
        names = list(base.layers._modules)
        if not first:
            base.embed_tokens = None
        if not last:
            base.norm = None
            stage.lm_head = None
        keep = range(bounds[stage_index], bounds[stage_index + 1])
        base.layers = nn.ModuleDict({names[i]: base.layers[i] for i in keep})
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
        extra = sorted(set(batch) - {"input_ids", "labels", "attention_mask"})
        if extra:
            raise ConfigError(f"pipeline parallel of {self.name} takes batches with input_ids "
                              f"and labels only; got also {extra}")
        return batch["input_ids"], batch["labels"]

    def stage_forward(self, model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """What the stages compute one after another, run on the whole model."""
        return run_stage(model, x, True, True)

    def model_output(self, output) -> torch.Tensor:
        """The tensor of ``model(input_ids)`` that the stages' output must equal."""
        return getattr(output, "logits", output)

    def example_inputs(self, model: nn.Module) -> torch.Tensor:
        """Token ids for the forward check when the samples are dicts (2 x up to 16 tokens)."""
        config = model.config
        length = min(16, getattr(config, "max_position_embeddings", 16) or 16)
        gen = torch.Generator().manual_seed(0)
        return torch.randint(0, config.vocab_size, (2, length), generator=gen)
