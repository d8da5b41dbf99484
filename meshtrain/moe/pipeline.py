"""The routers' balancing inside pipeline stages: meshtrain's MoE layers under ``pp``.

A pipeline stage's loss is taken on the last stage only, and each of its micro-batches holds
part of the step's tokens, so the balancing loss cannot be added to the loss as without pp
(meshtrain.moe.balance). It is added where it arises instead, with the grouping every other
layout uses: one process with ``grad_accum_steps=m`` takes the balancing loss over each
micro-step's tokens (of every data-parallel rank); pipeline micro-batch ``i`` is that
micro-step. So each MoE layer, in each training forward:

* counts its micro-batch's picks per expert and rows, and sums them over the ranks holding the
  other tokens of the micro-batch (the stage's data- and context-parallel ranks: they run the
  same schedule, so their collectives line up);
* computes this rank's share of the layer's balancing loss (as ``balance_term``: linear in the
  probabilities, so the shares add up to the micro-step's loss, gradient included);
* hands its gradient to the backward through the layer's output (:class:`_Balance`, as
  Megatron's ``MoEAuxLossAutoScaler``): the output passes unchanged, and its backward gives
  the router's logits the gradient of ``coef x loss_degree / m`` x the share (times the fp16
  loss scale), exactly what one process's ``loss + coef x aux / m`` would give them.

The step's token counts (bias balancing, the expert-load metrics) are summed over every rank
once per step, each stage filling its own layers' rows, so every rank logs every layer.
"""

from __future__ import annotations

import contextlib
import functools

import torch
import torch.distributed as dist


class _Balance(torch.autograd.Function):
    """``out`` unchanged; in backward, ``logits`` get the gradient of ``weight() x`` the
    layer's balancing share, ``E * sum_e f_e * (sum of softmax(logits)_e) / rows`` with ``f``
    (the micro-step's picks per expert / rows, summed over ranks) fixed. Nothing is saved for
    autograd, so a recomputed forward (activation checkpointing) need not run it again."""

    @staticmethod
    def forward(ctx, out, logits, f_over_rows, weight):
        ctx.logits, ctx.f_over_rows, ctx.weight = logits.detach(), f_over_rows, weight
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):
        probs = ctx.logits.softmax(-1)
        w = ctx.f_over_rows.to(probs.dtype) * (ctx.weight().to(probs.dtype) * probs.shape[-1])
        return grad, probs * (w - (probs * w).sum(-1, keepdim=True)), None, None


class PipelineRouting:
    """This rank's stages' MoE layers (``layers``: {index among the model's MoE layers: layer},
    of ``num_layers``), balanced as the module docstring says; what the engine reads of a
    router loss (``coef``, ``after_step``, ``last_aux``, ``last_counts``)."""

    call_kwargs: dict = {}

    def __init__(self, layers: dict, num_layers: int, num_experts: int, coef: float,
                 bias_rate: float, *, group, everyone, loss_degree: int, num_microbatches: int,
                 field: str, device: torch.device):
        self.layers, self.coef, self.bias_rate, self.field = layers, coef, bias_rate, field
        self.group, self.everyone = group, everyone
        self.weight = coef * loss_degree / num_microbatches  # d(loss)/d(share) of one process's
        self.num_microbatches, self.num_layers = num_microbatches, num_layers
        self.num_experts, self.device = num_experts, device
        self.scale_loss = lambda loss: loss  # fp16: the grad scaler's (the runner's scale_loss)
        # per layer, this step's training forwards: (picks per expert, balancing share). The
        # last m are the micro-batches' (the first step's schedule runs one more before them,
        # on placeholder inputs, to learn the shapes)
        self._forwards: dict[int, list] = {index: [] for index in layers}
        for index, layer in layers.items():
            layer.balance = functools.partial(self._forward, index)

    @contextlib.contextmanager
    def recording(self):
        yield  # (the layers record themselves)

    def _forward(self, index: int, layer, out, counts, logits):
        if not layer.training or torch._C._current_graph_task_id() != -1:
            return out  # (eval, or a forward recomputed inside the backward)
        share = torch.zeros((), dtype=torch.float64, device=counts.device)
        if self.coef:
            totals = torch.cat([counts.to(logits.dtype) / layer.router.top_k,
                                torch.tensor([float(logits.shape[0])], dtype=logits.dtype,
                                             device=logits.device)])
            if self.group is not None and dist.get_world_size(self.group) > 1:
                dist.all_reduce(totals, group=self.group)
            f_over_rows = totals[:-1] / totals[-1].clamp(min=1) ** 2
            with torch.no_grad():
                share = (f_over_rows * logits.softmax(-1).sum(0)).sum() * self.num_experts
            out = _Balance.apply(out, logits, f_over_rows,
                                 functools.partial(self._gradient, logits.dtype, logits.device))
        self._forwards[index].append((counts.to(torch.float64), share.to(torch.float64)))
        return out

    def _gradient(self, dtype, device) -> torch.Tensor:
        """d(loss)/d(share), as a tensor (no host sync in the backward)."""
        return self.scale_loss(torch.full((), self.weight, dtype=dtype, device=device))

    def _step(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This step's counts [layers, E] (this rank's layers filled) and balancing share."""
        counts = torch.zeros(self.num_layers, self.num_experts, dtype=torch.float64,
                             device=self.device)
        aux = torch.zeros((), dtype=torch.float64, device=self.device)
        for index, forwards in self._forwards.items():
            for c, share in forwards[-self.num_microbatches:]:
                counts[index] += c.to(self.device)
                aux += share.to(self.device) / self.num_microbatches
        return counts, aux

    def added_loss(self) -> torch.Tensor:
        """What this rank's layers added to the step's loss, as its logged loss counts it
        (summed over the stages, averaged over the loss ranks: ``coef`` x the balancing loss)."""
        return self._step()[1] * (self.weight * self.num_microbatches)

    @torch.no_grad()
    def after_step(self, group=None) -> torch.Tensor:
        """Once per optimizer step, on every rank: the step's counts [layers, E] and balancing
        loss summed over every rank (each stage holds its own layers' rows), the biases of this
        rank's layers moved by them; returns the counts."""
        counts, aux = self._step()
        both = torch.cat([counts.reshape(-1), aux.reshape(1)])
        if self.everyone is not None and dist.get_world_size(self.everyone) > 1:
            dist.all_reduce(both, group=self.everyone)
        counts = both[:-1].view_as(counts)
        if self.coef:
            self.last_aux = both[-1:]
        if self.bias_rate:
            for index, layer in self.layers.items():
                bias, c = layer.router.expert_bias, counts[index]
                bias += (self.bias_rate * torch.sign(c.mean() - c)).to(bias.dtype)
        for forwards in self._forwards.values():
            forwards.clear()
        return counts


def pipeline_routing(model: torch.nn.Module, stages: torch.nn.Module, mesh,
                     num_microbatches: int, device: torch.device) -> PipelineRouting | None:
    """The routing of ``stages`` (this rank's, merged) cut from ``model``, when ``model`` has
    meshtrain's MoE layers (``model.router_loss()``), else None."""
    own = getattr(model, "router_loss", None)
    routing = own() if callable(own) else None
    if routing is None or not hasattr(routing, "after_step"):
        return None
    ids = {id(layer) for layer in routing.layers}
    index = {name: i for i, name in enumerate(
        n for n, m in model.named_modules() if id(m) in ids)}
    # (a stage without MoE layers still takes part in summing the others' counts)
    held = {index[name]: m for name, m in stages.named_modules() if name in index}
    return PipelineRouting(held, len(index), routing.layers[0].num_experts, routing.coef,
                           routing.bias_rate, group=mesh.loss_group(), everyone=mesh.everyone(),
                           loss_degree=mesh.layout.loss_degree,
                           num_microbatches=num_microbatches, field=routing.field, device=device)
