"""The check that a model built on the meta device starts, under its layout, from the values one
process draws: the ranks' parts of every tensor put together are the whole tensor its
initializer drew.

Every initializer meshtrain runs on a materialised model (``HFCausalLM``'s module-by-module
init, meshtrain's GPT ``init_weights``, a user's ``init_weights`` that uses
:func:`~meshtrain.parallel.data.meta_init.copy_full_into`) hands ``copy_full_into`` the whole
tensor and lets it keep this rank's part. While :func:`recording`, each such call notes an
exact fingerprint of the whole tensor (:func:`whole_fingerprint`: the sum of its elements'
bits read as integers, which does not depend on how the tensor is cut or in which order it is
summed). :func:`check_initial_values` then adds up, over every rank, the fingerprints of the
distinct parts the ranks hold (a DTensor's shard, an expert holder's rows under ``ep``;
replicas counted once) and compares each tensor's total with the fingerprint its initializer
noted, and the ranks' notes with each other. A part drawn at the wrong shape or from another
seed (a rank's init perturbed, the experts of one ep rank drawn as if they were all of them)
leaves a total that differs: the run stops before its first step, naming the tensors.
One ``all_gather_object`` over the job at set-up; nothing on a training step's path.
"""

from __future__ import annotations

import contextlib
import contextvars

import torch
import torch.distributed as dist

from meshtrain.errors import MeshtrainError

_WORDS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int32}
_MOD = 2**64
_CHUNK = 2**20
_RECORD: contextvars.ContextVar[dict | None] = contextvars.ContextVar("meshtrain_init_record",
                                                                      default=None)


class InitialValuesDiffer(MeshtrainError, RuntimeError):
    """The ranks' parts of a tensor are not the whole tensor its initializer drew."""


def whole_fingerprint(values: torch.Tensor) -> int:
    """The sum (mod 2**64) of ``values``' elements' bits read as integers, one or two words an
    element: exact, and the same for any split of the tensor into parts at element boundaries."""
    data = values.detach().contiguous().flatten()
    if not data.numel() or data.is_complex():
        return 0
    words = data.view(torch.uint8) if data.dtype == torch.bool else data
    words = words.view(_WORDS[words.element_size()])
    total = torch.zeros((), dtype=torch.int64, device=words.device)
    for chunk in words.split(_CHUNK):  # (summed as int64 a chunk at a time: no whole copy)
        total += chunk.sum(dtype=torch.int64)
    return int(total.item()) % _MOD


@contextlib.contextmanager
def recording():
    """Note the whole tensors handed to ``copy_full_into`` inside the block: yields
    ``{id(tensor): (tensor, fingerprint)}``."""
    notes: dict = {}
    token = _RECORD.set(notes)
    try:
        yield notes
    finally:
        _RECORD.reset(token)


def note_whole(tensor: torch.Tensor, values: torch.Tensor) -> None:
    """``values`` is the whole of ``tensor`` (in its dtype once copied): noted while
    :func:`recording` (else nothing)."""
    notes = _RECORD.get()
    if notes is not None:
        notes[id(tensor)] = (tensor, whole_fingerprint(values.to(tensor.dtype)))


def _part(tensor: torch.Tensor, rows: slice | None) -> tuple[tuple, int]:
    """(which part of the whole tensor this rank holds, that part's fingerprint): a DTensor's
    coordinates on the mesh dimensions that shard it (replicas share them), the expert rows
    ``ep`` kept."""
    from torch.distributed.tensor import DTensor

    local, where = tensor, ()
    if isinstance(tensor, DTensor):  # (any placement but Replicate cuts: Shard, _StridedShard)
        coords = tensor.device_mesh.get_coordinate() or ()
        where = tuple((dim, coords[dim]) for dim, p in enumerate(tensor.placements)
                      if not p.is_replicate())
        local = tensor.to_local()
    if rows is not None:
        where = (("rows", rows.start), *where)
    return where, whole_fingerprint(local)


def check_initial_values(modules: list[torch.nn.Module], notes: dict, group,
                         skip=()) -> int:
    """Collective over ``group`` (every rank of the job; None: this process alone): raise
    :class:`InitialValuesDiffer` unless every noted tensor's parts, over the ranks, add up to
    the whole its initializer drew on every rank (a tensor of a name in ``skip`` left out).
    Returns the number of tensors checked."""
    mine: dict[str, tuple] = {}
    for module in modules:
        for holder_name, holder in module.named_modules():
            rows = getattr(holder, "rows", None)
            own = {**holder._parameters, **holder._buffers}
            for name, tensor in own.items():
                full = f"{holder_name}.{name}" if holder_name else name
                if tensor is None or id(tensor) not in notes or full in skip:
                    continue
                where, part = _part(tensor, rows if isinstance(rows, slice) else None)
                mine[full] = (notes[id(tensor)][1], where, part)
    everyone = [mine]
    if group is not None and dist.get_world_size(group) > 1:
        everyone = [None] * dist.get_world_size(group)
        dist.all_gather_object(everyone, mine, group=group)
    wholes: dict[str, dict[int, list[int]]] = {}
    parts: dict[str, dict[tuple, set[int]]] = {}
    for who, theirs in enumerate(everyone):
        for name, (whole, where, part) in theirs.items():
            wholes.setdefault(name, {}).setdefault(whole, []).append(who)
            parts.setdefault(name, {}).setdefault(where, set()).add(part)
    wrong = []
    for name, drawn in wholes.items():
        total = sum(min(held) for held in parts[name].values()) % _MOD
        if len(drawn) > 1:
            wrong.append(f"{name} (drawn differently by ranks "
                         f"{' / '.join(', '.join(map(str, r)) for r in drawn.values())})")
        elif any(len(held) > 1 for held in parts[name].values()):
            wrong.append(f"{name} (replicas of one part differ)")
        elif total != next(iter(drawn)):
            wrong.append(f"{name} ({len(parts[name])} part(s) held: not the whole tensor drawn)")
    if wrong:
        raise InitialValuesDiffer(
            "the model built on the meta device would not start from the values one process "
            f"draws: {len(wrong)} tensor(s) differ: {'; '.join(wrong[:6])}"
            f"{' ...' if len(wrong) > 6 else ''}. Its initializer must draw each whole tensor "
            "alike on every rank and keep its part with meshtrain.parallel.data.meta_init."
            "copy_full_into (or build the model whole: meta_init=False)")
    return len(wholes)
