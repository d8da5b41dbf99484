"""A small GPT (decoder-only transformer) kept in separate, splittable pieces.

``forward(idx)`` is literally ``embed -> each block -> norm -> head``, so pipeline stages can
take a contiguous run of these pieces. Attention uses separate ``wq``/``wk``/``wv``/``wo``
projections and reads its head count from the local weight shape, so tensor parallelism can
shard heads by slicing those Linear layers. The head is not tied to the token embedding.

Initialisation (deterministic for a given ``seed``, and the same on every device): every
Linear and Embedding weight ~ N(0, 0.02), biases zero, LayerNorm weight 1 / bias 0; the
projections that write into the residual stream (``attn.wo`` and ``mlp.fc_out``) use
std ``0.02 / sqrt(2 * num_layers)`` as in GPT-2. Each weight is drawn from a generator seeded
by (seed, its name), so a pipeline stage holding some of the modules (under their full-model
names) initialises them alone to the whole model's values.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from meshtrain.errors import ConfigError
from meshtrain.models.gpt_attention import CausalSelfAttention

INIT_STD = 0.02


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass
class GPTConfig:
    """Sizes of a GPT. ``mlp_ratio`` times ``d_model`` is the MLP hidden width.

    ``num_experts`` > 0 makes every block's MLP a mixture of experts (meshtrain.moe.layer):
    ``experts_per_token`` of them per token, each ``expert_hidden_dim`` wide (default: the MLP's
    width over ``experts_per_token``, so a token computes about as much as in the dense
    model), plus one dense ``shared_expert`` if set; ``router_score`` "softmax" or
    "sigmoid"; balanced by the load-balancing loss (``router_aux_loss_coef`` x, 0 = off)
    and/or by a per-expert bias moved ``router_bias_rate`` a step (0 = off).

    ``document_eos``: the end-of-text id that ends each document of packed windows (the
    ``eos_id`` of ``meshtrain prepare``'s shards). Set, a token attends only to its own document
    and its position counts from the document's first token (meshtrain.packing.eos_documents);
    train with targets cut at each eos (``PackedTokens(..., document_mask=True)``)."""

    vocab_size: int
    seq_len: int
    num_layers: int
    num_heads: int
    d_model: int
    mlp_ratio: int = 4
    dropout: float = 0.0
    bias: bool = True
    num_experts: int = 0
    experts_per_token: int = 2
    expert_hidden_dim: int | None = None
    shared_expert: bool = False
    router_score: str = "softmax"
    router_aux_loss_coef: float = 0.01
    router_bias_rate: float = 0.0
    document_eos: int | None = None

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def __post_init__(self) -> None:
        for name in ("vocab_size", "seq_len", "num_layers", "num_heads", "d_model", "mlp_ratio"):
            value = getattr(self, name)
            if not _is_int(value) or value <= 0:
                raise ConfigError(f"GPTConfig.{name} must be a positive integer, got {value!r}.")
        if self.d_model % self.num_heads != 0:
            suggestion = max(self.num_heads, self.d_model // self.num_heads * self.num_heads)
            raise ConfigError(
                f"GPTConfig.d_model={self.d_model} is not divisible by num_heads="
                f"{self.num_heads}; pick d_model as a multiple of num_heads "
                f"(e.g. d_model={suggestion})."
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"GPTConfig.dropout must be in [0, 1), got {self.dropout!r}.")
        if self.is_moe and not 1 <= self.experts_per_token <= self.num_experts:
            raise ConfigError(
                f"GPTConfig.experts_per_token={self.experts_per_token} must be between 1 and "
                f"num_experts={self.num_experts}: a token cannot be routed to more experts than "
                "there are")
        if self.document_eos is not None and not (
                _is_int(self.document_eos) and 0 <= self.document_eos < self.vocab_size):
            raise ConfigError(f"GPTConfig.document_eos={self.document_eos!r} is not a token id of "
                              f"the {self.vocab_size}-token vocabulary; give the shards' eos_id "
                              "(meta.json), or None for one causal window")
        if self.router_aux_loss_coef < 0 or self.router_bias_rate < 0:
            raise ConfigError("GPTConfig.router_aux_loss_coef and router_bias_rate must be >= 0 "
                              f"(0 = off), got {self.router_aux_loss_coef!r} and "
                              f"{self.router_bias_rate!r}")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.num_heads

    @property
    def mlp_hidden_dim(self) -> int:
        return self.mlp_ratio * self.d_model


class MLP(nn.Module):
    """Position-wise feed-forward: ``fc_in`` -> GELU -> ``fc_out``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.fc_in = nn.Linear(config.d_model, config.mlp_hidden_dim, bias=config.bias)
        self.act = nn.GELU()
        self.fc_out = nn.Linear(config.mlp_hidden_dim, config.d_model, bias=config.bias)
        self.drop = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.fc_out(self.act(self.fc_in(x))))


def moe_mlp(config: GPTConfig) -> nn.Module:
    """The MLP of an MoE block (meshtrain.moe.layer.MoE)."""
    from meshtrain.moe.layer import MoE

    hidden = config.expert_hidden_dim or max(1, config.mlp_hidden_dim // config.experts_per_token)
    return MoE(config.d_model, hidden, config.num_experts, config.experts_per_token,
               config.router_score, MLP(config) if config.shared_expert else None)


class Block(nn.Module):
    """Pre-norm transformer block: ``x + attn(norm1(x))`` then ``x + mlp(norm2(x))``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(config.d_model, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.norm2 = nn.LayerNorm(config.d_model, bias=config.bias)
        self.mlp = MLP(config) if not config.is_moe else moe_mlp(config)

    def forward(self, x: torch.Tensor, documents: torch.Tensor | None = None) -> torch.Tensor:
        # (a keyword, and only when given: tensor parallel's input hooks count positional ones)
        h = self.norm1(x)
        x = x + (self.attn(h) if documents is None else self.attn(h, documents=documents))
        return x + self.mlp(self.norm2(x))


class GPT(nn.Module):
    """Decoder-only language model: ``(batch, seq)`` token ids -> ``(batch, seq, vocab)`` logits."""

    #: init_weights() gives sharded parameters the unsharded model's values, so a sharded
    #: layout may build this model on the meta device (see meshtrain.parallel.data.fully_shard);
    #: each from its own name, so a pipeline stage (some of the modules) may too
    supports_sharded_init = True
    supports_staged_init = True

    def __init__(self, config: GPTConfig, *, seed: int = 0) -> None:
        super().__init__()
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.d_model)
        self.pos_emb = nn.Embedding(config.seq_len, config.d_model)
        self.drop = nn.Dropout(config.dropout)
        self.layers = nn.ModuleList(Block(config) for _ in range(config.num_layers))
        self.norm = nn.LayerNorm(config.d_model, bias=config.bias)
        self.head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        self._cp_window = None  # (cp) the window's documents, found before the cut
        self.init_weights(seed)

    @torch.no_grad()
    def init_weights(self, seed: int | None = None) -> None:
        """Re-initialise every parameter with the scheme in the module docstring.

        Values are drawn on the CPU from a generator seeded with ``seed`` and copied in, so
        they do not depend on the global RNG or on the device the model lives on. ``seed=None``
        reuses the last seed (the constructor's), so a model built on the meta device and then
        materialised gets the values of ``GPT(config, seed=seed)``.

        Sharded (DTensor) parameters, e.g. under FSDP2: each rank draws the full tensor and keeps
        only its own part, so the sharded model equals the unsharded one. On the meta device
        (no storage yet) there is nothing to fill and this returns at once.
        """
        from meshtrain.models.hf.init import module_seed  # (wrapper parts of names ignored)
        from meshtrain.parallel.data.meta_init import copy_full_into

        seed = getattr(self, "_init_seed", 0) if seed is None else seed
        self._init_seed = seed
        if all(p.is_meta for p in self.parameters()):
            return
        for name, buffer in self.named_buffers():
            if name.endswith("router.expert_bias"):  # (bias balancing starts from none)
                buffer.zero_()
        residual_std = INIT_STD / math.sqrt(2 * self.config.num_layers)
        for name, param in self.named_parameters():
            module_name, _, kind = name.rpartition(".")
            module = self.get_submodule(module_name)
            if isinstance(module, nn.LayerNorm):
                param.fill_(1.0 if kind == "weight" else 0.0)
            elif kind == "bias":
                param.zero_()
            else:
                is_residual = name.endswith(("attn.wo.weight", "fc_out.weight",
                                             "experts.w_out"))
                std = residual_std if is_residual else INIT_STD
                shape = param.shape
                rows = getattr(module, "rows", None)  # under ep: experts' rows of the whole
                if rows is not None:
                    shape = (self.config.num_experts, *shape[1:])
                generator = torch.Generator().manual_seed(module_seed(seed, name))
                values = torch.randn(shape, generator=generator, dtype=torch.float32)
                copy_full_into(param, values * std, rows)  # a shard keeps its part

    def flops_per_token(self, seq_len: int | None = None) -> float:
        """Model FLOPs per token, forward and backward: 6 per matmul parameter (embeddings are
        lookups) plus attention's scores and weighted sum, 12·L·d·T (PaLM's MFU count)."""
        from meshtrain.observe.flops import active_flop_params

        c = self.config
        # a token runs k of the E experts: only they count (active parameters; under ep k
        # experts' rows, whatever rows a rank holds)
        params = active_flop_params(self)
        return 6.0 * params + 12.0 * c.num_layers * c.d_model * (seq_len or c.seq_len)

    # -- mixture of experts: the routers' balancing, carried by meshtrain (meshtrain.moe) -------
    def router_loss(self):
        """The MoE layers' routing as meshtrain carries it (None for a dense GPT)."""
        from meshtrain.moe.layer import MoERouting

        if not self.config.is_moe:
            return None
        return MoERouting([b.mlp for b in self._blocks()], self.config.router_aux_loss_coef,
                          self.config.router_bias_rate, field="GPTConfig.num_experts")

    # -- tensor parallel: the model supplies its own plan (meshtrain/models/gpt_plan.py) --------
    def tp_plan(self, tp_degree: int, *, sequence_parallel: bool = False,
                loss_parallel: bool = False) -> dict:
        """Megatron column/row splits of attention and MLP, vocabulary-split embedding/head."""
        from meshtrain.models.gpt_plan import gpt_tp_plan

        return gpt_tp_plan(self, sequence_parallel=sequence_parallel, loss_parallel=loss_parallel)

    def check_tp(self, tp_degree: int, *, sequence_parallel: bool = False,
                 seq_len: int | None = None) -> None:
        """``ConfigError`` unless heads, widths and vocabulary (and seq_len with SP) divide."""
        from meshtrain.models.gpt_plan import check_gpt_tp

        check_gpt_tp(self, tp_degree, sequence_parallel=sequence_parallel, seq_len=seq_len)

    # -- context parallel: attention over the cp group, positions of this rank's tokens ---------
    def enable_context_parallel(self, cp_mesh) -> None:
        """Each rank holds its share of the sequence (parallel/context/context_parallel.py)."""
        self.cp_mesh = cp_mesh
        for layer in self._blocks():
            layer.attn.cp_mesh = cp_mesh

    def _blocks(self):  # (a pipeline stage keeps its blocks by full-model name in a ModuleDict)
        return self.layers.values() if isinstance(self.layers, nn.ModuleDict) else self.layers

    def check_context_parallel(self, cp_degree: int) -> None:
        from meshtrain.parallel.context.context_parallel import check_cp

        check_cp(self.config.seq_len, cp_degree)

    def shard_context_parallel_batch(self, batch, cp_mesh):
        """This rank's part of ``batch`` (every tensor cut along the sequence), the window's
        documents found first (``document_eos``)."""
        from meshtrain.parallel.context.context_parallel import shard_batch

        self._cp_window = self.documents(batch[0] if isinstance(batch, (tuple, list)) else batch,
                                         whole=True)
        return shard_batch(batch, cp_mesh)

    # -- packed documents (document_eos): ids of the whole window, read by every block --------
    def documents(self, idx: torch.Tensor, whole: bool = False) -> torch.Tensor | None:
        """The document ids of the window (None without ``document_eos``); under cp, unless
        ``idx`` is ``whole``, those found before the cut."""
        if self.config.document_eos is None:
            return None
        if getattr(self, "cp_mesh", None) is not None and not whole:
            return self._cp_window
        from meshtrain.packing import eos_documents

        return eos_documents(idx, self.config.document_eos)

    def pipeline_side_inputs(self, batch) -> dict | None:
        """What every pipeline stage's blocks read: the window's document ids, or None."""
        documents = self.documents(batch[0] if isinstance(batch, (tuple, list)) else batch)
        return None if documents is None else {"documents": documents}

    def num_params(self) -> int:
        """Number of parameter elements (embeddings included)."""
        return sum(p.numel() for p in self.parameters())

    def embed(self, idx: torch.Tensor, documents: torch.Tensor | None = None) -> torch.Tensor:
        """Token plus position embedding of ``(batch, seq)`` ids -> ``(batch, seq, d_model)``;
        with ``documents`` (the window's document ids) positions count from each document's
        first token."""
        if idx.dim() != 2:
            raise ConfigError(f"GPT expects token ids of shape (batch, seq), got shape "
                              f"{tuple(idx.shape)}; add a batch dimension with idx.unsqueeze(0).")
        seq = idx.shape[1]
        if seq > self.config.seq_len:
            raise ConfigError(f"input has {seq} tokens but the model's seq_len is "
                              f"{self.config.seq_len}; crop it to the last {self.config.seq_len}"
                              " tokens or build the model with a larger seq_len.")
        cp_mesh = getattr(self, "cp_mesh", None)
        if cp_mesh is not None:  # idx is this rank's share of the sequence
            from meshtrain.parallel.context.context_parallel import local_positions

            positions = local_positions(seq, cp_mesh.get_local_rank(), cp_mesh.size(),
                                        device=idx.device)
        else:
            positions = torch.arange(seq, device=idx.device)
        if documents is not None:
            from meshtrain.packing import document_positions

            positions = document_positions(documents)[:, positions]
        return self.drop(self.tok_emb(idx) + self.pos_emb(positions))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        documents = self.documents(idx)
        extra = {} if documents is None else {"documents": documents}
        h = self.embed(idx, **extra)
        for layer in self.layers:
            h = layer(h, **extra)
        return self.head(self.norm(h))

    @torch.no_grad()
    def generate(
        self,
        idx: torch.Tensor,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k: int | None = None,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """Append ``max_new_tokens`` sampled tokens to ``(batch, seq)`` ids and return them all.

        The model sees at most the last ``seq_len`` tokens. ``temperature=0`` picks the most
        likely token; ``top_k`` samples among the k most likely. Runs in eval mode (no dropout)
        and restores the previous mode afterwards.
        """
        if not _is_int(max_new_tokens) or max_new_tokens < 0:
            raise ConfigError(f"max_new_tokens must be an integer >= 0, got {max_new_tokens!r}.")
        if temperature < 0:
            raise ConfigError(f"temperature must be >= 0 (0 = greedy), got {temperature!r}.")
        if top_k is not None and (not _is_int(top_k) or top_k <= 0):
            raise ConfigError(f"top_k must be a positive integer or None, got {top_k!r}.")
        was_training, cp_mesh = self.training, getattr(self, "cp_mesh", None)
        self.eval()
        if cp_mesh is not None:  # one rank generates from the whole sequence
            self.enable_context_parallel(None)
        try:
            for _ in range(max_new_tokens):
                logits = self(idx[:, -self.config.seq_len :])[:, -1, :].float()
                if temperature == 0:
                    next_id = logits.argmax(dim=-1, keepdim=True)
                else:
                    logits = logits / temperature
                    if top_k is not None:
                        kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
                        logits = logits.masked_fill(logits < kth, float("-inf"))
                    probs = F.softmax(logits, dim=-1)
                    next_id = torch.multinomial(probs, 1, generator=generator)
                idx = torch.cat([idx, next_id], dim=1)
        finally:
            self.train(was_training)
            if cp_mesh is not None:
                self.enable_context_parallel(cp_mesh)
        return idx
