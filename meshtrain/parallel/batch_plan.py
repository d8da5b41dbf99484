"""How one optimizer step's global batch is cut: micro-batches per rank, accumulation steps, and
what the loader draws (checked before any process starts)."""

from __future__ import annotations

from dataclasses import dataclass

from meshtrain.errors import ConfigError
from meshtrain.parallel.layout import Layout


@dataclass(frozen=True)
class BatchPlan:
    """How one optimizer step's ``global_batch_size`` samples are cut."""

    micro_batch_size: int  # samples per forward pass on one rank
    grad_accum_steps: int  # micro-batches per optimizer step on one rank
    loader_batch_size: int  # samples per draw from the loader (a whole step's under pp)


def plan_batches(layout: Layout, global_batch_size: int, micro_batch_size: int | None,
                 stages_per_rank: int = 1) -> BatchPlan:
    """Check that the global batch divides over the batch ranks and micro-batches."""
    ways, pp = layout.batch_degree, layout.degree("pp")
    if pp > 1 and micro_batch_size is None and global_batch_size % ways == 0:
        # enough micro-batches to fill the pipeline: one per stage
        per_rank, fill = global_batch_size // ways, pp * stages_per_rank
        micro_batch_size = per_rank // fill if per_rank % fill == 0 else per_rank
    if micro_batch_size is None:
        if global_batch_size % ways:
            raise ConfigError(f"global_batch_size={global_batch_size} does not divide over {ways} "
                              f"data-parallel ranks; use a multiple of {ways}")
        micro_batch_size = global_batch_size // ways
    if global_batch_size % (ways * micro_batch_size):
        raise ConfigError(
            f"global_batch_size={global_batch_size} is not a multiple of data-parallel "
            f"degree x micro_batch_size = {ways} x {micro_batch_size} = "
            f"{ways * micro_batch_size}; choose a global batch that is a multiple of "
            f"{ways * micro_batch_size}, or a micro_batch_size that divides "
            f"{global_batch_size // ways}")
    accum = global_batch_size // (ways * micro_batch_size)
    loader = global_batch_size // ways if pp > 1 else micro_batch_size
    return BatchPlan(micro_batch_size, accum, loader)
