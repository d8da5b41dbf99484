"""Before any process starts: does the model's forward still fit the shapes one tensor-parallel
rank holds?

Under ``tp=N`` a column-parallel layer (``ColwiseParallel``) returns 1/N of its output features
on each rank (its heads, under attention) as a plain tensor, and a row-parallel one takes 1/N of
its input features. A forward written for the whole model (``q.view(B, T, 4, head_dim)`` with
the head count hard-coded) then fails inside the first step with torch's bare shape error.
:func:`check_local_shapes` runs the forward twice on the meta device (no memory, no process):
with the whole model's shapes, then with one rank's; when only the second fails it names the
module whose forward failed and says how to reshape.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch.distributed.tensor import Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from meshtrain.check_skips import skipped
from meshtrain.errors import ConfigError


def _style(name: str, plan: dict):
    from meshtrain.parallel.tensor.tensor_parallel import module_matches

    return next((style for key, style in plan.items()
                 if isinstance(key, str) and module_matches(name, key)), None)


def _is_last_dim(layout) -> bool:
    return isinstance(layout, Shard) and layout.dim == -1


def local_shapes(model: nn.Module, plan: dict, tp: int) -> tuple[dict, list[str]]:
    """({parameter name: its shape on one rank}, the column-parallel modules whose output is a
    plain tensor of 1/tp of the features) for the Linear and Embedding layers the plan splits."""
    shapes, column = {}, []
    for name, module in model.named_modules():
        style = _style(name, plan) if name else None
        if not isinstance(module, (nn.Linear, nn.Embedding)) or style is None:
            continue
        weight = tuple(module.weight.shape)
        prefix = f"{name}." if name else ""
        if isinstance(style, ColwiseParallel) and style.use_local_output and \
                _is_last_dim(style.output_layouts[0]):
            column.append(name)
            if isinstance(module, nn.Linear):
                shapes[prefix + "weight"] = (weight[0] // tp, weight[1])
                if module.bias is not None:
                    shapes[prefix + "bias"] = (weight[0] // tp,)
            else:
                shapes[prefix + "weight"] = (weight[0], weight[1] // tp)
        elif isinstance(style, RowwiseParallel) and isinstance(module, nn.Linear) and \
                _is_last_dim(style.input_layouts[0]):
            shapes[prefix + "weight"] = (weight[0], weight[1] // tp)
    return shapes, column


@contextlib.contextmanager
def _module_stack(model: nn.Module, stack: list[str]):
    """``stack`` holds the names of the modules whose forward is running, innermost last."""
    handles = []
    for name, module in model.named_modules():
        def enter(_module, _args, name=name):
            stack.append(name)

        def leave(_module, _args, _output):
            stack.pop()
        # (no leave on an exception: the failing forward stays on the stack)
        handles += [module.register_forward_pre_hook(enter), module.register_forward_hook(leave)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _forward(model: nn.Module, inputs: torch.Tensor, shapes: dict, stack: list) -> None:
    tensors = {name: torch.empty(shapes.get(name, t.shape), dtype=t.dtype, device="meta")
               for name, t in [*model.named_parameters(remove_duplicate=False),
                               *model.named_buffers(remove_duplicate=False)]}
    with _module_stack(model, stack), torch.no_grad():
        torch.func.functional_call(model, tensors, (inputs,), tie_weights=False)


def check_local_shapes(model: nn.Module, plan: dict, tp: int, sample_inputs) -> None:
    """ConfigError when the model's forward fails with one tp rank's shapes (``plan``'s column-
    and row-parallel layers split ``tp`` ways) but not with the whole model's, naming the
    module. ``sample_inputs``: a function giving the first samples' inputs (a tensor; other
    inputs, e.g. a dict of a Hugging Face batch, are not checked)."""
    inputs = sample_inputs() if sample_inputs is not None else None
    shapes, column = local_shapes(model, plan, tp)
    if not column:
        return
    name = type(model).__name__
    if not isinstance(inputs, torch.Tensor):
        skipped("tp shape check", f"{name} was not run with one tp rank's shapes before start "
                f"({'no training sample' if inputs is None else 'its inputs are not a tensor'})")
        return
    inputs, stack = inputs.to("meta"), []
    try:
        _forward(model, inputs, {}, stack)
    except Exception as error:  # noqa: BLE001 - not tp's doing: the run (or another check) says why
        skipped("tp shape check", f"{name}'s forward failed on the meta device "
                f"({type(error).__name__}: {str(error)[:200]}), so it was not run with one tp "
                "rank's shapes before start")
        return
    stack.clear()
    try:
        _forward(model, inputs, shapes, stack)
    except RuntimeError as error:
        where = stack[-1] if stack else ""
        module = model.get_submodule(where)
        inside = [c for c in column if c.startswith(f"{where}.")] if where else column
        layers = ", ".join(inside[:4]) or ", ".join(column[:4])
        raise ConfigError(
            f"tensor parallel (tp={tp}): the forward of {where or 'the model'} "
            f"({type(module).__name__}) fails with the shapes one rank holds: "
            f"{str(error).splitlines()[0]}. Under tp each rank holds 1/{tp} of the heads (the "
            f"output features) of a column-parallel layer ({layers}), so a reshape with the "
            "whole model's head or feature count does not fit there; reshape with the local "
            "count: -1 (q.view(B, T, -1, head_dim)) or q.shape[-1] // head_dim, not a number "
            "or a count from the config") from None
