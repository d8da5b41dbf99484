"""Hugging Face ``transformers`` causal LMs under meshtrain (optional extra ``meshtrain[hf]``).

Models are built from a config only (nothing is downloaded). Batches are dicts
``{"input_ids", "labels"}`` passed as ``model(**batch)``; the model returns ``.loss`` itself, so
``fit`` needs no ``loss_fn``::

    trainer.fit(lambda: tiny_llama(), random_token_data(), optimizer=...)

Every layout takes such a model as transformers declares it, without guessing from module
names: ``dp`` and ``zero1/2/3`` (FSDP2 shards each decoder layer, found by ``find_blocks``) work
for any of them; ``tp`` follows the model's own tensor-parallel plan (``model.tp_plan``, from
``config.base_model_tp_plan``: :mod:`meshtrain.models.hf.tp`); ``pp`` cuts the layers its
pipeline plan names (``model.pp_plan``) and runs the model's own forward on each stage
(:mod:`meshtrain.models.hf.pipeline`); ``cp`` registers meshtrain's all-gather-of-K/V attention
with transformers, honours sliding windows and cuts each batch itself
(:mod:`meshtrain.models.hf.cp`). What a path does not implement is refused before any process
starts, naming the style or config field. The loss is a mean over the targets of the whole
global batch under every layout (:func:`hf_loss_items`: meshtrain counts the targets and passes
``num_items_in_batch``); a mixture of experts' router loss is added by meshtrain over the
micro-step's global batch (:mod:`meshtrain.models.hf.moe`).
"""

from __future__ import annotations

import sys

import torch
import torch.nn as nn
from torch.utils.data import Dataset

from meshtrain.data.batch import describe
from meshtrain.errors import ConfigError
from meshtrain.models.hf.cp import HFContextParallel, hf_cp_support
from meshtrain.models.hf.moe import hf_expert_layers, hf_router_loss
from meshtrain.models.hf.pipeline import HFPipeline, causal_lm_loss
from meshtrain.models.hf.tp import default_tp_plan, hf_tp_plan, hf_tp_plans

__all__ = [
    "HFContextParallel", "RandomTokenDataset", "build_seeded", "causal_lm_loss",
    "count_lm_targets", "default_tp_plan", "hf_call_kwargs", "hf_cp_support", "hf_expert_layers",
    "hf_loss_items", "hf_pp_support", "hf_router_loss", "hf_tp_plan", "hf_tp_plans",
    "is_hf_model", "random_token_data", "tiny_causal_lm", "tiny_gpt2", "tiny_llama",
]

_INSTALL_HINT = "install the optional extra: pip install 'meshtrain[hf]' (transformers>=4.50)"


def _transformers():
    try:
        import transformers
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ConfigError(f"Hugging Face models need transformers; {_INSTALL_HINT}") from exc
    return transformers


# --- Tiny models from configs (no download) ----------------------------------------------------
def build_seeded(model_cls, config, seed: int) -> nn.Module:
    """``model_cls(config)`` initialised from ``seed`` (the caller's RNG untouched), SDPA
    attention where the class supports it (else transformers' eager attention): module by
    module as meshtrain builds a Hugging Face model from a factory (models/hf/init.py; the
    seed marked on the model, so that a factory calling this gets these values under every
    layout), or, for a model whose ``_init_weights`` leaves a tensor unwritten, by
    transformers' own initialisation from the seeded global stream."""
    from meshtrain.models.hf.init import HFCausalLM, initialises_every_tensor

    # works on CPU; no flash-attention needed
    config._attn_implementation = "sdpa" if getattr(model_cls, "_supports_sdpa", True) else "eager"
    with torch.device("meta"):
        skeleton = model_cls(config)
    if initialises_every_tensor(skeleton):
        model = HFCausalLM(model_cls, config, seed, keep_attention=True)()
        model._meshtrain_init_seed = seed
        return model
    with torch.random.fork_rng(devices=[]):  # the same weights whatever the caller's RNG state
        torch.manual_seed(seed)
        model = model_cls(config)
    return model


def tiny_llama(vocab_size: int = 32, hidden_size: int = 32, num_layers: int = 2,
               num_heads: int = 4, num_kv_heads: int = 2, seq_len: int = 16, seed: int = 0,
               intermediate_size: int | None = None, tie_word_embeddings: bool = False):
    """A small ``LlamaForCausalLM`` (grouped-query attention, RoPE, SwiGLU) built from a config."""
    tf = _transformers()
    config = tf.LlamaConfig(
        vocab_size=vocab_size, hidden_size=hidden_size, num_hidden_layers=num_layers,
        num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
        intermediate_size=intermediate_size or 2 * hidden_size,
        max_position_embeddings=seq_len, attention_dropout=0.0,
        tie_word_embeddings=tie_word_embeddings, use_cache=False,
    )
    return build_seeded(tf.LlamaForCausalLM, config, seed)


def tiny_gpt2(vocab_size: int = 32, hidden_size: int = 32, num_layers: int = 2,
              num_heads: int = 4, seq_len: int = 16, seed: int = 0):
    """A small ``GPT2LMHeadModel`` (tied embeddings, learned positions) built from a config."""
    tf = _transformers()
    config = tf.GPT2Config(
        vocab_size=vocab_size, n_embd=hidden_size, n_layer=num_layers, n_head=num_heads,
        n_positions=seq_len, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False,
    )
    return build_seeded(tf.GPT2LMHeadModel, config, seed)


def tiny_causal_lm(architecture: str, seed: int = 0, **config) -> nn.Module:
    """A small ``<architecture>ForCausalLM`` (e.g. "Qwen3", "Mistral", "Olmo2") from its config
    class, with ``config`` overriding transformers' defaults (sizes, sliding_window, ...)."""
    tf = _transformers()
    config_cls = getattr(tf, f"{architecture}Config", None)
    model_cls = getattr(tf, f"{architecture}ForCausalLM", None)
    if config_cls is None or model_cls is None:
        raise ConfigError(f"transformers has no {architecture}Config / {architecture}ForCausalLM")
    return build_seeded(model_cls, config_cls(**{"use_cache": False, **config}), seed)


# --- Data ---------------------------------------------------------------------------------------
class RandomTokenDataset(Dataset):
    """Random tokens as ``{"input_ids", "labels"}`` (labels = input_ids: HF models shift them)."""

    def __init__(self, num_samples: int = 64, seq_len: int = 16, vocab_size: int = 32,
                 seed: int = 0):
        gen = torch.Generator().manual_seed(seed)
        self.tokens = torch.randint(0, vocab_size, (num_samples, seq_len), generator=gen)

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        tokens = self.tokens[index]
        return {"input_ids": tokens, "labels": tokens.clone()}


def random_token_data(num_samples: int = 64, seq_len: int = 16, vocab_size: int = 32,
                      seed: int = 0) -> RandomTokenDataset:
    return RandomTokenDataset(num_samples, seq_len, vocab_size, seed)


# --- Which models, and how each layout takes them --------------------------------------------
def is_hf_model(model: nn.Module) -> bool:
    """A ``transformers.PreTrainedModel`` (checked without importing transformers: no such
    model exists before ``transformers.modeling_utils`` is imported, and importing it, as
    ``transformers.PreTrainedModel`` would, takes seconds)."""
    modeling = sys.modules.get("transformers.modeling_utils")
    return modeling is not None and isinstance(model, modeling.PreTrainedModel)


def hf_loss_items(model: nn.Module):
    """For ``ParallelOptions.loss_items``: a Hugging Face causal LM's loss is a global mean over
    the tokens with a target (``labels`` shifted by one, ``-100`` ignored; meshtrain.losses); it
    takes ``num_items_in_batch``. None for other models."""
    if not (is_hf_model(model) and type(model).__name__.endswith(("ForCausalLM", "LMHeadModel"))):
        return None
    return count_lm_targets


def hf_call_kwargs(model: nn.Module) -> dict:
    """For ``ParallelOptions.call_kwargs``: a Hugging Face model trains without its KV cache
    (``use_cache=False``, as transformers' own gradient checkpointing sets it): a block that
    activation checkpointing recomputes would append its keys and values to the cache a second
    time, and under cp its attention then got twice the keys. {} for other models, and for
    one whose forward takes no ``use_cache``."""
    import inspect

    takes = is_hf_model(model) and "use_cache" in inspect.signature(model.forward).parameters
    return {"use_cache": False} if takes else {}


def count_lm_targets(batch) -> torch.Tensor:
    """Next-token targets in a ``{"input_ids", "labels"}`` batch: ``labels[:, 1:]`` not -100."""
    labels = batch.get("labels") if isinstance(batch, dict) else None
    if labels is None:
        raise ConfigError("a Hugging Face causal LM trained without loss_fn needs batches with "
                          "'labels' (the model computes its loss from them); got "
                          f"{describe(batch)}")
    return (labels[:, 1:] != -100).sum()


def hf_pp_support(model: nn.Module) -> HFPipeline | None:
    """For ``PipelineOptions.adapter``: how to pipeline a Hugging Face model (None for other
    models, cut by ``model.layers``)."""
    return HFPipeline(model) if is_hf_model(model) else None
