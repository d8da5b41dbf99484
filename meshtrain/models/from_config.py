"""A causal LM recipe's ``[model]`` section as a model: its config (meshtrain's GPT or a
``transformers`` architecture, checked against the tokenizer's vocabulary and ``seq_len`` before
any process starts) and the factory that builds it (sharded from the start under zero3)."""

from __future__ import annotations

import math
from pathlib import Path

from meshtrain.errors import ConfigError

ARCHITECTURES = {"llama": ("LlamaConfig", "LlamaForCausalLM"),
                 "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
                 "mistral": ("MistralConfig", "MistralForCausalLM"), "gpt": None}


def _transformers():
    """``transformers`` (models/hf's import), or what to install, or meshtrain's own GPT."""
    from meshtrain.models.hf import _transformers as load

    try:
        return load()
    except ConfigError as exc:
        raise ConfigError(f"{exc}; or set model.architecture = \"gpt\"") from None


#: [model] keys of meshtrain's MoE GPT (GPTConfig's fields of the same names)
MOE_FIELDS = ("num_experts", "experts_per_token", "expert_hidden_dim", "shared_expert",
              "router_score", "router_aux_loss_coef", "router_bias_rate")


def moe_metric_names(model_factory) -> list[str]:
    """The routing metrics a run of the model ``model_factory`` builds logs (its routers'
    balancing loss and expert load, meshtrain.moe.balance), for a recipe's
    ``metrics(config)``: the model built on the meta device (no weights) and asked as the
    Engine asks it; [] for a dense model."""
    import torch

    from meshtrain.models.hf import hf_router_loss
    from meshtrain.moe.balance import router_loss_of, routing_metric_names

    with torch.device("meta"):
        model = model_factory()
    return routing_metric_names(router_loss_of(model, hf_router_loss))


def model_config(config: dict, tokenizer_vocab: int):
    """The model's config: a ``transformers`` config, or a GPTConfig for ``gpt``; checked
    against the tokenizer's vocabulary and ``seq_len`` before any process starts."""
    from meshtrain.data.tokens import check_model_vocab

    m, seq_len = config["model"], config["data"]["seq_len"]
    if m["architecture"] not in ARCHITECTURES:
        raise ConfigError(f"model.architecture {m['architecture']!r} is not one of "
                          f"{', '.join(ARCHITECTURES)}; or give model.hf_config (a config.json)")
    vocab = m["vocab_size"] or -(-tokenizer_vocab // m["vocab_multiple"]) * m["vocab_multiple"]
    moe = {k: m[k] for k in MOE_FIELDS if k in m}
    if m["architecture"] == "gpt":
        from meshtrain.models.gpt import GPTConfig

        cfg = GPTConfig(vocab_size=vocab, seq_len=seq_len, num_layers=m["num_layers"],
                        num_heads=m["num_heads"], d_model=m["hidden_size"], **moe)
        check_model_vocab({"vocab_size": tokenizer_vocab}, cfg.vocab_size, key="model.vocab_size")
        return cfg
    if moe.get("num_experts"):
        raise ConfigError(f"model.num_experts={moe['num_experts']} makes meshtrain's own GPT a "
                          f"mixture of experts, not a {m['architecture']} model; set "
                          "model.architecture = \"gpt\", or give a Hugging Face MoE model's "
                          "config.json as model.hf_config (e.g. a Qwen3-MoE's)")
    tf = _transformers()
    source = m["hf_config"] or m["pretrained"]
    if source:
        if not Path(source).exists():
            raise ConfigError(f"model.{'hf_config' if m['hf_config'] else 'pretrained'} "
                              f"{source} does not exist; give a local config.json or model folder")
        cfg = tf.AutoConfig.from_pretrained(source)
        key = "the vocab_size of " + str(source)
    else:
        config_class = getattr(tf, ARCHITECTURES[m["architecture"]][0])
        hidden = m["hidden_size"]
        inner = m["intermediate_size"] or 64 * math.ceil(8 * hidden / 3 / 64)
        cfg = config_class(vocab_size=vocab, hidden_size=hidden, intermediate_size=inner,
                           num_hidden_layers=m["num_layers"], num_attention_heads=m["num_heads"],
                           num_key_value_heads=m["num_kv_heads"],
                           max_position_embeddings=m["max_position_embeddings"],
                           tie_word_embeddings=m["tie_word_embeddings"])
        key = "model.vocab_size"
    check_model_vocab({"vocab_size": tokenizer_vocab}, cfg.vocab_size, key=key)
    check_token_ids(cfg, str(source) if source else "the model's config (the [model] section)")
    if seq_len > cfg.max_position_embeddings:
        raise ConfigError(f"data.seq_len={seq_len} is above the model's maximum "
                          f"max_position_embeddings={cfg.max_position_embeddings}; use a "
                          "shorter seq_len (or a larger model.max_position_embeddings)")
    return cfg


TOKEN_ID_FIELDS = ("pad_token_id", "bos_token_id", "eos_token_id")


def check_token_ids(cfg, where: str) -> None:
    """ConfigError when the config's pad, bos or eos token id (an id or a list of ids) is not
    an id of its vocabulary: transformers fails on it inside the model (an embedding's
    padding_idx, generation), after the processes started."""
    vocab = cfg.vocab_size
    for field in TOKEN_ID_FIELDS:
        value = getattr(cfg, field, None)
        ids = value if isinstance(value, (list, tuple)) else [value]
        if any(i is not None and not (isinstance(i, int) and 0 <= i < vocab) for i in ids):
            raise ConfigError(
                f"{field}={value!r} in {where} is not a token id of the model's vocabulary "
                f"(vocab_size={vocab}: ids 0 to {vocab - 1}); set {field} to the tokenizer's id "
                f"of that token (below {vocab}), or null, or give the model a vocab_size above it")


def model_factory(config: dict, cfg, seed: int):
    if config["model"]["architecture"] == "gpt":
        from meshtrain.models.gpt import GPT

        return lambda: GPT(cfg, seed=seed)
    from meshtrain.models.hf.init import HFCausalLM

    model_class = getattr(_transformers(), type(cfg).__name__.replace("Config", "ForCausalLM"))
    return HFCausalLM(model_class, cfg, seed)  # sharded from the start under zero3 / dp_shard
