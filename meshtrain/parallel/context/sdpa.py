"""Context parallel for a model of your own whose attention calls
``F.scaled_dot_product_attention`` or is ``nn.MultiheadAttention``, without changes to its code.

Each rank runs the model on its zig-zag share of every sequence (context_parallel.py). What in
its forward depends on the whole sequence is seen through a ``TorchFunctionMode`` active while
the model runs:

- ``F.scaled_dot_product_attention(q, k, v, is_causal=True)`` becomes
  :func:`~meshtrain.parallel.context.context_parallel.cp_attention`: this rank's queries over
  every rank's keys and values (grouped-query attention, ``enable_gqa``, included);
  ``nn.MultiheadAttention``'s causal self-attention likewise (mha.py: the mode cannot see the
  SDPA call inside it, so it computes the whole call);
- positions (positions.py): ``torch.arange(n)`` for the local length ``n``, and a slice
  ``[:n]`` along a dimension of a table (a parameter, a buffer or a tensor attribute of a
  module: ``self.pos[:T]``, ``self.freqs[:, :T]``, ``self.cos[:T]``) give the global positions
  of this rank's tokens instead (``local_positions``), so a learned or rotary position table is
  read at the right rows, and its gradient goes to them; the same slice of a tensor the forward
  builds for itself is refused (meshtrain cannot see that it is a table).

A block that activation checkpointing recomputes in the backward runs outside the model's
forward; the mode is entered around it again (hooks on the model's inner modules).

Before any process starts the forward runs once on the meta device on one rank's share of a
training sample (:meth:`SDPAContextParallel.check_context_parallel`): a model whose forward
calls no SDPA is refused (meshtrain cannot see its attention: it needs
``enable_context_parallel``), and so is an SDPA call that is not causal or passes a mask (what
``cp_attention`` would not compute; an ALiBi-style bias is such a mask), an
``nn.MultiheadAttention`` call mha.py cannot split (cross-attention, attention weights, a padding
mask), and a position table meshtrain cannot see. A forward that fails there is not judged:
the start says that this check was skipped, and why (meshtrain/check_skips.py).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from meshtrain.check_skips import skipped
from meshtrain.errors import ConfigError
from meshtrain.parallel.context import mha
from meshtrain.parallel.context.positions import Positions

_SDPA = F.scaled_dot_product_attention
_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale",
              "enable_gqa")


def _sdpa_args(args, kwargs) -> dict:
    return {**dict(zip(_SDPA_ARGS, args)), **kwargs}


def _refusal(name: str, call: dict) -> str | None:
    if call.get("attn_mask") is not None:
        return (f"{name} calls F.scaled_dot_product_attention with an attn_mask, which "
                "meshtrain's context parallel does not split (it computes causal attention over "
                "every rank's keys); use is_causal=True without a mask, or drop cp")
    if not call.get("is_causal", False):
        return (f"{name} calls F.scaled_dot_product_attention without is_causal=True; "
                "meshtrain's context parallel computes causal attention only; drop cp")
    return None


class _Probe(TorchFunctionMode):
    """Records the attention calls of one forward on one rank's share: SDPA's and
    ``nn.MultiheadAttention``'s (as ``("mha", arguments)``; its inner SDPA call is not seen,
    see mha.py), and refusals of position tables meshtrain cannot see (``untracked``)."""

    def __init__(self, model: nn.Module, local_len: int):
        super().__init__()
        self.calls: list = []
        self.untracked: list[str] = []
        self.positions = Positions(model)
        self.positions.start(local_len)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _SDPA:
            self.calls.append(_sdpa_args(args, kwargs))
        elif func is mha.MHA:
            self.calls.append(("mha", mha.mha_args(args, kwargs)))
        elif func is torch.Tensor.__getitem__ and len(args) == 2:
            dim = self.positions.cut(*args)
            if dim is not None and not self.positions.is_table(args[0]):
                self.untracked.append(self.positions.untracked(
                    type(self.positions.model).__name__, args[0], dim))
        result = func(*args, **kwargs)
        self.positions.track(func, args, result)
        return result


class _ContextParallelMode(TorchFunctionMode):
    """While the model runs on this rank's share: SDPA over the cp group, positions global."""

    def __init__(self, model: nn.Module, cp_mesh):
        super().__init__()
        self.model, self.cp_mesh = model, cp_mesh
        self.tables = Positions(model)  # (started by each forward with its local length)
        self.active = False
        self.reentered: list[nn.Module] = []  # blocks recomputed in the backward (see below)

    def __enter__(self):
        self.active = True
        return super().__enter__()

    def __exit__(self, *exc):
        self.active = False
        return super().__exit__(*exc)

    def positions(self, device=None) -> torch.Tensor:
        from meshtrain.parallel.context.context_parallel import local_positions

        return local_positions(self.tables.local_len, self.cp_mesh.get_local_rank(),
                               self.cp_mesh.size(), device=device)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _SDPA:
            from meshtrain.parallel.context.context_parallel import cp_attention

            call = _sdpa_args(args, kwargs)
            refusal = _refusal(type(self.model).__name__, call)
            if refusal is not None:
                raise ConfigError(refusal)
            q, k, v = call["query"], call["key"], call["value"]
            return cp_attention(q, k, v, self.cp_mesh, dropout_p=call.get("dropout_p", 0.0),
                                scale=call.get("scale"), kv_groups=q.size(-3) // k.size(-3))
        if func is mha.MHA:
            from meshtrain.parallel.context.context_parallel import cp_attention

            call = mha.mha_args(args, kwargs)
            refusal = mha.refusal(type(self.model).__name__, call)
            if refusal is not None:
                raise ConfigError(refusal)
            return mha.forward(call, lambda q, k, v, dropout_p: cp_attention(
                q, k, v, self.cp_mesh, dropout_p=dropout_p))
        if func is torch.arange and self.tables.is_local_range(args, kwargs):
            positions = self.positions(kwargs.get("device"))
            return positions.to(kwargs["dtype"]) if kwargs.get("dtype") else positions
        if func is torch.Tensor.__getitem__ and len(args) == 2:
            dim = self.tables.cut(*args)
            if dim is not None and self.tables.is_table(args[0]):
                return args[0].index_select(dim, self.positions(args[0].device))
            if dim is not None:  # (refused before start: the probe saw the same cut)
                raise ConfigError(self.tables.untracked(type(self.model).__name__, args[0], dim))
        result = func(*args, **kwargs)
        self.tables.track(func, args, result)
        return result


def _sequence_length(args, kwargs) -> int | None:
    first = next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)), None)
    return first.size(1) if first is not None and first.dim() >= 2 else None


class SDPAContextParallel:
    """What makes ``model`` context parallel when it brings nothing of its own (see the
    module's doc)."""

    def __init__(self, model: nn.Module):
        self.model = model

    def check_context_parallel(self, cp_degree: int, sample_inputs=None) -> None:
        from meshtrain.parallel.context.context_parallel import check_cp

        name = type(self.model).__name__
        if sample_inputs is None:  # (checked before the processes started, on a sample)
            skipped("context-parallel check", f"no training sample to run {name} on before "
                    "start (its attention and position tables are seen at the first step)")
            return
        inputs = sample_inputs()
        if not isinstance(inputs, torch.Tensor):
            raise ConfigError(
                f"{name} has no enable_context_parallel(cp_mesh), and meshtrain finds the "
                "attention of a model of your own by running it once on a training sample, "
                "which needs (inputs, targets) samples whose inputs are a tensor; give the model "
                "enable_context_parallel (see meshtrain.models.gpt), or drop cp")
        check_cp(inputs.size(1), cp_degree)
        local = inputs[:, :inputs.size(1) // cp_degree]  # (one rank's share: its length)
        probe = _Probe(self.model, local.size(1))
        device = next(self.model.parameters()).device  # (a meta copy: new tensors there too)
        try:
            with torch.no_grad(), torch.device(device), probe:
                self.model(local.to(device))
        except Exception as error:  # noqa: BLE001 - not cp's to report (the first step says why)
            skipped("context-parallel check", f"{name}'s forward failed on one rank's share of "
                    f"a training sample on the meta device ({type(error).__name__}: "
                    f"{str(error)[:200]}); its attention and position tables are not checked "
                    "before start")
            return
        if probe.untracked:
            raise ConfigError(probe.untracked[0])
        if not probe.calls:
            raise ConfigError(
                f"{name} does not support context parallel (cp): its forward calls no "
                "F.scaled_dot_product_attention and no nn.MultiheadAttention (meshtrain splits "
                "the attention it can see) and it has no enable_context_parallel(cp_mesh); use "
                "SDPA with is_causal=True, add enable_context_parallel (see "
                "meshtrain.models.gpt), or drop cp")
        for call in probe.calls:
            if isinstance(call, tuple):
                refusal = mha.refusal(name, call[1])
            else:
                refusal = _refusal(name, call)
            if refusal is not None:
                raise ConfigError(refusal)

    def enable_context_parallel(self, cp_mesh) -> None:
        mode = _ContextParallelMode(self.model, cp_mesh)

        def enter(module, args, kwargs):
            mode.tables.start(_sequence_length(args, kwargs))
            mode.__enter__()

        def leave(module, args, kwargs, output):
            mode.__exit__(None, None, None)
            return output

        self.model.register_forward_pre_hook(enter, with_kwargs=True)
        self.model.register_forward_hook(leave, with_kwargs=True, always_call=True)

        # a block that activation checkpointing recomputes runs again in the backward, outside
        # the model's forward: the mode is entered around it again (local_len as last set)
        def enter_again(module, args, kwargs):
            if not mode.active:
                mode.reentered.append(module)
                mode.__enter__()

        def leave_again(module, args, kwargs, output):
            if mode.reentered and mode.reentered[-1] is module:
                mode.reentered.pop()
                mode.__exit__(None, None, None)
            return output

        for module in self.model.modules():
            if module is not self.model and next(module.children(), None) is not None:
                module.register_forward_pre_hook(enter_again, with_kwargs=True)
                module.register_forward_hook(leave_again, with_kwargs=True, always_call=True)
