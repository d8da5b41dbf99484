"""Local SGD: average parameters every H steps instead of gradients every step (Stich, "Local
SGD converges fast and communicates little", ICLR 2019; Lin et al., "Don't use large
mini-batches, use local SGD", ICLR 2020), optionally with DiLoCo's outer optimizer (Douillard
et al., "DiLoCo: distributed low-communication training of language models", 2023).

Each data-parallel rank steps its own optimizer on its own gradients (no DDP, no gradient
all-reduce); after every ``H``-th optimizer step the parameters are averaged over the ranks with
all-reduces of flat buckets. Averaging is linear, so with SGD (momentum too) and ``H = 1`` this
is plain data parallelism; with Adam the ranks' moment estimates differ and it is not.

With ``outer_lr``, the average is not taken as it is: ``delta = theta_global - mean(theta_rank)``
is treated as a gradient of ``theta_global`` (the parameters at the last average) for SGD with
Nesterov momentum (``outer_lr``, ``outer_momentum``; DiLoCo uses 0.7 and 0.9), and every rank
starts the next round from the new ``theta_global``. ``outer_lr = 1`` without momentum is plain
averaging.

Traffic: the parameters' bytes once every H steps (``bytes_per_step = parameter bytes / H``)
against the gradients' bytes every step for DDP.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from meshtrain.errors import ConfigError

BUCKET_BYTES = 64 * 2**20


def check_local_sgd(layout, every: int | None, outer_lr: float | None,
                    outer_momentum: float) -> None:
    """Before any process starts: local SGD needs plain replicated data parallelism."""
    if every is None:
        if outer_lr is not None:
            raise ConfigError(f"outer_lr={outer_lr} is DiLoCo's outer step of local SGD; set "
                              "local_sgd_every=H too (e.g. local_sgd_every=16), or drop outer_lr")
        return
    if not layout.uses_ddp or layout.zero_stage:
        raise ConfigError(
            f"local_sgd_every={every} averages the parameters of replicated data-parallel ranks, "
            f"but the layout {layout} is not plain data parallel ({layout.why_not_ddp()}); use "
            "layout='dp=N', or drop local_sgd_every")
    if outer_lr is not None and not outer_lr > 0:
        raise ConfigError(f"outer_lr must be > 0 (DiLoCo uses 0.7), got {outer_lr}")
    if not 0 <= outer_momentum < 1:
        raise ConfigError(f"outer_momentum must be in [0, 1) (DiLoCo uses 0.9), got "
                          f"{outer_momentum}")


def _buckets(tensors: list[torch.Tensor]) -> list[list[int]]:
    """Indices of ``tensors`` in groups of at most BUCKET_BYTES (one all-reduce each)."""
    groups, size = [[]], 0
    for i, t in enumerate(tensors):
        nbytes = t.numel() * t.element_size()
        if groups[-1] and size + nbytes > BUCKET_BYTES:
            groups.append([])
            size = 0
        groups[-1].append(i)
        size += nbytes
    return groups


class LocalSGD:
    """Averages ``model``'s trainable parameters over ``group`` every ``every`` steps (call
    :meth:`after_step` after each optimizer step)."""

    def __init__(self, model: torch.nn.Module, group, every: int, *,
                 outer_lr: float | None = None, outer_momentum: float = 0.9) -> None:
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.group, self.every = group, every
        self.ways = dist.get_world_size(group)
        self.buckets = _buckets(self.params)
        self.anchor = self.outer = None
        if outer_lr is not None:
            self.anchor = [p.detach().clone() for p in self.params]
            self.outer = torch.optim.SGD(self.anchor, lr=outer_lr, momentum=outer_momentum,
                                         nesterov=outer_momentum > 0)
        self.pending = False  # steps taken since the last average
        self.param_bytes = sum(p.numel() * p.element_size() for p in self.params)

    @property
    def bytes_per_step(self) -> float:
        """Bytes each rank all-reduces per optimizer step, on average."""
        return self.param_bytes / self.every

    def after_step(self, step: int) -> None:
        """After optimizer step ``step`` (1-based): average every ``every`` steps."""
        self.pending = step % self.every != 0
        if not self.pending:
            self.average()

    def finish(self) -> None:
        """Average the steps since the last average, if any (training ends with one model)."""
        if self.pending:
            self.average()
            self.pending = False

    @torch.no_grad()
    def average(self) -> None:
        averaged = [None] * len(self.params)
        for bucket in self.buckets:
            tensors = [self.params[i].detach() for i in bucket]
            flat = _flatten_dense_tensors(tensors)
            dist.all_reduce(flat, group=self.group)
            flat /= self.ways
            for i, mean in zip(bucket, _unflatten_dense_tensors(flat, tensors)):
                averaged[i] = mean
        if self.outer is None:
            for p, mean in zip(self.params, averaged):
                p.copy_(mean)
            return
        for anchor, mean in zip(self.anchor, averaged):
            anchor.grad = anchor - mean  # the outer gradient: how far the ranks moved, reversed
        self.outer.step()
        self.outer.zero_grad(set_to_none=True)
        for p, anchor in zip(self.params, self.anchor):
            p.copy_(anchor)
