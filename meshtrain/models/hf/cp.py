"""Context parallel for Hugging Face causal LMs, without changing their code.

transformers routes every attention through a registry (``AttentionInterface``); a model that
declares ``_supports_attention_backend`` calls whatever function its ``config._attn_implementation``
names. :class:`HFContextParallel` registers :func:`cp_attention_function` there: this rank's
queries over the keys and values of every cp rank
(:func:`meshtrain.parallel.context.context_parallel.cp_attention`), with the causal mask built from the
tokens' global positions and, when the layer passes one, its sliding window; packed documents
(``position_ids`` restarting at each, meshtrain.packing) are kept apart as one process keeps
them. Each batch
``{"input_ids", "labels"}`` is cut by the zig-zag order, with ``position_ids`` for the model's
positions and the labels shifted *before* the cut (``shift_labels``: a token's target may sit on
another rank).

What the attention path does not implement is refused before any process starts, naming the
config field (:data:`UNSUPPORTED`); an attention option the registry passes that is not
implemented stops the first step with the same message.
"""

from __future__ import annotations

import inspect

import torch
import torch.nn as nn

from meshtrain.errors import ConfigError

_NAME = "meshtrain_context_parallel"

#: config fields that change attention in a way meshtrain's cp attention does not compute:
#: field -> what it does (refused when set)
UNSUPPORTED = {
    "attn_logit_softcapping": "soft-capping of the attention logits",
    "attention_chunk_size": "chunked (block-local) attention",
    "use_bidirectional_attention": "bidirectional attention",
}

#: keyword arguments a model's attention may pass to the registered function that change the
#: result -> the config field that sets them
_UNSUPPORTED_KWARGS = {"softcap": "attn_logit_softcapping", "s_aux": "sinks (attention sinks)"}


def cp_attention_function(module, query, key, value, attention_mask, dropout: float = 0.0,
                          scaling: float | None = None, sliding_window: int | None = None,
                          **kwargs):
    """The function registered with transformers: ``query`` ``(batch, heads, local_len, dim)``
    of this rank's tokens, ``key``/``value`` with the model's K/V heads (only they travel between
    the ranks; grouped-query attention serves each to its query heads). ``attention_mask`` (built by the model for the local
    tokens) is not used: the mask comes from the global positions; padding is refused when the
    batch is cut."""
    from meshtrain.parallel.context.context_parallel import cp_attention

    for name, field in _UNSUPPORTED_KWARGS.items():
        if kwargs.get(name) is not None:
            raise ConfigError(f"context parallel does not implement {name} ({field} in the "
                              f"model's config); drop cp from the layout")
    out = cp_attention(query, key, value, module.meshtrain_cp_mesh, dropout_p=dropout,
                       scale=scaling, kv_groups=query.size(1) // key.size(1),
                       window=sliding_window, documents=module.meshtrain_cp_batch.get("documents"))
    return out.transpose(1, 2).contiguous(), None


class HFContextParallel:
    """What makes a Hugging Face causal LM context parallel (see the module's doc). The Engine
    passes ``num_items_in_batch`` (the step's targets over the loss ranks), so the mean of the
    cp ranks' losses is the loss over the whole sequence."""

    def __init__(self, model: nn.Module):
        self.model = model

    def check_context_parallel(self, cp_degree: int) -> None:
        name, config = type(self.model).__name__, self.model.config
        if not getattr(self.model, "_supports_attention_backend", False):
            raise ConfigError(
                f"{name} has no context-parallel support: its attention does not go through "
                "transformers' attention registry (_supports_attention_backend is False), so "
                "meshtrain cannot give it the keys and values of the other ranks; drop cp from "
                "the layout")
        if "position_ids" not in inspect.signature(self.model.forward).parameters:
            raise ConfigError(f"{name}.forward takes no position_ids, which context parallel "
                              "needs to place each rank's tokens; drop cp from the layout")
        sinks = next((n for n, m in self.model.named_modules()
                      if isinstance(getattr(m, "sinks", None), torch.Tensor)), None)
        if sinks is not None:  # (GPT-OSS: its attention passes them as s_aux)
            raise ConfigError(
                f"{name} has attention sinks ({sinks}.sinks: a learned logit per head in each "
                "softmax), which meshtrain's context-parallel attention does not implement; "
                "drop cp from the layout")
        for field, what in UNSUPPORTED.items():
            if getattr(config, field, None) not in (None, False):
                raise ConfigError(
                    f"{name} sets {field}={getattr(config, field)!r} ({what}), which meshtrain's "
                    "context-parallel attention does not implement (it computes causal "
                    "attention, with the layer's sliding window if any); drop cp from the "
                    f"layout, or build the model with {field}=None")

    def enable_context_parallel(self, cp_mesh) -> None:
        """Route the model's attention through :func:`cp_attention_function` over ``cp_mesh``
        (None: back to the attention it used before)."""
        from transformers import AttentionInterface

        AttentionInterface.register(_NAME, cp_attention_function)
        config = self.model.config
        if config._attn_implementation != _NAME:
            config.meshtrain_attention_before_cp = config._attn_implementation
        config._attn_implementation = _NAME if cp_mesh is not None else \
            config.meshtrain_attention_before_cp
        batch: dict = {}  # what the current batch tells every layer (its documents)
        for module in self.model.modules():  # the function finds the mesh on its module
            module.meshtrain_cp_mesh, module.meshtrain_cp_batch = cp_mesh, batch

    def shard_context_parallel_batch(self, batch: dict, cp_mesh) -> dict:
        from meshtrain.packing import document_ids
        from meshtrain.parallel.context.context_parallel import shard_sequence

        if not isinstance(batch, dict) or "input_ids" not in batch:
            raise ConfigError("context parallel of a Hugging Face model needs dict batches with "
                              f"'input_ids' (and 'labels'), got {type(batch).__name__}")
        mask = batch.get("attention_mask")
        if mask is not None and not bool(mask.all()):
            raise ConfigError("context parallel does not support padding (an attention_mask "
                              "with zeros); pack the sequences to full length instead")
        rank, degree = cp_mesh.get_local_rank(), cp_mesh.size()
        ids = batch["input_ids"]
        out = {k: v for k, v in batch.items() if k not in ("input_ids", "labels", "attention_mask")}
        out["input_ids"] = shard_sequence(ids, rank, degree)
        positions = batch.get("position_ids")  # (packed documents: restarting at each)
        documents = None
        if positions is None:
            positions = torch.arange(ids.size(1), device=ids.device)
        else:  # which document each token is in, once per batch, before the cut
            documents = document_ids(positions.expand_as(ids))
            documents = documents if bool(documents[:, -1].any()) else None
        shared = getattr(self.model, "meshtrain_cp_batch", None)  # (enable_context_parallel's)
        if shared is not None:
            shared["documents"] = documents
        out["position_ids"] = shard_sequence(positions.expand_as(ids), rank, degree)
        labels = batch.get("labels")
        if labels is not None:
            shifted = nn.functional.pad(labels[:, 1:], (0, 1), value=-100)
            # the loss is this rank's sum over its tokens divided by num_items_in_batch, which
            # the Engine sets from the whole step's count (meshtrain.losses, hf_loss_items)
            out["labels"] = out["shift_labels"] = shard_sequence(shifted, rank, degree)
        return out


def hf_cp_support(model: nn.Module) -> HFContextParallel | None:
    """For :func:`meshtrain.parallel.context.context_parallel.cp_support`: the adapter of a Hugging Face
    model (None for other models, which bring their own methods)."""
    from meshtrain.models.hf import is_hf_model

    return HFContextParallel(model) if is_hf_model(model) else None
