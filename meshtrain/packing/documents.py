"""Documents packed into one window, told apart by their position ids.

A packed window holds the end of one document, whole documents, and the start of another, each
followed by the end-of-text token. Its ``position_ids`` restart at 0 on each document's first
token (``PackedTokens(..., document_mask=True)``), and that is all a model needs to keep its
attention inside a document: a new document starts wherever the position does not go up by one
(transformers' rule, ``find_packed_sequence_indices``, so that a Hugging Face model given
``position_ids`` and no ``attention_mask`` masks the same way). :func:`document_mask` is that mask
for ``F.scaled_dot_product_attention`` in a model of your own, :func:`document_block_mask` the
same as a FlexAttention ``BlockMask`` (a GPU model calling ``torch.compile(flex_attention)``:
blocks outside every document are skipped, not masked); meshtrain's context-parallel
attention builds the same from the window's document ids (computed once per batch, before
the sequence is cut), and the pipeline stages pass the positions
on (docs/llm.md, "Packed documents").

A token's target is the next token: the last token of a document (its end-of-text) would be
trained to predict the next document's first token, from a context that cannot see it.
:func:`cut_targets` drops those targets, as torchtitan does.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def document_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """The document index of each token (0, 1, ... along the last dim): a new one wherever
    the position does not follow the previous token's by one."""
    step = torch.diff(position_ids, prepend=position_ids[..., :1] - 1, dim=-1)
    return (step != 1).cumsum(-1)


def eos_documents(idx: torch.Tensor, eos_id: int) -> torch.Tensor:
    """The document index of each of packed token ids ``(batch, L)`` in which every document
    ends with ``eos_id`` (as ``meshtrain prepare`` writes them): a new one after each eos (the
    window's first tokens, the end of a document begun before it, are document 0). What a
    model given only token ids (meshtrain's GPT with ``document_eos``) keeps apart."""
    return F.pad(idx[..., :-1] == eos_id, (1, 0)).cumsum(-1)


def document_positions(documents: torch.Tensor) -> torch.Tensor:
    """The position of each token in its document, from the document ids of a window (each
    document's first token in the window counts 0)."""
    index = torch.arange(documents.size(-1), device=documents.device).expand_as(documents)
    new = F.pad(documents[..., 1:] != documents[..., :-1], (1, 0), value=True)
    return index - torch.where(new, index, torch.zeros_like(index)).cummax(-1).values


def document_mask(position_ids: torch.Tensor, q_index: torch.Tensor | None = None,
                  k_index: torch.Tensor | None = None) -> torch.Tensor:
    """``(batch, 1, queries, keys)`` booleans for ``F.scaled_dot_product_attention``: True where
    a token may attend to a key (causal, the same document). ``position_ids``: ``(batch, L)`` of
    the whole window. ``q_index`` / ``k_index``: which tokens of it the queries and keys are (by
    default all, in order; context parallel gives a rank's share of the queries)."""
    docs = document_ids(position_ids)
    length = position_ids.size(-1)
    q = torch.arange(length, device=docs.device) if q_index is None else q_index
    k = torch.arange(length, device=docs.device) if k_index is None else k_index
    same = docs[:, q, None] == docs[:, None, k]
    return (same & (q[:, None] >= k[None, :]))[:, None]


def document_block_mask(position_ids: torch.Tensor, block_size: int = 128):
    """:func:`document_mask` as a FlexAttention ``BlockMask`` (causal, the same document) for
    ``flex_attention(q, k, v, block_mask=...)``, built on ``position_ids``' device
    (:func:`documents_block_mask` of their document ids). Blocks no query may see are skipped by
    the compiled kernel: a window of many short documents costs about the sum of their squares,
    not the window's. In torch 2.13 FlexAttention trains on GPUs only (on a CPU it runs forward
    without gradients; use :func:`document_mask` with SDPA)."""
    return documents_block_mask(document_ids(position_ids), block_size)


def documents_block_mask(documents: torch.Tensor, block_size: int = 128):
    """The FlexAttention ``BlockMask`` of causal attention within documents, from a window's
    ``(batch, L)`` document ids (nondecreasing along the window, as :func:`document_ids` and
    :func:`eos_documents` give them). Built from each block's first and last document id, so
    no ``L x L`` mask is ever made: a block of keys before a block of queries is seen in part
    when its last document is the queries' first, whole when both blocks lie in one document;
    the diagonal blocks in part (causal)."""
    from torch.nn.attention.flex_attention import BlockMask

    batch, length = documents.shape
    blocks = -(-length // block_size)
    padded = torch.cat([documents, documents[:, -1:].expand(batch, blocks * block_size - length)],
                       1)
    ends = padded.view(batch, blocks, block_size)
    first, last = ends[..., 0], ends[..., -1]
    index = torch.arange(blocks, device=documents.device)
    below, diagonal = index[:, None] > index[None, :], index[:, None] == index[None, :]
    seen = (below | diagonal) & (last[:, None, :] >= first[:, :, None])
    whole = below & (first[:, None, :] == last[:, :, None])
    if blocks * block_size != length:  # the last block runs past the window: never whole
        whole[:, :, -1] = whole[:, -1, :] = False
    part = seen & ~whole

    def listed(m):  # (counts, indices): each row's blocks in m first, in order
        order = torch.sort((~m).to(torch.int8), dim=-1, stable=True).indices
        return m.sum(-1, dtype=torch.int32)[:, None], order.to(torch.int32)[:, None]

    def same_document_causal(b, h, q, k):
        return (k <= q) & (padded[b, q] == padded[b, k])

    return BlockMask.from_kv_blocks(*listed(part), *listed(whole), BLOCK_SIZE=block_size,
                                    mask_mod=same_document_causal, seq_lengths=(length, length))


def cut_targets(labels: torch.Tensor, position_ids: torch.Tensor,
                ignore_index: int = -100) -> torch.Tensor:
    """Labels in transformers' convention (``labels[t + 1]`` is token ``t``'s target) without the
    targets that cross a document boundary: ``ignore_index`` on each document's first token."""
    starts = torch.diff(position_ids, prepend=position_ids[..., :1] - 1, dim=-1) != 1
    return labels.masked_fill(starts, ignore_index)
