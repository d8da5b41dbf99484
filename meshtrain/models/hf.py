"""Hugging Face ``transformers`` causal LMs under meshtrain (optional extra ``meshtrain[hf]``).

Models are built from a config only (nothing is downloaded). Batches are dicts
``{"input_ids", "labels"}`` passed as ``model(**batch)``; the model returns ``.loss`` itself, so
``fit`` needs no ``loss_fn``::

    trainer.fit(lambda: tiny_llama(), random_token_data(), optimizer=...)

Layouts: ``dp``, ``zero1/2/3`` (FSDP2 shards each decoder layer, found by ``find_blocks``) work for
any such model. ``tp`` has a built-in plan for Llama-style models (Llama, Mistral, Qwen2, ...:
``model.layers[i].self_attn.{q,k,v,o}_proj`` and ``mlp.{gate,up,down}_proj``), chosen
automatically when the Trainer gets no ``tp_plan`` (:func:`default_tp_plan`). GPT-2 has no tp
plan: its attention is one fused ``Conv1D`` (``c_attn``, weight stored transposed) whose output
is q, k and v side by side, so a column split would give each rank a mix of q/k/v columns, and
DTensor's ``ColwiseParallel`` / ``RowwiseParallel`` accept only ``nn.Linear`` / ``nn.Embedding``.
``cp`` (context parallel) works for Llama-style models: :class:`HFContextParallel` registers
meshtrain's all-gather-of-K/V attention with ``transformers`` and cuts each batch itself.
``pp`` too: :class:`~meshtrain.models.hf_pipeline.HFPipeline` cuts ``model.model.layers`` into
stages and computes the loss on the last stage (:func:`causal_lm_loss`, the model's own).
The loss is a mean over the targets of the whole global batch under every layout
(:func:`hf_loss_items`: meshtrain counts the targets and passes ``num_items_in_batch``).
"""

from __future__ import annotations

import sys

import torch
import torch.nn as nn
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel
from torch.utils.data import Dataset

from meshtrain.data.batch import describe
from meshtrain.errors import ConfigError
from meshtrain.models.hf_pipeline import HFPipeline, causal_lm_loss

__all__ = [
    "HFContextParallel", "RandomTokenDataset", "build_seeded", "causal_lm_loss",
    "count_lm_targets", "default_tp_plan", "hf_cp_support", "hf_loss_items", "hf_pp_support",
    "hf_tp_plan", "is_hf_model", "is_llama_like", "random_token_data", "tiny_gpt2", "tiny_llama",
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
    attention."""
    config._attn_implementation = "sdpa"  # works on CPU; no flash-attention needed
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


# --- Tensor parallel ----------------------------------------------------------------------------
def is_hf_model(model: nn.Module) -> bool:
    """A ``transformers.PreTrainedModel`` (checked without importing transformers)."""
    tf = sys.modules.get("transformers")
    if tf is None:
        return False
    return isinstance(model, tf.PreTrainedModel)


def _base(model: nn.Module) -> tuple[str, nn.Module] | None:
    """(prefix, base model) of a Llama-style model: ``model.model`` of ``*ForCausalLM`` (its
    ``layers`` an ``nn.ModuleDict`` on a pipeline stage)."""
    for prefix in ("model", ""):
        base = getattr(model, prefix, None) if prefix else model
        layers = getattr(base, "layers", None)
        if isinstance(layers, (nn.ModuleList, nn.ModuleDict)) and hasattr(base, "embed_tokens"):
            return prefix, base
    return None


def is_llama_like(model: nn.Module) -> bool:
    found = _base(model)
    if found is None or len(found[1].layers) == 0:
        return False
    layer = next(iter(found[1].layers._modules.values()))
    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    names = [(attn, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj")]
    names += [(mlp, n) for n in ("gate_proj", "up_proj", "down_proj")]
    return all(isinstance(getattr(m, n, None), nn.Linear) for m, n in names)


def _uses_conv1d(model: nn.Module) -> bool:
    return any(type(m).__name__ == "Conv1D" for m in model.modules())


def _check_divisible(model: nn.Module, config, tp: int) -> None:
    sizes = {
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": getattr(config, "num_key_value_heads", None)
        or config.num_attention_heads,
        "intermediate_size": config.intermediate_size,
        "vocab_size": config.vocab_size,
    }
    for what, size in sizes.items():
        if size % tp:
            options = ", ".join(str(d) for d in range(1, size + 1) if size % d == 0)
            raise ConfigError(
                f"tensor parallel tp={tp} splits {what}={size} of {type(model).__name__} over "
                f"{tp} ranks, but {size} is not divisible by {tp}; use a tp that divides it "
                f"({options}) or change the model's config"
            )


def hf_tp_plan(model: nn.Module, tp: int | None = None) -> dict[str, ParallelStyle]:
    """The Megatron plan for a Llama-style Hugging Face causal LM: module FQN -> ParallelStyle.

    Embedding split by vocabulary rows (replicated output); q/k/v and gate/up column-parallel,
    o_proj and down_proj row-parallel (heads and MLP units split, one all-reduce each forward);
    ``lm_head`` column-parallel with replicated (gathered) logits, so the model's own loss runs
    unchanged; norms replicated as DTensors so that every parameter is a DTensor. Llama's
    attention reshapes with ``view(*shape, -1, head_dim)``, so each rank runs its local heads
    (and ``num_key_value_groups`` = heads / kv_heads is the same locally). With ``tp`` given the
    head, kv-head, MLP and vocabulary sizes are checked to divide by it.
    """
    from meshtrain.parallel.tensor_parallel import ReplicateParallel

    if _uses_conv1d(model):
        raise ConfigError(
            f"{type(model).__name__} (GPT-2 style) has no tensor-parallel plan: its attention is "
            "one fused Conv1D (c_attn) producing q, k and v side by side, which a column split "
            "would mix across ranks, and DTensor's Colwise/RowwiseParallel only handle nn.Linear. "
            "Train it with dp / zero1-3 (or use a Llama-style model for tp)"
        )
    if not is_llama_like(model):
        raise ConfigError(
            f"{type(model).__name__} has no built-in tensor-parallel plan (expected a Llama-style "
            "model: layers[i].self_attn.{q,k,v,o}_proj and mlp.{gate,up,down}_proj as "
            "nn.Linear); pass Trainer(tp_plan={fqn: ParallelStyle}) instead"
        )
    prefix, base = _base(model)
    join = (lambda name: f"{prefix}.{name}") if prefix else (lambda name: name)
    head = getattr(model, "lm_head", None)  # (tied to embed_tokens: both split by vocab rows)
    if tp is not None:
        _check_divisible(model, model.config, tp)
    plan: dict[str, ParallelStyle] = {}
    if base.embed_tokens is not None:  # (None on a pipeline stage after the first)
        plan[join("embed_tokens")] = RowwiseParallel(input_layouts=Replicate(),
                                                     output_layouts=Replicate())
    for i in base.layers._modules:
        layer = join(f"layers.{i}")
        for name in ("q_proj", "k_proj", "v_proj"):
            plan[f"{layer}.self_attn.{name}"] = ColwiseParallel()
        plan[f"{layer}.self_attn.o_proj"] = RowwiseParallel()
        plan[f"{layer}.mlp.gate_proj"] = ColwiseParallel()
        plan[f"{layer}.mlp.up_proj"] = ColwiseParallel()
        plan[f"{layer}.mlp.down_proj"] = RowwiseParallel()
    if head is not None:
        plan["lm_head"] = ColwiseParallel(output_layouts=Replicate())
    for name, module in model.named_modules():  # norms (and anything else left whole)
        leaf = next(module.children(), None) is None
        if leaf and name not in plan and next(module.parameters(recurse=False), None) is not None:
            plan[name] = ReplicateParallel()
    return plan


def default_tp_plan(model: nn.Module, tp: int | None = None, *, sequence_parallel: bool = False,
                    loss_parallel: bool = False) -> dict[str, ParallelStyle] | None:
    """The built-in plan for a Hugging Face model, or ``None`` for other models (meshtrain's
    own GPT plan then applies). Sequence and loss parallel are not available for HF models."""
    if not is_hf_model(model):
        return None
    if sequence_parallel or loss_parallel:
        raise ConfigError(
            "sequence_parallel and loss_parallel are not available for Hugging Face models "
            "(the model computes its loss itself from replicated logits); turn them off"
        )
    return hf_tp_plan(model, tp)


def hf_tp_plans(tp_degree: int, sequence_parallel: bool, loss_parallel: bool):
    """For models that supply no ``tp_plan`` of their own: a function module -> meshtrain's
    plan for a Hugging Face model (None for other models); None without ``tp``."""
    def plan_for(module):
        return default_tp_plan(module, tp_degree, sequence_parallel=sequence_parallel,
                               loss_parallel=loss_parallel)
    return plan_for if tp_degree > 1 else None


# --- Context parallel ---------------------------------------------------------------------------
_CP_ATTENTION = "meshtrain_context_parallel"


def _cp_attention(module, query, key, value, attention_mask, dropout: float = 0.0,
                  scaling: float | None = None, **kwargs):
    """A ``transformers`` attention function: this rank's queries over every cp rank's keys and
    values (meshtrain.parallel.context_parallel.cp_attention); GQA heads repeated after the
    gather. No padding mask: :meth:`HFContextParallel.shard_context_parallel_batch` refuses one."""
    from meshtrain.parallel.context_parallel import cp_attention

    out = cp_attention(query, key, value, module.meshtrain_cp_mesh, dropout_p=dropout,
                       scale=scaling, kv_groups=getattr(module, "num_key_value_groups", 1))
    return out.transpose(1, 2).contiguous(), None


class HFContextParallel:
    """Context parallel for a Llama-style Hugging Face causal LM, without changing its code.

    Its attention modules call :func:`_cp_attention` (registered under ``transformers``'
    ``AttentionInterface``); each batch ``{"input_ids", "labels"}`` is cut by the zig-zag order,
    with ``position_ids`` for RoPE and the labels shifted *before* the cut (``shift_labels``: a
    token's target may sit on another rank). The Engine passes ``num_items_in_batch`` (the
    step's targets over the loss ranks), so the mean of the cp ranks' losses is the loss over
    the whole sequence.
    """

    def __init__(self, model: nn.Module):
        self.model = model

    def check_context_parallel(self, cp_degree: int) -> None:
        if not is_llama_like(self.model):
            raise ConfigError(
                f"{type(self.model).__name__} has no context-parallel support (meshtrain "
                "supports Llama-style Hugging Face models: layers[i].self_attn with "
                "q/k/v/o_proj); drop cp from the layout")

    def enable_context_parallel(self, cp_mesh) -> None:
        tf = _transformers()
        tf.AttentionInterface.register(_CP_ATTENTION, _cp_attention)
        self.model.config._attn_implementation = _CP_ATTENTION if cp_mesh is not None else "sdpa"
        for module in self.model.modules():
            if hasattr(module, "num_key_value_groups"):
                module.meshtrain_cp_mesh = cp_mesh

    def shard_context_parallel_batch(self, batch: dict, cp_mesh) -> dict:
        from meshtrain.parallel.context_parallel import shard_sequence

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
        positions = torch.arange(ids.size(1), device=ids.device).expand_as(ids)
        out["position_ids"] = shard_sequence(positions, rank, degree)
        labels = batch.get("labels")
        if labels is not None:
            shifted = nn.functional.pad(labels[:, 1:], (0, 1), value=-100)
            # the loss is this rank's sum over its tokens divided by num_items_in_batch, which
            # the Engine sets from the whole step's count (meshtrain.losses, hf_loss_items)
            out["labels"] = out["shift_labels"] = shard_sequence(shifted, rank, degree)
        return out


def hf_cp_support(model: nn.Module) -> HFContextParallel | None:
    """For :func:`meshtrain.parallel.context_parallel.cp_support`: the adapter of a Hugging Face
    model (None for other models, which bring their own methods)."""
    return HFContextParallel(model) if is_hf_model(model) else None


def hf_loss_items(model: nn.Module):
    """For ``ParallelOptions.loss_items``: a Hugging Face causal LM's loss is a global mean over
    the tokens with a target (``labels`` shifted by one, ``-100`` ignored; meshtrain.losses); it
    takes ``num_items_in_batch``. None for other models."""
    if not (is_hf_model(model) and type(model).__name__.endswith(("ForCausalLM", "LMHeadModel"))):
        return None
    return count_lm_targets


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
