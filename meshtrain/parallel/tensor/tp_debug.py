"""Seeing whether tensor parallel computes what one process computes: the first steps' check
that parameters replicated over the tp ranks got the same gradient on each, and that modules
declared to see split activations saw them; a plain answer for a forward that mixes plain
tensors with DTensors, and counts of the collectives a step issues.

Why the check: a plan can be wrong and still run. A module left whole (replicated) inside a
split region sees only this rank's part of the activations (a per-head norm after a
column-parallel projection, a LayerNorm between a column- and a row-parallel layer), so its
gradient is a partial sum that nobody adds up; training goes on, slightly wrong. Every rank of a
tp group must hold the same gradient for a replicated parameter once meshtrain's own reductions
ran, so a few numbers per parameter (sums with fixed weights), compared over the tp group with
one all-reduce, tell a wrong plan at the first step, naming the parameter.

The opposite mistake leaves the gradients equal, so that check cannot see it: a module declared
to see this rank's part of split activations (``ReplicateParallel(local_input=True)``: its
gradient is summed over the tp ranks) that really sees whole ones gets tp times its gradient on
every rank. So such a module fingerprints its inputs in the first steps, and the same all-reduce
tells whether they were the same on every rank.
"""

from __future__ import annotations

import contextlib
import warnings
from collections import defaultdict

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate

from meshtrain.errors import ConfigError

#: relative difference between tp ranks above which a replicated gradient is wrong: the ranks
#: compute the same numbers (or receive one all-reduce's result), so rounding shows far below
RTOL = 1e-4


def replicated_over_tp(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """(name, parameter) of every trainable parameter that is whole on each rank of the ``tp``
    mesh dimension (a DTensor whose placement on "tp" is ``Replicate``; FSDP2 may shard it over
    the data-parallel dimensions)."""
    found = []
    for name, param in model.named_parameters():
        if not (isinstance(param, DTensor) and param.requires_grad):
            continue
        dims = param.device_mesh.mesh_dim_names or ()
        if "tp" in dims and isinstance(param.placements[dims.index("tp")], Replicate):
            found.append((name, param))
    return found


def _fingerprints(grads: list[torch.Tensor | None]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per gradient (or input): three weighted sums (float64) and the scale each is judged
    against."""
    stats, scales = [], []
    for grad in grads:
        g = torch.zeros(1, dtype=torch.float64) if grad is None else \
            grad.detach().reshape(-1).to(torch.float64)
        ramp = torch.linspace(-1.0, 1.0, g.numel(), dtype=torch.float64, device=g.device)
        absolute, square = g.abs().sum(), (g * g).sum()
        stats.append(torch.stack([(g * ramp).sum(), (g * ramp.cos()).sum(), square]))
        scales.append(torch.stack([absolute, absolute, square]))
    return torch.stack(stats), torch.stack(scales)


class InputFingerprints:
    """A module's inputs in the first steps, as fixed-weight sums (see :func:`_fingerprints`)."""

    def __init__(self):
        self.stats = self.scales = None

    def add(self, tensor: torch.Tensor) -> None:
        stats, scales = _fingerprints([tensor.detach().to_local() if isinstance(tensor, DTensor)
                                       else tensor.detach()])
        self.stats = stats if self.stats is None else self.stats + stats
        self.scales = scales if self.scales is None else self.scales + scales


def check_split_inputs(model: nn.Module, tp_group, *, step: int = 1, last: bool = True) -> None:
    """Raise ``ConfigError`` on every rank when a module declared to see split activations
    (``ReplicateParallel(local_input=True)``) received the same inputs on every tp rank since
    the last check (one all-reduce over ``tp_group``); ``last``: stop fingerprinting."""
    modules = [(name, m) for name, m in model.named_modules()
               if getattr(m, "_tp_split_inputs", None) is not None]
    if not modules:
        return
    none = torch.zeros(1, 3, dtype=torch.float64)
    seen = [m._tp_split_inputs for _, m in modules]
    stats = torch.cat([none if s.stats is None else s.stats.cpu() for s in seen])
    scales = torch.cat([none if s.scales is None else s.scales.cpu() for s in seen])
    for _, module in modules:
        module._tp_split_inputs = InputFingerprints()
    if last:
        stop_watching(model)
    both = torch.cat([stats, -stats]).to(next(model.parameters()).device)
    torch.distributed.all_reduce(both, op=torch.distributed.ReduceOp.MAX, group=tp_group)
    high, low = both.cpu().chunk(2)
    spread = ((high + low) / scales.clamp(min=torch.finfo(torch.float64).tiny)).amax(1)
    whole = [name for (name, _), s, scale in zip(modules, spread, scales.amax(1))
             if scale > 0 and float(s) <= 1e-12]
    if whole:
        size = torch.distributed.get_world_size(tp_group)
        raise ConfigError(
            f"tensor parallel: in step {step} {whole[0]}"
            f"{f' (and {len(whole) - 1} more: ' + ', '.join(whole[1:4]) + ')' if len(whole) > 1 else ''}"
            " received the same input on every tp rank, but its plan entry, "
            "ReplicateParallel(local_input=True), says it sees this rank's part of split "
            f"activations and sums its gradient over the tp ranks: it would train with {size}x "
            "its gradient on every rank. Give it ReplicateParallel() (a module that sees whole "
            "activations, e.g. a norm on the residual stream), or leave it out of the plan; "
            "then check the plan with meshtrain parity. (tp_check_steps=0 turns this check off.)")


def watch_split_inputs(model: nn.Module) -> None:
    """Fingerprint the inputs of every module declared to see split activations
    (``_tp_split_input``, set by tensor_parallel.run_on_local_params) until
    :func:`stop_watching`."""
    for module in model.modules():
        if getattr(module, "_tp_split_input", False) and "_tp_watch" not in module.__dict__:
            module._tp_split_inputs = InputFingerprints()
            module.__dict__["_tp_watch"] = module.register_forward_pre_hook(_record_input)


@torch.compiler.disable(reason="the tp check's bookkeeping, the first steps only")
def _record_input(module: nn.Module, args) -> None:
    """Outside torch.compile's graphs, and not in a forward recomputed inside the backward
    (activation checkpointing): a compiled block's graph would otherwise hold the running sum's
    first-call branch, and its recompute another (torch 2.13: "Recomputed values ... have
    different metadata"); the recompute sees the same input again anyway."""
    if torch._C._current_graph_task_id() != -1:
        return
    seen = getattr(module, "_tp_split_inputs", None)
    if seen is not None and args and isinstance(args[0], torch.Tensor):
        seen.add(args[0])


def stop_watching(model: nn.Module) -> None:
    """No more input fingerprints (the checks are over)."""
    for module in model.modules():
        handle = module.__dict__.pop("_tp_watch", None)
        if handle is not None:
            handle.remove()
            module._tp_split_inputs = None


def check_replicated_grads(model: nn.Module, tp_group, *, step: int = 1) -> None:
    """Raise ``ConfigError`` on every rank when a parameter replicated over the tp ranks holds
    different gradients on them (call after the step's gradients are complete). One all-reduce
    of 6 numbers per such parameter over ``tp_group``."""
    params = replicated_over_tp(model)
    if not params:
        return
    grads = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for _, p in params]
    stats, scales = _fingerprints(grads)
    both = torch.cat([stats, -stats]).to(params[0][1].device)
    torch.distributed.all_reduce(both, op=torch.distributed.ReduceOp.MAX, group=tp_group)
    high, low = both.cpu().chunk(2)
    spread = (high + low) / scales.clamp(min=torch.finfo(torch.float64).tiny)
    bad = [(float(spread[i].max()), params[i][0]) for i in range(len(params))
           if float(spread[i].max()) > RTOL]
    if bad:
        bad.sort(reverse=True)
        worst, name = bad[0]
        more = f" (and {len(bad) - 1} more: {', '.join(n for _, n in bad[1:4])}" \
               f"{', ...' if len(bad) > 4 else ''})" if len(bad) > 1 else ""
        raise ConfigError(
            f"tensor parallel: after step {step}'s backward the gradient of {name}, a parameter "
            f"replicated over the tp ranks, differs between them (relative {worst:.2g}){more}. "
            "Its module runs on a different part of the activations on each rank (e.g. a norm "
            "over per-head values after a column-parallel projection, or a layer between a "
            "column- and a row-parallel one), so each rank's gradient is only its share and "
            "training would silently differ from one process. Fix the tensor-parallel plan: "
            "split the module like its input, or give it ReplicateParallel(local_input=True) "
            "(meshtrain.parallel.tensor.tensor_parallel; transformers calls it "
            "'replicated_with_grad_allreduce'), which sums the shares; then check the plan with "
            "meshtrain parity. (tp_check_steps=0 turns this check off.)")


@contextlib.contextmanager
def mixed_tensor_hint(enabled: bool = True):
    """Turn torch's "got mixed torch.Tensor and DTensor" inside the forward into a
    ``ConfigError`` that says what to change."""
    try:
        yield
    except RuntimeError as error:
        if not (enabled and "mixed torch.Tensor and DTensor" in str(error)):
            raise
        raise ConfigError(
            "tensor parallel: the model's forward combined a plain tensor with a DTensor "
            f"({str(error).splitlines()[0]}). Under tp every parameter is a DTensor, and a "
            "module's parameters are meant to be used by calling the module: a forward that "
            "reads another module's parameter directly (x + self.pos.weight[:n]) mixes the two. "
            "Call the module instead (self.pos(positions)), or keep the parameter on the module "
            "that uses it (a parameter held by the module whose forward reads it is handled)"
        ) from error


# --- Counting communication --------------------------------------------------------------------
def _collective_name(op) -> str:
    """DTensor's functional collectives by kind; direct c10d calls (FSDP2, DDP) as c10d.<op>."""
    namespace, _, name = str(op).rpartition(".")
    name = name.strip("_")
    if not namespace.endswith("c10d_functional"):
        return f"c10d.{name}"
    for short in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast"):
        if name.startswith(short):
            return short
    return name


def comm_counts(model: nn.Module, batch, loss_fn, *, loss_parallel: bool = False) -> dict[str, int]:
    """Collectives this rank issues in one forward + backward of ``batch = (inputs, targets)``.

    Counted with DTensor's ``CommDebugMode``, by kind, as ``"forward/<kind>"`` (forward and
    loss), ``"backward/<kind>"`` and the total ``"<kind>"``. TP's collectives are ``all_reduce``,
    ``all_gather``, ``reduce_scatter``; those FSDP2 or DDP call directly appear as ``c10d.<op>``
    (FSDP2: ``c10d.allgather_base``, ``c10d.reduce_scatter_base``). The optimizer step is not
    included (it needs none after TP). Gradients are left in ``.grad``.
    """
    from torch.distributed.tensor.debug import CommDebugMode

    from meshtrain.parallel.tensor.tensor_parallel import loss_parallel_context

    inputs, targets = batch
    with loss_parallel_context(loss_parallel), warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Full backward hook is firing")  # CommDebugMode's
        with CommDebugMode() as forward:
            loss = loss_fn(model(inputs), targets)
        with CommDebugMode() as backward:
            loss.backward()
    result: dict[str, int] = defaultdict(int)
    for phase, mode in (("forward", forward), ("backward", backward)):
        for op, n in mode.get_comm_counts().items():
            result[f"{phase}/{_collective_name(op)}"] += n
            result[_collective_name(op)] += n
    return dict(result)
