"""Context parallelism: the sequence split over a ``cp`` mesh axis.

Each rank keeps the queries, keys and values of its own tokens; its attention meets the other
ranks' keys and values as they pass around the cp group piece by piece (ring attention,
ring.py: each piece's partial attention merged by log-sum-exp, the backward passing the pieces
again with their K/V gradients), so a rank's memory is its share of the sequence plus the piece
in flight, and no ``local_len x seq_len`` mask or score matrix is made.

Load balancing (zig-zag): under a causal mask later tokens attend to more keys, so a contiguous
split gives the last rank the most work. The sequence is cut into ``2 * cp`` equal chunks and rank
``r`` holds chunks ``r`` and ``2 * cp - 1 - r``: every rank then has the same number of causal
(query, key) pairs. Token ids, targets and positions must be sharded the same way
(:func:`shard_sequence`, :func:`local_positions`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from meshtrain.errors import ConfigError


def check_cp(seq_len: int, cp_degree: int) -> None:
    """Raise ``ConfigError`` unless ``seq_len`` splits into ``2 * cp_degree`` equal chunks."""
    if not isinstance(cp_degree, int) or isinstance(cp_degree, bool) or cp_degree < 1:
        raise ConfigError(f"cp must be a positive integer, got {cp_degree!r}")
    chunks = 2 * cp_degree
    if seq_len % chunks:
        raise ConfigError(
            f"seq_len={seq_len} does not split into 2 x cp={cp_degree} = {chunks} equal chunks "
            f"(context parallelism gives each rank two chunks for causal load balancing); use a "
            f"seq_len that is a multiple of {chunks}, or a smaller cp"
        )


def chunk_order(cp_rank: int, cp_degree: int) -> tuple[int, int]:
    """The two chunks (of ``2 * cp_degree``) that rank ``cp_rank`` holds, in local order."""
    if not 0 <= cp_rank < cp_degree:
        raise ConfigError(f"cp_rank must be in [0, {cp_degree}), got {cp_rank}")
    return cp_rank, 2 * cp_degree - 1 - cp_rank


def shard_sequence(tensor: torch.Tensor, cp_rank: int, cp_degree: int,
                   dim: int = 1) -> torch.Tensor:
    """This rank's two chunks of ``tensor`` along ``dim``, concatenated (no collective)."""
    check_cp(tensor.size(dim), cp_degree)
    chunks = tensor.chunk(2 * cp_degree, dim)
    first, second = chunk_order(cp_rank, cp_degree)
    return torch.cat((chunks[first], chunks[second]), dim)


def local_positions(local_len: int, cp_rank: int, cp_degree: int,
                    device=None) -> torch.Tensor:
    """Global positions (in ``0..local_len * cp_degree - 1``) of this rank's tokens, in the
    order :func:`shard_sequence` puts them."""
    if local_len % 2:
        raise ConfigError(f"local_len={local_len} must be even (two equal chunks per cp rank)")
    size = local_len // 2
    first, second = chunk_order(cp_rank, cp_degree)
    return torch.cat([torch.arange(c * size, (c + 1) * size, device=device)
                      for c in (first, second)])


def unshard_sequence(parts: list[torch.Tensor], cp_degree: int, dim: int) -> torch.Tensor:
    """Inverse of :func:`shard_sequence`: every rank's part, in rank order -> the full tensor."""
    if len(parts) != cp_degree:
        raise ConfigError(f"expected {cp_degree} parts (one per cp rank), got {len(parts)}")
    chunks: list[torch.Tensor | None] = [None] * (2 * cp_degree)
    for rank, part in enumerate(parts):
        first, second = chunk_order(rank, cp_degree)
        chunks[first], chunks[second] = part.chunk(2, dim)
    return torch.cat(chunks, dim)


def cp_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cp_mesh, *,
                 dropout_p: float = 0.0, scale: float | None = None,
                 kv_groups: int = 1, window: int | None = None,
                 documents: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of this rank's queries over the whole sequence's keys and values.

    ``q``, ``k``, ``v``: this rank's ``(batch, heads, local_len, head_dim)``, tokens in
    :func:`shard_sequence` order; the output keeps that order. ``cp_mesh``: the 1-D cp
    ``DeviceMesh`` (``None`` or size 1: plain causal attention; else ring attention, ring.py).
    ``kv_groups``: grouped-query attention, each K/V head serves that many query heads (only the
    K/V heads travel). ``dropout_p``: on the attention weights (under cp each block's drawn
    from its own seed: random as one process's, not the same draws).
    ``window``: a sliding window, a query attends to the ``window`` latest keys up to itself
    (``0 <= q_pos - k_pos < window``, as transformers' sliding-window masks). ``documents``: ``(batch, seq_len)`` document ids of the whole window
    in sequence order (packed documents, meshtrain.packing.document_ids; computed once per batch
    before the cut): a query attends only to keys of its own document.
    """
    if kv_groups > 1:
        def repeat(t):
            return t.repeat_interleave(kv_groups, dim=-3)
    else:
        def repeat(t):
            return t
    if cp_mesh is None or cp_mesh.size() == 1:
        if documents is not None:
            pos = torch.arange(q.size(-2), device=q.device)
            mask = _causal_mask(pos, pos, window) & _same_document(documents, pos, pos)
            return F.scaled_dot_product_attention(q, repeat(k), repeat(v), attn_mask=mask,
                                                  dropout_p=dropout_p, scale=scale)
        if window is None:
            return F.scaled_dot_product_attention(q, repeat(k), repeat(v), dropout_p=dropout_p,
                                                  is_causal=True, scale=scale)
        pos = torch.arange(q.size(-2), device=q.device)
        return F.scaled_dot_product_attention(q, repeat(k), repeat(v),
                                              attn_mask=_causal_mask(pos, pos, window),
                                              dropout_p=dropout_p, scale=scale)
    if cp_mesh.ndim != 1:
        raise ConfigError(f"cp_mesh must be a 1-D DeviceMesh (the cp axis), got {cp_mesh.ndim}-D")
    local_len = q.size(-2)
    if k.size(-2) != local_len or v.size(-2) != local_len:
        raise ConfigError(f"q, k, v must hold the same tokens; got lengths "
                          f"{local_len}, {k.size(-2)}, {v.size(-2)}")
    return _ring(q, k, v, cp_mesh, scale, window, documents, dropout_p)


def _ring(q, k, v, cp_mesh, scale, window, documents, dropout_p):
    """ring.py's attention, on one head width: values narrower than the keys (DeepSeek's MLA:
    128 < 192) padded with zeros and the output cut back; wider ones: queries and keys padded
    (zeros add nothing to the scores; the scale stays the keys' own)."""
    from meshtrain.parallel.context.ring import ring_attention

    qk, width = q.size(-1), v.size(-1)
    if scale is None and width > qk:
        scale = qk ** -0.5
    if width < qk:
        v = F.pad(v, (0, qk - width))
    elif width > qk:
        q, k = F.pad(q, (0, width - qk)), F.pad(k, (0, width - qk))
    out = ring_attention(q, k, v, cp_mesh, scale=scale, window=window, documents=documents,
                         dropout_p=dropout_p)
    return out[..., :width] if width < qk else out


def _same_document(documents: torch.Tensor, q_pos: torch.Tensor,
                   k_pos: torch.Tensor) -> torch.Tensor:
    """``(batch, 1, queries, keys)``: True where query and key are in the same document."""
    return (documents[:, q_pos, None] == documents[:, None, k_pos])[:, None]


def _causal_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """True where a query (global position ``q_pos``) may attend to a key (``k_pos``)."""
    distance = q_pos[:, None] - k_pos[None, :]
    mask = distance >= 0
    return mask if window is None else mask & (distance < window)


# -- the apply step ---------------------------------------------------------------------------
def cp_support(model: torch.nn.Module, adapter=None):
    """What makes ``model`` context parallel: the model itself (meshtrain's GPT has the methods),
    what ``adapter(model)`` returns for it (the Trainer's adapter for Hugging Face models), or
    else meshtrain's reading of its SDPA calls (sdpa.py)."""
    support = adapter(model) if adapter is not None else None
    if support is not None:
        return support
    if callable(getattr(model, "enable_context_parallel", None)):
        return model
    from meshtrain.parallel.context.sdpa import SDPAContextParallel

    return SDPAContextParallel(model)


def check_cp_model(model: torch.nn.Module, cp_degree: int, adapter=None,
                   sample_inputs=None, pipeline: bool = False) -> None:
    """A model takes part in context parallelism through ``enable_context_parallel(cp_mesh)``
    (its attention then calls :func:`cp_attention`, its positions :func:`local_positions`), or
    through its ``F.scaled_dot_product_attention`` calls (sdpa.py, checked on a training sample:
    ``sample_inputs``); ``check_context_parallel(cp_degree)``, when it has one, checks its
    sizes. Under ``pipeline`` (pp) only the model's own methods."""
    from meshtrain.parallel.context.sdpa import SDPAContextParallel

    support = cp_support(model, adapter)
    if pipeline and support is not model:
        how = "its SDPA calls" if isinstance(support, SDPAContextParallel) else \
            "a Hugging Face adapter"
        raise ConfigError(
            f"cp with pp needs a model that implements enable_context_parallel itself (as "
            f"meshtrain's GPT: each pipeline stage then switches its own attention and "
            f"positions); meshtrain reaches {type(model).__name__}'s attention from outside "
            f"({how}), which a pipeline stage does not run yet. Use cp without pp, or pp "
            "without cp")
    if isinstance(support, SDPAContextParallel):
        support.check_context_parallel(cp_degree, sample_inputs)
        return
    check = getattr(support, "check_context_parallel", None)
    if callable(check):
        check(cp_degree)


def gather_sequence(out, cp_mesh, local_len: int):
    """Outputs computed on this rank's chunks (:func:`shard_batch`'s cut) made whole: every
    tensor of two or more dimensions, which must be per token (dim 1 of this rank's
    ``local_len`` tokens), gathered over the cp group along dim 1 and put back in sequence order
    (a tuple or dict of them alike; collective). Anything else of 2+ dims is refused."""
    import torch.distributed as dist

    if isinstance(out, torch.Tensor) and out.dim() >= 2:
        if out.size(1) != local_len:
            raise ConfigError(
                f"predict under cp: an output of shape {tuple(out.shape)} is not one row per "
                f"token of this rank's {local_len} (dim 1), so its pieces cannot be put back in "
                "sequence order; predict per token, or on a layout without cp")
        group, degree = cp_mesh.get_group(), cp_mesh.size()
        parts = [torch.empty_like(out) for _ in range(degree)]
        dist.all_gather(parts, out.detach().contiguous(), group=group)
        return unshard_sequence(parts, degree, dim=1)
    if isinstance(out, (tuple, list)):
        return type(out)(gather_sequence(o, cp_mesh, local_len) for o in out)
    if isinstance(out, dict):
        return {k: gather_sequence(v, cp_mesh, local_len) for k, v in out.items()}
    return out


def apply_cp(model: torch.nn.Module, cp_mesh, adapter=None) -> None:
    """Switch ``model``'s attention and positions to this rank's share of the sequence."""
    check_cp_model(model, cp_mesh.size(), adapter)
    cp_support(model, adapter).enable_context_parallel(cp_mesh)


def shard_batch(batch, cp_mesh, support=None):
    """This rank's part of a batch: the model's own ``shard_context_parallel_batch`` when it has
    one (Hugging Face models: labels shifted before the cut), else every tensor of two or more
    dimensions (token ids, targets) cut along the sequence (dim 1) by :func:`shard_sequence`."""
    own = getattr(support, "shard_context_parallel_batch", None)
    if callable(own):
        return own(batch, cp_mesh)
    rank, degree = cp_mesh.get_local_rank(), cp_mesh.size()
    if isinstance(batch, torch.Tensor):
        return shard_sequence(batch, rank, degree) if batch.dim() >= 2 else batch
    if isinstance(batch, (tuple, list)):
        return type(batch)(shard_batch(b, cp_mesh) for b in batch)
    if isinstance(batch, dict):
        return {k: shard_batch(v, cp_mesh) for k, v in batch.items()}
    return batch
