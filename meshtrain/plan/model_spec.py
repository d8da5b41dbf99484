"""The model a plan is for: built on the meta device with any number of blocks, with the facts
the planner checks layouts against (heads, blocks, sequence length).

    ModelSpec.load("examples/llama3/70b.json")          # a Hugging Face config.json
    ModelSpec.load("gpt:num_layers=4,num_heads=4,d_model=128,vocab_size=256,seq_len=128")
    ModelSpec.load("llama:num_hidden_layers=16,hidden_size=2048,...")   # any LlamaConfig field
    ModelSpec.load("examples/llama_1b_zero3.toml")      # a meshtrain job (causal_lm, char_lm)
"""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path

import torch
import torch.nn.functional as F

from meshtrain.errors import ConfigError


@dataclasses.dataclass(frozen=True, eq=False)  # hashed by identity: probes are cached per spec
class ModelSpec:
    name: str
    config: object  # a GPTConfig or a transformers PretrainedConfig
    num_layers: int
    num_heads: int
    num_kv_heads: int
    hidden: int
    vocab_size: int
    max_seq_len: int

    own = False  # a user's own model (plan/own_model.py), probed whole with its own batch

    @property
    def is_hf(self) -> bool:
        return not type(self.config).__name__ == "GPTConfig"

    def refuses(self, axis: str) -> str | None:
        """Why ``axis`` is not planned for this model (an own model's; an LM's: none)."""
        return None

    def batch(self, size: int, seq_len: int, device="cpu") -> torch.Tensor:
        """What :meth:`loss` takes for ``size`` sequences (token ids; values do not matter)."""
        return torch.zeros(size, seq_len, dtype=torch.long, device=device)

    @property
    def num_experts(self) -> int:
        """Experts per MoE layer (0: a dense model)."""
        c = self.config
        return int(next((getattr(c, k) for k in ("num_experts", "num_local_experts",
                                                  "n_routed_experts")
                         if getattr(c, k, None)), 0) or 0)

    @property
    def experts_per_token(self) -> int:
        """Experts each token is routed to (0: a dense model)."""
        c = self.config
        return int(next((getattr(c, k) for k in ("experts_per_token", "num_experts_per_tok")
                         if getattr(c, k, None)), 0) or 0) if self.num_experts else 0

    @property
    def balances_routers(self) -> bool:
        """Does meshtrain add a Hugging Face model's router loss (refused under pp; meshtrain's
        own MoE layers balance themselves inside pipeline stages)?"""
        return self.num_experts > 0 and self.is_hf and bool(
            getattr(self.config, "output_router_logits", False))

    def block_bytes(self, experts_only: bool = False) -> int:
        """One block's parameter bytes (``experts_only``: its experts' part, what ep splits):
        what a second block adds to the model (built on meta, so whatever the model names its
        modules)."""
        sizes = []
        for layers in (1, 2):
            with torch.device("meta"):
                model = self.build(layers)
            if experts_only:
                from meshtrain.models.hf import hf_expert_layers
                from meshtrain.parallel.expert.apply import expert_layers

                params = [p for layer in expert_layers(model, hf_expert_layers)
                          for p in layer.expert_module.parameters(recurse=False)]
            else:
                params = list(model.parameters())
            sizes.append(sum(p.numel() * p.element_size() for p in params))
        return sizes[1] - sizes[0]

    # -- building ---------------------------------------------------------------------------------
    def build(self, num_layers: int | None = None) -> torch.nn.Module:
        """The model (call under ``torch.device("meta")``), with ``num_layers`` blocks if given."""
        config = copy.deepcopy(self.config)
        if self.is_hf:
            import transformers

            if num_layers is not None:
                config.num_hidden_layers = num_layers
                if num_layers < self.num_layers and getattr(config, "first_k_dense_replace", 0):
                    # a probe's few blocks are the model's typical one: DeepSeek's first 3 of
                    # 61 are dense, priced as MoE ones (the same active width, 18432 = 9 x 2048)
                    config.first_k_dense_replace = 0
            config._attn_implementation = "sdpa"
            # fp32 as the Trainer builds it (a config's torch_dtype names its checkpoint's
            # files; under bf16-mixed the master weights, gradients and AdamW stay fp32)
            return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        from meshtrain.models.gpt import GPT

        if num_layers is not None:
            config.num_layers = num_layers
        return GPT(config)

    def factory(self):
        return lambda: self.build()

    def blocks(self, model: torch.nn.Module) -> list[torch.nn.Module]:
        if self.is_hf:
            from meshtrain.models.hf.pipeline import HFPipeline

            return list(HFPipeline(model).blocks(model))
        return list(model.layers)

    def loss(self, model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
        """The training loss of ``tokens`` (next-token cross-entropy)."""
        if self.is_hf:
            return model(input_ids=tokens, labels=tokens).loss
        logits = model(tokens)
        return F.cross_entropy(logits.flatten(0, 1).float(), tokens.flatten())

    # -- reading ----------------------------------------------------------------------------------
    @classmethod
    def from_config(cls, config, name: str = "") -> ModelSpec:
        if type(config).__name__ == "GPTConfig":
            return cls(name or "gpt", config, config.num_layers, config.num_heads,
                       config.num_heads, config.d_model, config.vocab_size, config.seq_len)
        heads = config.num_attention_heads
        return cls(name or getattr(config, "model_type", "hf"), config, config.num_hidden_layers,
                   heads, getattr(config, "num_key_value_heads", None) or heads,
                   config.hidden_size, config.vocab_size,
                   getattr(config, "max_position_embeddings", 1 << 20))

    @classmethod
    def load(cls, source: str) -> ModelSpec:
        """From a config.json, a meshtrain TOML job, or ``family:key=value,...``."""
        path = Path(source)
        if path.suffix == ".json":
            if not path.exists():
                raise ConfigError(f"model {source}: no such file; give a Hugging Face "
                                  "config.json (e.g. examples/llama3/8b.json)")
            import transformers

            data = json.loads(path.read_text())
            model_type = data.pop("model_type", None)
            if model_type is None:
                raise ConfigError(f"{source} has no model_type: is it a Hugging Face config.json?")
            return cls.from_config(transformers.AutoConfig.for_model(model_type, **data),
                                   path.stem)
        if path.suffix == ".toml":
            return cls._from_job(path)
        family, sep, pairs = source.partition(":")
        if not sep:
            raise ConfigError(f"model {source!r}: give a config.json, a meshtrain .toml job, or "
                              "family:key=value,... (e.g. gpt:num_layers=4,num_heads=4,"
                              "d_model=128,vocab_size=256,seq_len=128)")
        values = {}
        for pair in filter(None, (p.strip() for p in pairs.split(","))):
            key, eq, value = pair.partition("=")
            if not eq or not value.strip():
                raise ConfigError(f"model {source!r}: {pair!r} is not key=value")
            try:  # numbers, true/false, lists; anything else is a string (hidden_act=silu)
                values[key.strip()] = json.loads(value)
            except json.JSONDecodeError:
                values[key.strip()] = value.strip()
        if family == "gpt":
            from meshtrain.models.gpt import GPTConfig

            try:
                return cls.from_config(GPTConfig(**values), "gpt")
            except TypeError as exc:
                raise ConfigError(f"model {source!r}: {exc}; GPTConfig takes vocab_size, "
                                  "seq_len, num_layers, num_heads, d_model, mlp_ratio") from None
        import transformers

        try:
            return cls.from_config(transformers.AutoConfig.for_model(family, **values), family)
        except ValueError as exc:
            raise ConfigError(f"model {source!r}: {exc}") from None

    @classmethod
    def _from_job(cls, path: Path) -> ModelSpec:
        from meshtrain.recipes import resolve_config

        _, config, _ = resolve_config(str(path), [])  # (the recipe's defaults filled in)
        recipe = config["job"].get("recipe")
        if recipe == "causal_lm":
            from meshtrain.models.from_config import model_config

            m = config["model"]
            vocab = m.get("vocab_size") or 32000  # the tokenizer's, rounded: not known here
            return cls.from_config(model_config(config, vocab), path.stem)
        if recipe == "char_lm":  # (its vocabulary: the characters of the text, under 256)
            from meshtrain.recipes.char_lm import model_config

            return cls.from_config(model_config(config, 256), path.stem)
        raise ConfigError(f"{path}: meshtrain plan reads the causal_lm and char_lm recipes' models; "
                          "for another model give its config.json or family:key=value,...")
