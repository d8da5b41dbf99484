"""A Hugging Face mixture-of-experts model's expert load, counted as meshtrain counts its own
MoE's (meshtrain.moe.layer: ``MoERouting``): each router's top-k picks in a step's training
forwards, from a forward hook on the router class the model declares
(``_can_record_outputs["router_logits"]``: transformers' routers return
``(logits, weights, top-k indices)``), summed over the data- and context-parallel ranks once a
step (``after_step``). The Engine then logs them as it logs meshtrain's (``moe/layer{i}/...``,
``moe/imbalance``) and rank 0 writes ``experts.jsonl`` for the report (meshtrain.moe.balance,
meshtrain/loop/step_end.py).

Only training forwards count (``recording()`` is on around them: not validation, nor a
forward recomputed in the backward by activation checkpointing). Every token a router sees
counts, padding included, as meshtrain's own MoE counts them. Under ``pp`` a Hugging Face
model's routers are not counted (the pipeline's stages run them; meshtrain/moe/pipeline.py
counts meshtrain's own MoE layers only)."""

from __future__ import annotations

import contextlib

import torch


class RouterPicks:
    """The top-k picks of ``routers`` (E experts each) in the training forwards of a step:
    ``[routers, E]`` float64 counts. A router's output's last element is its top-k indices
    (transformers' routers); a router that returns its logits alone has its top-``top_k`` of
    them counted (``logits_index``: where the logits are in a tuple output)."""

    def __init__(self, routers: list[torch.nn.Module], num_experts: int, top_k: int,
                 logits_index: int = 0):
        self.routers, self.num_experts, self.top_k = routers, num_experts, top_k
        self._logits_index = logits_index
        self.recording = False
        self._counts: torch.Tensor | None = None  # [routers, E + 1]: a slot E is dropped
        for index, router in enumerate(routers):
            router.register_forward_hook(
                lambda module, args, output, index=index: self._count(index, output))

    def picks(self, output) -> torch.Tensor:
        """The top-k expert indices of a router's ``output``."""
        if isinstance(output, (tuple, list)):
            last = output[-1]
            if isinstance(last, torch.Tensor) and not last.is_floating_point():
                return last
            output = output[self._logits_index]
        return torch.topk(output.detach(), self.top_k, dim=-1).indices

    def _count(self, index: int, output) -> None:
        if not self.recording:
            return
        picks = self.picks(output).detach().reshape(-1)
        if self._counts is None:
            self._counts = torch.zeros(len(self.routers), self.num_experts + 1,
                                       dtype=torch.float64, device=picks.device)
        inside = (picks >= 0) & (picks < self.num_experts)
        self._counts[index].index_add_(
            0, torch.where(inside, picks, self.num_experts),
            torch.ones(picks.numel(), dtype=torch.float64, device=picks.device))

    @contextlib.contextmanager
    def recorded(self):
        """Around a training forward: its routers' picks added to the step's."""
        self.recording = True
        try:
            yield
        finally:
            self.recording = False

    @torch.no_grad()
    def after_step(self, group=None) -> torch.Tensor:
        """The step's picks ``[routers, E]`` summed over ``group`` (the ranks with other
        tokens); the count starts again from zero."""
        if self._counts is None:
            counts = torch.zeros(len(self.routers), self.num_experts, dtype=torch.float64,
                                 device=_device(self.routers[0]))
        else:
            counts = self._counts[:, :self.num_experts].clone()
            self._counts.zero_()
        if group is not None and torch.distributed.get_world_size(group) > 1:
            torch.distributed.all_reduce(counts, group=group)
        return counts


def _device(module: torch.nn.Module) -> torch.device:
    tensor = next(iter([*module.parameters(), *module.buffers()]), None)
    return tensor.device if tensor is not None else torch.device("cpu")


class HFRouterCounts:
    """What the Engine asks of a router loss (meshtrain.moe.balance), for a transformers MoE
    model trained without one (``output_router_logits`` off): no loss, nothing added to the
    model's call, its routers' picks counted (:class:`RouterPicks`) for the expert load."""

    call_kwargs: dict = {}
    field = "config.output_router_logits"
    coef = 0.0
    pipelines = True  # nothing to carry under pp (where its routers go uncounted)

    def __init__(self, picks: RouterPicks):
        self.picks = picks

    def recording(self):
        return self.picks.recorded()

    @property
    def counted_layers(self) -> int:
        """The rows of :meth:`after_step`'s counts: one per router."""
        return len(self.picks.routers)

    def after_step(self, group=None) -> torch.Tensor:
        return self.picks.after_step(group)
