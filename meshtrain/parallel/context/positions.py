"""What in a model's forward depends on a token's position, as context parallel sees it from a
``TorchFunctionMode`` (sdpa.py): each rank runs the model on its zig-zag share of the sequence,
``n`` tokens whose global positions are not ``0 .. n-1``.

- ``torch.arange(n)`` (start 0, step 1, for the local length) gives this rank's global
  positions (a rotary angle or a learned embedding computed from them is read right);
- a slice ``[:n]`` along one dimension of a **table** gives the table's rows at those positions
  (``index_select``: its gradient goes to them). A table is a parameter or buffer of the model,
  a tensor kept as a module's attribute (``self.cos = ...``, as Meta's Llama keeps
  ``freqs_cis``), or what ``.to()`` / a dtype cast of one gives during the forward;
- a slice ``[:n]`` of any other tensor longer than ``n`` (a table the forward builds for itself)
  cannot be read at other positions by meshtrain: :meth:`Positions.untracked` says so, and the
  model is refused before start (the probe runs the forward at the local length) with the fix:
  keep the table as a buffer or an attribute, or build it from ``torch.arange(n)``.
"""

from __future__ import annotations

import torch
import torch.nn as nn

_CASTS = {torch.Tensor.to, torch.Tensor.type, torch.Tensor.float, torch.Tensor.double,
          torch.Tensor.half, torch.Tensor.bfloat16, torch.Tensor.cuda, torch.Tensor.cpu,
          torch.Tensor.contiguous, torch.Tensor.detach}


class Positions:
    """The position-dependent calls of one forward of ``model`` on ``local_len`` tokens."""

    def __init__(self, model: nn.Module):
        self.model, self.local_len = model, None
        self._tables: set[int] = set()
        self._kept: list[torch.Tensor] = []  # (casts of tables, alive so their ids stay theirs)

    def start(self, local_len: int | None) -> None:
        """A forward begins: the tables are the model's buffers and tensor attributes now."""
        self.local_len, self._kept = local_len, []
        self._tables = {id(b) for b in self.model.buffers()}
        for module in self.model.modules():
            self._tables.update(id(v) for v in vars(module).values()
                                if isinstance(v, torch.Tensor) and not isinstance(v, nn.Parameter))

    def is_table(self, tensor) -> bool:
        return isinstance(tensor, nn.Parameter) or id(tensor) in self._tables

    def track(self, func, args, result) -> None:
        """A cast or move of a table is a table too (``self.freqs = self.freqs.to(device)``)."""
        if func in _CASTS and args and self.is_table(args[0]) \
                and isinstance(result, torch.Tensor) and not self.is_table(result):
            self._tables.add(id(result))
            self._kept.append(result)

    def is_local_range(self, args, kwargs) -> bool:
        """``torch.arange(n)`` / ``torch.arange(0, n)`` for the local length ``n``."""
        if self.local_len is None or kwargs.get("step") not in (None, 1) \
                or kwargs.get("start") not in (None, 0):
            return False
        ends = [a for a in args if not isinstance(a, torch.Tensor)]
        return (ends == [self.local_len] or ends == [0, self.local_len]) and len(args) <= 2

    def cut(self, tensor, index) -> int | None:
        """The dimension ``tensor[index]`` cuts to ``[:n]`` (nothing else), where ``tensor``
        is a table at least ``n`` long there or any tensor longer than ``n``; else None."""
        if self.local_len is None or not isinstance(tensor, torch.Tensor):
            return None
        index = index if isinstance(index, tuple) else (index,)
        if index and index[0] is Ellipsis:  # (``t[..., :n]``: dimensions from the end)
            index = (slice(None),) * (tensor.dim() - len(index) + 1) + index[1:]
        n = self.local_len
        cuts = [d for d, i in enumerate(index) if isinstance(i, slice) and i.start in (None, 0)
                and isinstance(i.stop, int) and i.stop == n and i.step in (None, 1)]
        whole = [d for d, i in enumerate(index) if isinstance(i, slice) and i == slice(None)]
        if len(cuts) != 1 or len(cuts) + len(whole) != len(index) or cuts[0] >= tensor.dim():
            return None
        size = tensor.size(cuts[0])
        return cuts[0] if size > n or (size == n and self.is_table(tensor)) else None

    def untracked(self, model_name: str, tensor: torch.Tensor, dim: int) -> str:
        """Why ``tensor[..., :n]`` (not a table) cannot be split, and the fix."""
        return (f"{model_name}'s forward cuts a tensor of length {tensor.size(dim)} to the "
                f"sequence's length ({self.local_len} tokens on each cp rank) along dimension "
                f"{dim}, and that tensor is neither a parameter or buffer of the model nor a "
                "tensor kept as a module's attribute: under cp a rank's tokens are not the "
                f"first {self.local_len} positions, and meshtrain reads them at their own only "
                "from a table it can see. Keep the table as a buffer "
                "(self.register_buffer('table', table, persistent=False)) or as an attribute "
                "set in __init__, or compute it from torch.arange(seq_len); or drop cp")
