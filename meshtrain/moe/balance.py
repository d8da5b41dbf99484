"""The routers' load-balancing loss, computed over the tokens of one micro-step of every
data-parallel rank (Megatron's "global-batch" balance), so that every layout trains like one
process given the same global batch.

The loss of Switch Transformer, as transformers computes it for its MoE models
(``load_balancing_loss_func``: every layer's rows pooled, top-k counted per slot)::

    aux = E * sum_e f_e * P_e,   f_e = (top-k picks of e) / rows,   P_e = (sum of p_e) / rows

``f`` takes no gradient, so ``aux`` is linear in the probability sums: each rank adds
``E * sum_e f_e * (its own sum of p_e) / rows`` with ``f`` and ``rows`` summed over the ranks
first (one all-reduce of E + 1 numbers), and the ranks' terms add up to the global batch's
``aux`` exactly, gradient included. A group of layers pooled (transformers) is one row of
:class:`RouterStats`; meshtrain's own MoE layers give one row each, summed.

The reductions follow transformers' line for line (float32 sums, ``histc`` counts), so that one
process reproduces plain transformers bit for bit; ``models/hf/moe.py`` checks before start
that the model's own function still agrees.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from meshtrain.errors import ConfigError


@dataclass
class RouterStats:
    """One micro-batch's routing, ``G`` groups of layers by ``E`` experts: ``counts`` [G, E]
    top-k picks (no gradient), ``prob_sums`` [G, E] routing probabilities summed over the rows
    (with gradient), ``rows`` [G] tokens x layers (weighted by the attention mask), float32."""

    counts: torch.Tensor
    prob_sums: torch.Tensor
    rows: torch.Tensor

    @property
    def num_experts(self) -> int:
        return self.counts.shape[-1]


def router_stats(gate_logits: Sequence[torch.Tensor], num_experts: int, top_k: int,
                 attention_mask: torch.Tensor | None = None) -> RouterStats:
    """Every layer's router logits ([tokens, E] each) pooled into one group, as transformers'
    ``load_balancing_loss_func`` pools them: softmax, top-k picks counted, probabilities
    summed in float32, rows masked by ``attention_mask`` ([batch, seq]) when given."""
    device = gate_logits[0].device
    histc_dtype = torch.float32 if device.type in ("cpu", "mps") else torch.int32
    counts = torch.zeros(num_experts, dtype=torch.float32, device=device)
    prob_sums = torch.zeros(num_experts, dtype=torch.float32, device=device)
    rows = torch.zeros((), dtype=torch.float32, device=device)
    if attention_mask is not None:
        flat_mask = attention_mask.reshape(-1).to(device=device, dtype=torch.float32)
    for layer_gate in gate_logits:
        weights = torch.nn.functional.softmax(layer_gate.to(device), dim=-1)
        _, selected = torch.topk(weights, top_k, dim=-1)
        if attention_mask is None:
            counts = counts + torch.histc(selected.reshape(-1).to(histc_dtype), bins=num_experts,
                                          min=0, max=num_experts)
            prob_sums = prob_sums + weights.float().sum(dim=0)
            rows = rows + weights.shape[0]
        else:
            counts = counts + torch.zeros(num_experts, dtype=torch.float32, device=device
                                          ).scatter_add_(0, selected.reshape(-1),
                                                         flat_mask.repeat_interleave(top_k))
            prob_sums = prob_sums + (weights.float() * flat_mask.unsqueeze(-1)).sum(dim=0)
            rows = rows + flat_mask.sum()
    return RouterStats(counts.detach()[None], prob_sums[None], rows.reshape(1))


def balance_term(stats: RouterStats, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """This rank's share of the load-balancing loss (with gradient). ``group``: the ranks whose
    tokens make up the micro-step (data and context parallel); the shares summed over them are
    the loss of all their tokens together, and so are their gradients."""
    counts, rows = stats.counts, stats.rows
    if group is not None and dist.get_world_size(group) > 1:
        both = torch.cat([counts, rows[:, None]], dim=1)
        dist.all_reduce(both, group=group)
        counts, rows = both[:, :-1], both[:, -1]
    rows = rows.clamp(min=1)[:, None]
    tokens_per_expert = counts / rows
    return (tokens_per_expert * (stats.prob_sums / rows)).sum() * stats.num_experts


def router_loss_of(model: torch.nn.Module, adapt=None):
    """The router loss meshtrain adds to a model's own loss: ``model.router_loss()`` (a model
    of meshtrain's), else what ``adapt(model)`` gives (a Hugging Face MoE model), else None.
    The object has ``coef``, ``field`` (the setting that turns it on), ``call_kwargs`` (for
    the model's call), ``recording()`` (around a forward) and ``stats(batch)`` (of the forward
    recorded last: :class:`RouterStats`).

    A research module (``training_step``: a ``TrainingModule``) holding meshtrain's MoE model
    gives that model's: its steps' losses get the balancing added as a plain model's loss
    does (a Hugging Face model's router loss stays the module's own, as its step computes it)."""
    own = getattr(model, "router_loss", None)
    if callable(own):
        return own()
    if callable(getattr(model, "training_step", None)):
        held = [r for m in model.modules() if m is not model and callable(
            getattr(m, "router_loss", None)) and (r := m.router_loss()) is not None]
        if len(held) > 1:
            raise ConfigError(f"{type(model).__name__} holds {len(held)} mixture-of-experts "
                              "models of meshtrain's; their balancing needs one model a module")
        return held[0] if held else None
    return adapt(model) if adapt is not None else None


def check_router_loss(model: torch.nn.Module, layout, adapt=None, experts=None) -> None:
    """Before start: a router loss meshtrain cannot carry under ``layout`` is refused (a
    pipeline's micro-batches would each see part of the batch, and its loss runs on the last
    stage only, without the routers of the others), unless its layers balance themselves
    inside the stages (meshtrain's MoE: meshtrain/moe/pipeline.py). ``experts``: the expert
    layers' adapter (ep is recommended where it finds some)."""
    router_loss = router_loss_of(model, adapt)
    if router_loss is not None and router_loss.coef and not getattr(
            model, "automatic_optimization", True):  # (a module driving its own backward)
        raise ConfigError(
            f"{type(model).__name__} drives its own backward passes (automatic_optimization="
            f"False) and holds a mixture-of-experts model whose balancing loss meshtrain adds "
            f"to the loss ({router_loss.field}, router_aux_loss_coef={router_loss.coef}): it "
            "would never reach your backward. Set the coefficient to 0 (bias balancing, "
            "router_bias_rate, still works), or use automatic optimization")
    if router_loss is not None and layout.degree("pp") > 1 and not getattr(
            router_loss, "pipelines", False):
        from meshtrain.parallel.expert.apply import expert_layers

        carry = "dp, zero1/2/3 and ep" if expert_layers(model, experts) else "dp and zero1/2/3"
        raise ConfigError(
            f"{type(model).__name__} routes tokens to experts and meshtrain balances them "
            f"({router_loss.field}) over the tokens of a whole micro-step on every data-"
            "parallel rank; under pp each pipeline micro-batch holds part of them and the "
            "loss is taken on the last stage only, so it would train differently from one "
            f"process. Drop pp ({carry} carry it), or turn {router_loss.field} off")


def added_router_loss(router_loss, batch, group, loss_degree: int, accum: int,
                      loss: torch.Tensor) -> torch.Tensor:
    """``loss`` plus what a micro-step adds to this rank's loss: ``coef`` x its share of the
    balancing loss, scaled like the rest of the loss (gradients are averaged over
    ``loss_degree`` ranks, and each of ``accum`` micro-steps adds its own)."""
    share = balance_term(router_loss.stats(batch), group)
    step = getattr(router_loss, "step_shares", None)  # (logged once a step: end_of_step)
    router_loss.step_shares = share.detach() / accum + (0 if step is None else step)
    added = share * (router_loss.coef * loss_degree / accum)
    if isinstance(loss, DTensor):  # tp's loss_parallel: the loss is a DTensor, alike on tp ranks
        added = DTensor.from_local(added, loss.device_mesh, loss.placements, run_check=False)
    return loss + added


def end_of_step(router_loss, group) -> None:
    """Once per optimizer step, on every rank: the step's balancing loss (averaged over its
    micro-steps) and, for a model that counts it, its tokens per expert, summed over ``group``
    and kept as tensors (``last_aux``, ``last_counts``: no host sync here; read at logging
    time by :func:`routing_metrics`); the bias balancing of a model that balances so."""
    shares = getattr(router_loss, "step_shares", None)
    if shares is not None:
        total = shares.detach().double().reshape(1)
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(total, group=group)
        router_loss.last_aux, router_loss.step_shares = total, None
    if callable(getattr(router_loss, "after_step", None)):
        router_loss.last_counts = router_loss.after_step(group)


def routing_metrics(router_loss) -> dict[str, float]:
    """The last step's routing as logged metrics: ``train/router_aux_loss`` and the expert
    load (:func:`load_metrics`); {} before any step or without a router."""
    metrics = {}
    aux = getattr(router_loss, "last_aux", None)
    if aux is not None:
        metrics["train/router_aux_loss"] = float(aux)
    counts = getattr(router_loss, "last_counts", None)
    if counts is not None:
        metrics.update(load_metrics(counts))
    return metrics


def load_metrics(counts: torch.Tensor) -> dict[str, float]:
    """Tokens per expert in a step ([layers, E], every rank's): per layer the least, mean and
    most, and the imbalance max / mean (1 when balanced; E when one expert takes every
    token); ``moe/imbalance`` the worst layer's."""
    metrics = {}
    for i, layer in enumerate(counts.double()):
        mean = layer.mean().clamp(min=1e-12)
        metrics.update({f"moe/layer{i}/tokens_min": float(layer.min()),
                        f"moe/layer{i}/tokens_mean": float(mean),
                        f"moe/layer{i}/tokens_max": float(layer.max()),
                        f"moe/layer{i}/imbalance": float(layer.max() / mean)})
    if len(counts):
        metrics["moe/imbalance"] = max(metrics[f"moe/layer{i}/imbalance"]
                                       for i in range(len(counts)))
    return metrics


def routing_metric_names(router_loss) -> list[str]:
    """The names :func:`routing_metrics` logs for a model whose router loss (as
    :func:`router_loss_of` gives it) is ``router_loss``: ``train/router_aux_loss`` when its
    balancing loss is on (a coefficient > 0), and the expert load of every layer it counts
    (``counted_layers``: the rows of its ``after_step`` counts); [] without one."""
    if router_loss is None:
        return []
    counted = getattr(router_loss, "counted_layers", 0) if callable(
        getattr(router_loss, "after_step", None)) else 0
    per_layer = [f"moe/layer{i}/tokens_{s}" for i in range(counted)
                 for s in ("min", "mean", "max")]
    per_layer += [f"moe/layer{i}/imbalance" for i in range(counted)]
    return (["train/router_aux_loss"] if router_loss.coef else []) + per_layer + \
        (["moe/imbalance"] if counted else [])


def recording(router_loss):
    """``router_loss.recording()``, or nothing to record."""
    return router_loss.recording() if router_loss is not None else contextlib.nullcontext()
