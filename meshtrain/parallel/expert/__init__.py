"""Expert parallel (``ep``): the experts of mixture-of-experts layers split over ranks borrowed
from the data-parallel axis, tokens sent to their experts' ranks and back by all-to-all."""

from meshtrain.parallel.expert.apply import (
    apply_expert_parallel, check_expert_parallel, clip_grad_norm, expert_params,
    sync_expert_grads)

__all__ = ["apply_expert_parallel", "check_expert_parallel", "clip_grad_norm", "expert_params",
           "sync_expert_grads"]
