"""Non-finite loss or gradients: detection and the ``nan_policy`` of the Trainer.

Every rank checks its own loss and the gradients it holds (local shards under FSDP/TP, its
stages under pp) without a host sync; the Trainer then adds one flag per rank to the small
all-reduce it runs each step (:class:`StepFlags`), so every rank learns *which* ranks saw a
non-finite value and takes the same decision:

* ``"error"``: stop with :class:`NonFiniteError` naming the step and the ranks;
* ``"skip"``: drop this step's update on every rank (the batch counts as consumed);
* ``"rollback"``: restore the last checkpoint and replay, skipping the offending batch.

The silent-data-corruption check (``sdc.py``) rides on the same flags (bit 4: a replayed
micro-batch gave other gradients) and the same policy.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist

from meshtrain.errors import ConfigError, MeshtrainError

NAN_POLICIES = ("error", "skip", "rollback")


class NonFiniteError(MeshtrainError, FloatingPointError):
    """A loss or gradient was NaN or infinite and ``nan_policy='error'``."""


class SilentDataCorruption(MeshtrainError, RuntimeError):
    """``sdc_check_every_n_steps``: a rank computed other gradients for the same micro-batch
    the second time, and ``nan_policy='error'``."""


def check_nan_policy(policy: str | None) -> None:
    if policy is not None and policy not in NAN_POLICIES:
        raise ConfigError(
            f"nan_policy must be one of {', '.join(map(repr, NAN_POLICIES))} or None, got "
            f"{policy!r}"
        )


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """The part of a (possibly DTensor) tensor stored on this rank."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


FEW_TENSORS = 16  # up to this many (flattened) gradients are summed one by one


def _flattened(grads: list[torch.Tensor]) -> list[torch.Tensor]:
    """``grads`` as few tensors: gradients that tile a run of one storage with no gap (DDP's
    buckets under ``gradient_as_bucket_view``, a flat parameter's views) as one flat view of
    exactly that run (never the storage's other bytes); any other as it is."""
    runs: dict[tuple, list[torch.Tensor]] = {}
    out = []
    for g in grads:
        if g.is_contiguous():
            runs.setdefault((g.untyped_storage().data_ptr(), g.dtype, g.device), []).append(g)
        else:
            out.append(g)
    for group in runs.values():
        group.sort(key=lambda g: g.storage_offset())
        start = end = group[0].storage_offset()
        for g in group:
            if g.storage_offset() != end:  # a gap or an overlap: each as it is
                out.extend(group)
                break
            end += g.numel()
        else:
            out.append(group[0].as_strided((end - start,), (1,), start) if len(group) > 1
                       else group[0])
    return out


def nonfinite_flag(loss: torch.Tensor, params: Iterable[torch.nn.Parameter],
                   check_grads: bool = True) -> torch.Tensor:
    """A 0-dim int tensor (no host sync): bit 1 set if ``loss`` is NaN/Inf, bit 2 if a local
    gradient is. The loss says where a problem started: data-parallel gradients are averaged,
    so one rank's NaN reaches every rank's gradients. A sum is NaN or infinite when an element
    is (or when finite values overflow float32 together, far beyond any trainable gradient):
    half the work of a norm; few tensors (DDP's flat buckets) are summed one by one, many with
    one fused norm."""
    flag = (~torch.isfinite(_local(loss.detach()).float()).all()).to(torch.int32)
    if check_grads:
        grads = [_local(p.grad) for p in params if p.grad is not None]
        grads = _flattened([g for g in grads if g.numel()])
        if grads:
            totals = ([g.sum(dtype=torch.float32) for g in grads] if len(grads) <= FEW_TENSORS
                      else torch._foreach_norm(grads))
            flag = flag + 2 * (~torch.isfinite(torch.stack(totals)).all()).to(torch.int32)
    return flag


def describe(flags: dict[int, int]) -> str:
    """``{rank: flag}`` of the ranks that saw something -> "non-finite loss on rank(s) [1]
    ...", "silent data corruption on rank(s) [1] ..." or both."""
    loss = [r for r, f in flags.items() if f & 1]
    grads = [r for r, f in flags.items() if f & 2]
    replayed = [r for r, f in flags.items() if f & 4]
    parts = ([f"loss on rank(s) {loss}"] if loss else []) + (
        [f"gradients on rank(s) {grads}"] if grads else [])
    found = ["non-finite " + " and ".join(parts)] if parts else []
    if replayed:
        found.append(f"silent data corruption on rank(s) {replayed} (its first micro-batch, "
                     "computed again, gave other gradients: sdc_check_every_n_steps)")
    return "; ".join(found)


class StepFlags:
    """One small MAX all-reduce per step that makes every rank agree on step-level decisions.

    Slots: one "non-finite" flag per rank, then "a checkpoint is due by time" (rank 0's clock
    decides) and "an async checkpoint is still being written somewhere".
    """

    def __init__(self, rank: int, world_size: int, device: torch.device):
        self.rank, self.world_size = rank, world_size
        self.buffer = torch.zeros(world_size + 2, dtype=torch.int32, device=device)

    def exchange(self, nonfinite: torch.Tensor | None, time_due: bool,
                 write_pending: bool) -> tuple[dict[int, int], bool, bool]:
        """Collective over the world: ({rank: non-finite flag} of the ranks that saw one,
        save due, write pending)."""
        buffer = self.buffer
        buffer.zero_()
        if nonfinite is not None:
            buffer[self.rank] = nonfinite
        buffer[-2] = int(time_due and self.rank == 0)
        buffer[-1] = int(write_pending)
        if self.world_size > 1:
            dist.all_reduce(buffer, op=dist.ReduceOp.MAX)
        values = buffer.tolist()
        bad = {r: values[r] for r in range(self.world_size) if values[r]}
        return bad, bool(values[-2]), bool(values[-1])
