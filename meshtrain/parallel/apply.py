"""Turning a plain model into a parallel one, in one fixed order.

The order (as in torchtitan) is: pipeline split, tensor parallel, activation checkpointing,
compile, then the data-parallel wrapper (FSDP or DDP) last, because it must see the final
parameters. Only data parallelism exists so far; later strategies add their ``apply_*`` step at
their place in :func:`parallelize` and nowhere else.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from meshtrain.parallel.data_parallel import apply_ddp
from meshtrain.parallel.layout import Layout


@dataclass(frozen=True)
class DataParallelOptions:
    """Knobs of the data-parallel wrapper."""

    bucket_cap_mb: float = 25.0
    comm_hook: str | None = None
    powersgd_rank: int = 1


def parallelize(
    model: torch.nn.Module,
    layout: Layout,
    mesh,
    *,
    device: torch.device,
    dp_options: DataParallelOptions = DataParallelOptions(),
) -> torch.nn.Module:
    """Apply ``layout`` to ``model`` in place; return the module to call for training steps.

    The returned module may be a wrapper (DDP) used only inside the Trainer; ``model`` itself
    keeps its parameters, so user code reads and saves ``model`` as it is.
    """
    if layout.dp_degree > 1:
        return apply_ddp(
            model,
            mesh,
            axis="dp",
            bucket_cap_mb=dp_options.bucket_cap_mb,
            comm_hook=dp_options.comm_hook,
            powersgd_rank=dp_options.powersgd_rank,
            device=device,
        )
    return model
