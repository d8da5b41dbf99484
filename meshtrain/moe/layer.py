"""meshtrain's mixture-of-experts layer: a top-k router, experts held as grouped weights
``[E, ...]`` (so that expert parallel can split them by expert), dropless routing (every token
reaches its k experts: no capacity factor, so no result depends on how tokens are grouped), an
optional shared expert, and the two balancing methods: the load-balancing loss
(meshtrain.moe.balance) and auxiliary-loss-free balancing, a per-expert bias used only to pick
experts, moved once per step from the global token counts (DeepSeek-V3; torchtitan's
``expert_bias``): ``bias += rate * sign(mean count - count)``.

The forward (B, T, d) -> (B, T, d): the router scores each token, the (token, slot) pairs are
sorted by expert, ``dispatch`` runs the experts on them (the experts alone, or under ``ep`` an
all-to-all to the ranks that hold them and back: meshtrain/parallel/expert/dispatch.py), and
each token's outputs are summed with its router weights. The experts are one grouped GEMM per
weight (meshtrain/moe/grouped.py); the counts stay on the device, so the layer reads no value
on the host (under ep its all-to-all reads its split sizes, once a forward) and compiles whole.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn as nn
import torch.nn.functional as F

from meshtrain.errors import ConfigError
from meshtrain.moe import grouped
from meshtrain.moe.balance import RouterStats

SCORES = ("softmax", "sigmoid")


class Router(nn.Module):
    """``gate``: d -> E logits. Scores are the softmax (or sigmoid) of the logits; a token's
    experts are its top-k of ``scores + expert_bias`` (the bias only picks); its weights are
    their scores (renormalised to sum to 1 for sigmoid scores)."""

    def __init__(self, d_model: int, num_experts: int, top_k: int, score: str = "softmax"):
        super().__init__()
        if score not in SCORES:
            raise ConfigError(f"router score must be one of {SCORES}, got {score!r}")
        if not 1 <= top_k <= num_experts:
            raise ConfigError(f"experts_per_token={top_k} must be between 1 and num_experts="
                              f"{num_experts}: a token cannot be routed to more experts than "
                              "there are")
        self.num_experts, self.top_k, self.score = num_experts, top_k, score
        self.gate = nn.Linear(d_model, num_experts, bias=False)
        # auxiliary-loss-free balancing: moved by MoERouting.after_step, saved in checkpoints
        self.register_buffer("expert_bias", torch.zeros(num_experts))

    def forward(self, x: torch.Tensor):
        """(weights [N, k], experts [N, k], logits [N, E]) for tokens ``x`` [N, d]."""
        logits = self.gate(x)
        scores = logits.softmax(-1) if self.score == "softmax" else logits.sigmoid()
        _, experts = torch.topk(scores.detach() + self.expert_bias.to(scores.dtype), self.top_k,
                                dim=-1)
        weights = scores.gather(-1, experts)
        if self.score == "sigmoid":
            weights = weights / weights.sum(-1, keepdim=True)
        return weights, experts, logits


class GroupedExperts(nn.Module):
    """E two-layer GELU MLPs as grouped weights: ``w_in`` [E, d, h], ``w_out`` [E, h, d].
    ``forward(tokens, counts)``: ``tokens`` sorted by expert, ``counts[e]`` of them for expert
    e (a tensor on their device; this module's experts: all of them, or a rank's slice under
    ep), computed as one grouped GEMM per weight (meshtrain/moe/grouped.py), or where the
    kernel has none for the dtype (float64) each expert in turn, masked; no host sync either
    way. Under autocast both compute in its dtype, as a matmul would."""

    rows: slice | None = None  # under ep: the rows of the whole [E, ...] weights held here
    ep_mesh = None  # under ep: the ranks the experts are split over

    def __init__(self, num_experts: int, d_model: int, hidden: int):
        super().__init__()
        self.w_in = nn.Parameter(torch.empty(num_experts, d_model, hidden))
        self.w_out = nn.Parameter(torch.empty(num_experts, hidden, d_model))

    def forward(self, tokens: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        w_in, w_out = self.w_in, self.w_out
        if tokens.is_meta:  # a planner's probe: counts on the host, each expert's matmuls
            return grouped.looped_experts(tokens, w_in, w_out, counts.tolist(), F.gelu)
        device = tokens.device.type
        if torch.is_autocast_enabled(device):  # (_grouped_mm is not autocast's: cast here)
            dtype = torch.get_autocast_dtype(device)
            tokens, w_in, w_out = tokens.to(dtype), w_in.to(dtype), w_out.to(dtype)
        counts = counts.to(tokens.device)
        why = grouped.fallback_reason(tokens.dtype, *w_in.shape[1:], device=tokens.device)
        if why is None:
            return grouped.grouped_experts(tokens, w_in, w_out, counts, F.gelu)
        if not torch.compiler.is_compiling():  # (compiled: said by MoERouting.recording)
            grouped.say_fallback(why)
        return grouped.masked_experts(tokens, w_in, w_out, counts, F.gelu)

    def say_kernel(self) -> None:
        """Once, outside any graph: the experts' fallback and why, if they take it in this
        context (autocast's dtype, else the weights')."""
        w_in = self.w_in
        local = w_in.to_local() if hasattr(w_in, "to_local") else w_in
        device = local.device.type
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) \
            else w_in.dtype
        why = None if local.is_meta else grouped.fallback_reason(dtype, *local.shape[1:],
                                                                device=local.device)
        if why is not None:
            grouped.say_fallback(why)


class MoE(nn.Module):
    """A mixture-of-experts feed-forward layer (see the module docstring)."""

    def __init__(self, d_model: int, hidden: int, num_experts: int, top_k: int,
                 score: str = "softmax", shared_expert: nn.Module | None = None):
        super().__init__()
        self.router = Router(d_model, num_experts, top_k, score)
        self.experts = GroupedExperts(num_experts, d_model, hidden)
        self.shared = shared_expert
        self.dispatch = None  # (tokens, counts [E]) -> outputs; None: the experts here
        # under tp (meshtrain/moe/tensor_parallel.py): the experts' outputs are each rank's
        # shares, summed over the tp ranks after the router weights combine them
        self.hidden_split = None
        # training forwards' routing (MoERouting.recording): token counts and balance stats
        self.sink: list | None = None
        # under pp: (layer, out, counts, logits) -> out, in training forwards (moe/pipeline.py)
        self.balance = None
        # (not a buffer: DDP would overwrite each rank's with rank 0's at every forward)
        self.tokens_per_expert: torch.Tensor | None = None

    @property
    def num_experts(self) -> int:
        return self.router.num_experts

    @property
    def expert_module(self) -> nn.Module:
        return self.experts

    def compute_local(self, tokens: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        return self.experts(tokens, counts)

    def split_experts(self, rank: int, size: int) -> list[nn.Parameter]:
        """Keep experts ``rank*L .. (rank+1)*L - 1`` (L = E / size) of the grouped weights
        (expert parallel: meshtrain/parallel/expert/); returns the new parameters."""
        local = self.num_experts // size
        rows = slice(rank * local, (rank + 1) * local)
        kept = []
        for name in ("w_in", "w_out"):
            whole = getattr(self.experts, name)
            part = nn.Parameter(whole.detach()[rows].clone(), requires_grad=whole.requires_grad)
            setattr(self.experts, name, part)
            kept.append(part)
        self.experts.rows = rows  # which rows of the whole tensors (an init fills only them)
        return kept

    def run_experts(self, routed: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """The routed tokens through their experts: here (one grouped GEMM per weight, shapes
        fixed by the batch: compiled with the block), or dispatched under ep (its all-to-alls
        outside the graphs, the local experts in them: meshtrain/parallel/expert/dispatch.py)."""
        if self.dispatch is not None:
            return self.dispatch(routed, counts)
        return self.experts(routed, counts)

    @torch.compiler.disable(reason="a pipeline's balancing hook reads how it is called")
    def balanced(self, out, counts, logits) -> torch.Tensor:
        """``out`` through the pipeline's balancing hook (moe/pipeline.py), outside
        torch.compile's graphs: the hook does nothing in a forward recomputed inside the
        backward (activation checkpointing), a branch a graph would have fixed at its first
        trace (torch 2.13: "A different number of tensors was saved" in the recompute)."""
        return self.balance(self, out, counts, logits)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        weights, experts, logits = self.router(flat)
        picks = experts.reshape(-1)
        if picks.is_meta:  # a planner's probe (no values): routed as if balanced
            order = torch.arange(picks.numel(), device=picks.device)
            even, extra = divmod(picks.numel(), self.num_experts)
            sizes = [even + (e < extra) for e in range(self.num_experts)]
            counts = torch.tensor(sizes, device="cpu")
        else:
            order = picks.argsort(stable=True)  # (token, slot) pairs grouped by expert
            counts = torch.zeros(self.num_experts, dtype=torch.int64, device=picks.device
                                 ).scatter_add_(0, picks, torch.ones_like(picks))  # (a fixed
            # shape, unlike bincount's: the layer compiles whole)
        done = self.run_experts(flat.index_select(0, order // self.router.top_k), counts)
        if self.hidden_split is not None:  # (the weights' gradient: each rank's share, summed)
            weights = self.hidden_split.shares_in(weights)
        out = torch.empty_like(done).index_copy(0, order, done)  # back to (token, slot) order
        out = (out.view(-1, self.router.top_k, shape[-1]) * weights.unsqueeze(-1).to(out.dtype)
               ).sum(1)
        if self.hidden_split is not None:
            out = self.hidden_split.summed(out)
        if self.shared is not None:
            out = out + self.shared(flat)
        if self.sink is not None and torch.is_grad_enabled():  # (a step's no_grad uses: not)
            self.sink.append((counts, logits))
        if self.balance is not None and torch.is_grad_enabled() and not picks.is_meta:
            out = self.balanced(out, counts, logits)
        return out.view(shape)


class MoERouting:
    """What a model of MoE layers gives meshtrain (``model.router_loss()``): the
    load-balancing loss's coefficient and stats (one row per layer, summed), token counts per
    expert over each step (all-reduced: the expert load, the bias update)."""

    call_kwargs: dict = {}
    pipelines = True  # balanced inside pipeline stages too (meshtrain/moe/pipeline.py)

    def __init__(self, layers: list[MoE], coef: float, bias_rate: float,
                 field: str = "router_aux_loss_coef"):
        self.layers, self.coef, self.bias_rate, self.field = layers, coef, bias_rate, field
        self._recorded: list[list] = [[] for _ in layers]  # the last forward's, per layer

    @contextlib.contextmanager
    def recording(self):
        """Around a training forward: each layer's routing kept (for ``stats``) and its token
        counts added to the step's (for ``after_step``)."""
        for layer in self.layers:
            layer.sink = []
            layer.experts.say_kernel()
        try:
            yield
        finally:
            for i, layer in enumerate(self.layers):
                self._recorded[i], layer.sink = layer.sink, None
                for counts, _ in self._recorded[i]:
                    if layer.tokens_per_expert is None:
                        layer.tokens_per_expert = torch.zeros_like(counts, dtype=torch.float64)
                    layer.tokens_per_expert += counts

    @property
    def counted_layers(self) -> int:
        """The rows of :meth:`after_step`'s counts: one per MoE layer."""
        return len(self.layers)

    def stats(self, batch=None) -> RouterStats:
        rows = []
        for recorded in self._recorded:
            if len(recorded) != 1:
                raise ConfigError(
                    f"the training step ran the mixture-of-experts model {len(recorded)} times; "
                    "meshtrain balances its routers over one forward a micro-step (a "
                    "training_step calls the model once; its other uses go under "
                    "torch.no_grad() or in validation_step)")
            (counts, logits), = recorded  # (one forward of each layer)
            probs = logits.softmax(-1)  # (in the model's dtype: float64 runs are exact)
            rows.append((counts.to(probs.dtype), probs.sum(0),
                         torch.tensor(float(logits.shape[0]), device=logits.device,
                                      dtype=probs.dtype)))
        counts, prob_sums, n = zip(*rows)
        return RouterStats(torch.stack(counts) / self.layers[0].router.top_k,
                           torch.stack(prob_sums), torch.stack(n))

    @torch.no_grad()
    def after_step(self, group=None) -> torch.Tensor:
        """Once per optimizer step: the step's token counts [layers, E] summed over ``group``
        (the ranks with other tokens), the experts' biases moved by them (when balancing by
        bias), the counts reset. Returns the counts."""
        counts = torch.stack([torch.zeros(layer.num_experts, dtype=torch.float64,
                                          device=layer.router.expert_bias.device)
                              if layer.tokens_per_expert is None else layer.tokens_per_expert
                              for layer in self.layers])
        if group is not None and torch.distributed.get_world_size(group) > 1:
            torch.distributed.all_reduce(counts, group=group)
        if self.bias_rate:
            for layer, c in zip(self.layers, counts):
                bias = layer.router.expert_bias
                bias += (self.bias_rate * torch.sign(c.mean() - c)).to(bias.dtype)
        for layer in self.layers:
            layer.tokens_per_expert = None
        return counts
