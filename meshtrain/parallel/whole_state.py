"""The whole model's state on every rank, whatever the layout: DTensor shards gathered, and the
pipeline stages of all ranks put together (what a recipe exports or samples from at the end, and
what ``meshtrain parity`` compares); and the whole model itself (``Trainer.whole_model``)."""

from __future__ import annotations

import copy

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


def skeleton(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``model``'s structure that holds no weights: its parameters and persistent
    buffers on the meta device (shared ones still shared), everything else copied (small: a
    rotary table, a mask). Taken before a layout changes the model; :func:`whole_model` fills it."""
    state_ids = {id(t) for t in model.state_dict(keep_vars=True).values()}
    memo = {}
    for tensor in [*model.parameters(), *model.buffers()]:
        if id(tensor) in state_ids and id(tensor) not in memo:
            empty = torch.empty_like(tensor, device="meta")
            memo[id(tensor)] = (torch.nn.Parameter(empty, tensor.requires_grad)
                                if isinstance(tensor, torch.nn.Parameter) else empty)
    return copy.deepcopy(model, memo)


def whole_model(model: torch.nn.Module, template, pp_degree: int) -> torch.nn.Module:
    """Collective: the trained ``model`` whole, on every rank. Under a layout that keeps it
    whole in plain tensors (one process, dp, zero1/2, ps) that is ``model`` itself; otherwise
    (FSDP2, tp, cp's sharded storage, pp's stages) a new module on the CPU with the gathered
    weights: ``template`` (a :func:`skeleton`, or the factory that builds the model) filled."""
    whole = pp_degree == 1 and not any(
        hasattr(t, "full_tensor") for t in model.state_dict().values())
    if whole:
        return model
    state = whole_state(model, pp_degree)
    if isinstance(template, torch.nn.Module):  # real tensors where the skeleton has meta ones
        memo = {}
        for tensor in [*template.parameters(), *template.buffers()]:
            if tensor.is_meta and id(tensor) not in memo:
                empty = torch.empty_like(tensor, device="cpu")
                memo[id(tensor)] = (torch.nn.Parameter(empty, tensor.requires_grad)
                                    if isinstance(tensor, torch.nn.Parameter) else empty)
        built = copy.deepcopy(template, memo)
    else:
        with torch.device("cpu"):
            built = template()
    built.load_state_dict(state)
    return built
