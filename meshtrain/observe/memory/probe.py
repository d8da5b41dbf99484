"""Per-rank model-state memory: what this rank holds, and what the ZeRO formulas predict.

The formulas per ZeRO stage, and how FSDP2 realises each stage:
:mod:`meshtrain.observe.memory.zero_formulas`.

Measurement points: gradients are read from ``p.grad``, which exists from backward until
``zero_grad(set_to_none=True)`` (DDP keeps its gradient bucket allocated even then, but it is no
longer reachable from the parameters), and optimizer state from the first ``step()``: measure
after the first step and before zero_grad. :class:`MemoryProbe` does exactly that with hooks.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from meshtrain.observe.memory.zero_formulas import (
    ModelStateBytes,
    local_tensor as _local,
    optimizer_bytes_per_param,
    predicted_bytes,
    shard_count,
)

__all__ = ["ForwardParamBytes", "MemoryProbe", "MemoryRow", "ModelStateBytes",
           "format_memory_table", "memory_row", "memory_summary", "model_state_bytes",
           "optimizer_bytes_per_param", "predicted_bytes", "shard_count"]

MIB = 2**20


# -- measured -------------------------------------------------------------------------------------
class _StorageSet:
    """Counts the bytes of storages seen for the first time (each storage once)."""

    def __init__(self) -> None:
        self._seen: set[tuple[str, int]] = set()

    def add(self, tensor: torch.Tensor) -> int:
        tensor = _local(tensor)
        if is_traceable_wrapper_subclass(tensor):  # torchao's float8 weights: what they hold
            return sum(self.add(getattr(tensor, name))
                       for name in tensor.__tensor_flatten__()[0])
        storage = tensor.untyped_storage()
        size = storage.nbytes()
        if size == 0:  # e.g. FSDP2's freed (resharded) full parameter
            return 0
        key = (str(storage.device), storage.data_ptr())
        if key in self._seen:
            return 0
        self._seen.add(key)
        return size

    def add_all(self, tensors: Iterable[torch.Tensor]) -> int:
        return sum(self.add(t) for t in tensors)


def _optimizer_states(optimizer: torch.optim.Optimizer) -> list[dict]:
    """Per-parameter state dicts held by this rank, looking inside ZeroRedundancyOptimizer."""
    states = list(optimizer.state.values())
    inner = getattr(optimizer, "optim", None)  # ZeroRedundancyOptimizer: this rank's partition
    if isinstance(inner, torch.optim.Optimizer):
        states += list(inner.state.values())
    return states


def _state_tensors(state) -> Iterable[torch.Tensor]:
    if isinstance(state, torch.Tensor):
        yield state
    elif isinstance(state, dict):
        for value in state.values():
            yield from _state_tensors(value)
    elif isinstance(state, (list, tuple)):
        for value in state:
            yield from _state_tensors(value)


def model_state_bytes(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None
) -> ModelStateBytes:
    """Bytes of model state this rank holds now, counted from the local tensors.

    * parameters: those ``model.parameters()`` yields now. A DTensor counts its local shard.
      Under FSDP2 these are the sharded parameters at rest, and the gathered full parameters of
      modules that are unsharded at the moment (ZeRO-2 between forward and backward; the root's
      own parameters after forward); the sharded master copy behind a gathered parameter is not
      counted then (see the module docstring).
    * gradients: ``p.grad`` of those parameters (None counts nothing).
    * optimizer: every tensor in ``optimizer.state`` (for ZeroRedundancyOptimizer its local
      ``optimizer.optim.state``), including Adam's 4-byte ``step`` counters.

    Bytes are counted per storage, each storage once, at its full allocated size. This is what
    the allocator holds, and it gets three cases right: DDP's ``gradient_as_bucket_view`` makes
    every ``p.grad`` a view into a shared bucket (counted once, not once per view); FSDP2's
    gradients of one module are views into one reduce-scatter output; and FSDP2 pads each
    sharded parameter so that dim 0 divides the mesh (``to_local()`` is an unpadded view of the
    padded storage), so the padding, up to N-1 rows per parameter, is counted. Optimizer state is
    created with ``zeros_like`` of the unpadded local shard and has no padding. Sizes that divide
    N give exactly zero padding.
    """
    seen = _StorageSet()
    params = [p for p in model.parameters()]
    param_bytes = seen.add_all(params)
    grad_bytes = seen.add_all(p.grad for p in params if p.grad is not None)
    opt_bytes = 0
    if optimizer is not None:
        for state in _optimizer_states(optimizer):
            opt_bytes += seen.add_all(_state_tensors(state))
    return ModelStateBytes(param_bytes, grad_bytes, opt_bytes)


class ForwardParamBytes:
    """Parameter bytes right after each forward of ``model``; ``.bytes`` is the largest seen.

    This is the measurement point for ZeRO-2: FSDP2 with ``reshard_after_forward=False`` holds
    the full parameters from forward to the end of backward. Register it after ``fully_shard``
    (so the hook runs after FSDP2's own post-forward hook) and ``remove()`` it when done::

        watch = ForwardParamBytes(model)
        ...  # forward, backward, optimizer.step()
        summary = memory_summary(model, optimizer, layout, forward_params=watch.bytes)
        watch.remove()
    """

    def __init__(self, model: torch.nn.Module):
        self.bytes: int | None = None
        self._model = model
        self._handle = model.register_forward_hook(self._record)

    @torch.compiler.disable(reason="counts storages after the forward: no graph of its own")
    def _record(self, module, args, output) -> None:
        now = _StorageSet().add_all(self._model.parameters())
        self.bytes = now if self.bytes is None else max(self.bytes, now)

    def remove(self) -> None:
        self._handle.remove()


def _num_params(model: torch.nn.Module) -> int:
    """Ψ: this rank's model (its pipeline stages), tensor-parallel shards at their tp-local size
    (TP splits before ZeRO does); DTensor.numel() is the global size, so FSDP2 still counts Ψ."""
    total = 0
    for p in model.parameters():
        n, mesh = p.numel(), getattr(p, "device_mesh", None)
        for i, name in enumerate((mesh.mesh_dim_names or ()) if mesh is not None else ()):
            if name == "tp" and p.placements[i].is_shard():
                n //= mesh.size(i)
        total += n
    return total


# -- reporting ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class MemoryRow:
    """One layout's measured and predicted per-rank bytes (a row of the table)."""

    layout: str
    measured: ModelStateBytes
    predicted: ModelStateBytes
    num_params: int = 0

    @property
    def ratio(self) -> float:
        """Measured total / predicted total."""
        return self.measured.total / self.predicted.total if self.predicted.total else float("nan")


def memory_row(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    layout,
    num_params: int | None = None,
    *,
    forward_params: int | None = None,
) -> MemoryRow:
    """Measure this rank's model state now and predict it for ``layout``.

    Call after an optimizer step and before ``zero_grad`` (so gradients and optimizer state
    exist). ``num_params`` defaults to Ψ counted from ``model``. For ZeRO-2 the parameters are
    taken from ``forward_params`` (a :class:`ForwardParamBytes` reading) when given.
    """
    measured = model_state_bytes(model, optimizer)
    if layout.zero_stage == 2 and forward_params is not None:
        measured = ModelStateBytes(forward_params, measured.grads, measured.optimizer)
    first = next(model.parameters())
    num_params = _num_params(model) if num_params is None else num_params
    sizes = dict(bytes_per_param=first.element_size(), bytes_per_grad=first.element_size(),
                 optimizer_bytes_per_param=optimizer_bytes_per_param(optimizer))
    # under ep this rank's experts (E / ep of them): sharded by ZeRO over the edp ranks
    # holding the same ones under zero2/3 (whole here when edp is one rank, or under dp)
    from meshtrain.parallel.expert import expert_params

    experts = sum(p.numel() for p in expert_params(model))
    predicted = predicted_bytes(num_params - experts, layout.zero_stage, shard_count(layout),
                                **sizes)
    if experts:
        edp = layout.world_size // layout.degree("pp") // layout.degree("tp") // \
            layout.expert_degree
        sharded = layout.is_sharded and edp > 1
        alone = predicted_bytes(experts, layout.zero_stage if sharded else 0,
                                edp if sharded else 1, **sizes)
        predicted = ModelStateBytes(predicted.params + alone.params,
                                    predicted.grads + alone.grads,
                                    predicted.optimizer + alone.optimizer)
    return MemoryRow(str(layout), measured, predicted, num_params)


def format_memory_table(rows: Iterable[MemoryRow]) -> str:
    """An aligned text table of rows, sizes in MiB."""
    header = ("layout", "params", "grads", "optimizer", "total", "predicted", "ratio")
    lines = [header]
    for row in rows:
        m = row.measured
        lines.append((
            row.layout, *(f"{b / MIB:.2f}" for b in (m.params, m.grads, m.optimizer, m.total)),
            f"{row.predicted.total / MIB:.2f}", f"{row.ratio:.3f}",
        ))
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    text = [
        "  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in
                  enumerate(zip(line, widths)))
        for line in lines
    ]
    text.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(text)


def memory_summary(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    layout,
    num_params: int | None = None,
    *,
    forward_params: int | None = None,
) -> str:
    """This rank's model-state memory against the ZeRO formula for ``layout``, as text (MiB).

    Call after the first optimizer step and before ``zero_grad``; see :func:`memory_row`.
    """
    return _summary_text(
        memory_row(model, optimizer, layout, num_params, forward_params=forward_params), layout,
        forward_params is not None,
    )


def _summary_text(row: MemoryRow, layout, have_forward: bool) -> str:
    n = shard_count(layout)
    sharding = f"sharded over N = {n}" if layout.zero_stage else "replicated"
    text = (f"model state on this rank (MiB): {_fmt_count(row.num_params)} parameters, ZeRO "
            f"stage {layout.zero_stage} ({sharding})\n" + format_memory_table([row]))
    if layout.zero_stage == 2 and n > 1 and not have_forward:
        text += ("\nnote: ZeRO-2 parameters were measured after the step (resharded, 1/N); the "
                 "formula's full size holds between forward and backward (ForwardParamBytes)")
    return text


class MemoryProbe:
    """Measures model state once, right after the first optimizer step.

    Hooks do the timing, so the training loop needs no change: a forward hook records the
    parameters after forward (the ZeRO-2 measurement point) and an optimizer step post-hook
    measures everything after the step, before ``zero_grad`` can free the gradients. Create it
    after the model is parallelized and the optimizer built; read :attr:`row` or
    :meth:`summary` after the first step (``None`` before). The forward hook goes after the
    measurement; the step hook (a no-op from then on) goes with :meth:`summary` or
    :meth:`remove`, because removing it from inside the optimizer's own hook loop breaks that
    loop ("OrderedDict mutated during iteration").
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, layout,
                 num_params: int | None = None):
        self.model, self.optimizer, self.layout = model, optimizer, layout
        self.num_params = _num_params(model) if num_params is None else num_params
        self.row: MemoryRow | None = None
        self.allocator: dict[str, int] | None = None  # on a GPU: the CUDA allocator's figures
        self._forward = ForwardParamBytes(model)
        self._step_hook = optimizer.register_step_post_hook(self._after_step)

    def _after_step(self, optimizer, args, kwargs) -> None:
        if self.row is not None:
            return
        self.row = memory_row(self.model, self.optimizer, self.layout, self.num_params,
                              forward_params=self._forward.bytes)
        self.allocator = allocator_bytes(self.model)
        self._forward.remove()

    def summary(self) -> str | None:
        """The table of :func:`memory_summary` (and the hooks removed), or None before the
        first step."""
        if self.row is None:
            return None
        self.remove()
        text = _summary_text(self.row, self.layout, self._forward.bytes is not None)
        if self.allocator is not None:
            mib = {k: v / 2**20 for k, v in self.allocator.items()}
            text += (f"\nCUDA allocator after step 1 (MiB): allocated {mib['allocated']:.2f}, "
                     f"peak allocated {mib['peak_allocated']:.2f}, reserved "
                     f"{mib['reserved']:.2f} (model state plus activations, buffers and "
                     "communication)")
        return text

    def remove(self) -> None:
        self._forward.remove()
        self._step_hook.remove()


def allocator_bytes(model: torch.nn.Module) -> dict[str, int] | None:
    """The CUDA caching allocator's view of the device ``model`` is on: bytes allocated now, at
    the peak so far, and reserved from the driver; None off CUDA."""
    param = next(model.parameters(), None)
    if param is None or param.device.type != "cuda":
        return None
    device = param.device
    return {"allocated": torch.cuda.memory_allocated(device),
            "peak_allocated": torch.cuda.max_memory_allocated(device),
            "reserved": torch.cuda.memory_reserved(device)}


def _fmt_count(n: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= size:
            return f"{n / size:.2f}{unit}"
    return str(n)
