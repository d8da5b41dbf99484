"""The whole model's state on every rank, whatever the layout: DTensor shards gathered, and the
pipeline stages of all ranks put together (what a recipe exports or samples from at the end, and
what ``meshtrain parity`` compares)."""

from __future__ import annotations

import torch
import torch.distributed as dist


def full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """A sharded (DTensor) parameter gathered whole (collective); a plain tensor as it is."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def whole_state(model: torch.nn.Module, pp_degree: int) -> dict[str, torch.Tensor]:
    """Collective: the full model's state on every rank (DTensors gathered, and under pipeline
    parallel every rank's stages put together; stages keep full-model names)."""
    state = {k: full_tensor(v).detach().cpu().clone() for k, v in model.state_dict().items()}
    if pp_degree > 1:
        parts: list = [None] * dist.get_world_size()
        dist.all_gather_object(parts, state)
        state = {k: v for part in parts for k, v in part.items()}
    return state
