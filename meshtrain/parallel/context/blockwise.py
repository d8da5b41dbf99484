"""Attention one block at a time: what context parallel's ring (ring.py) computes for each
(query piece, key piece) pair it meets.

The sequence is cut into pieces of ``size`` positions (each chunk of the zig-zag split is one
piece or several); piece ``i`` holds positions ``i * size .. (i + 1) * size - 1``. A block is one
query piece against one key piece, and :func:`plan` says how the causal mask, a sliding window
and packed documents cut it: not at all visible (above the diagonal, outside the window, no
shared document: skipped), the diagonal (causal), below it (whole), or else an explicit mask of
that one block. :func:`forward_block` computes a block's output and each row's log-sum-exp, and
:func:`merge_` folds it into the running output by their log-sum-exps (the online softmax of
flash and ring attention). :func:`backward_block` gives a block's exact share of the gradients
from the merged output and log-sum-exp, so nothing larger than one block's scores is ever held.

The kernels: on CPU torch's fused attention kernel
(``_scaled_dot_product_flash_attention_for_cpu``, grouped-query heads included, which returns
each row's log-sum-exp) and its backward; on other devices (CUDA), and with attention dropout,
plain matrix products over one block (:func:`_math_forward`, :func:`_math_backward`; scores in
float32 or wider; a block's dropout drawn from its own seed, again alike in the backward).
:func:`block_attention` runs the same blocks in one process with every key at hand.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

_FORWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
_FUSED_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


class Block(NamedTuple):
    """How one (query piece, key piece) block is masked: ``causal`` (the diagonal piece), or an
    additive ``mask`` (``(batch or 1, 1, size, size)``, 0 or -inf) with ``visible`` the rows
    that see any key of the block (None: all of them); neither: the whole block is visible."""

    causal: bool
    mask: torch.Tensor | None = None
    visible: torch.Tensor | None = None


def accumulate_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype outputs, log-sum-exps and gradients are summed in (float32 for 16-bit)."""
    return torch.promote_types(dtype, torch.float32)


def default_scale(q: torch.Tensor, scale: float | None) -> float:
    return 1.0 / math.sqrt(q.size(-1)) if scale is None else scale


def plan(q_piece: int, k_piece: int, size: int, window: int | None,
         q_docs: torch.Tensor | None, k_docs: torch.Tensor | None, dtype: torch.dtype,
         device: torch.device) -> Block | None:
    """The block of query piece ``q_piece`` against key piece ``k_piece`` (None: nothing of it
    is visible). ``window``: a query sees the ``window`` latest keys up to itself;
    ``q_docs`` / ``k_docs``: ``(batch, size)`` document ids of the pieces' tokens; a mask is
    built in ``dtype`` on ``device``."""
    if k_piece > q_piece:
        return None
    diagonal = k_piece == q_piece
    cut = False
    if window is not None:
        nearest = 0 if diagonal else (q_piece - k_piece - 1) * size + 1
        if nearest >= window:
            return None
        farthest = (q_piece - k_piece + 1) * size - 1
        cut = farthest >= window
    same = None
    if q_docs is not None:
        same = q_docs[:, None, :, None] == k_docs[:, None, None, :]
        if bool(same.all()):
            same = None
    if not cut and same is None:
        return Block(diagonal)
    q_pos = torch.arange(q_piece * size, (q_piece + 1) * size, device=device)
    distance = q_pos[:, None] - (q_pos[None, :] - (q_piece - k_piece) * size)
    seen = distance >= 0
    if window is not None:
        seen = seen & (distance < window)
    seen = seen[None, None] if same is None else seen & same
    if not bool(seen.any()):
        return None
    visible = seen.any(-1)
    additive = torch.zeros(seen.shape, dtype=dtype, device=seen.device)
    return Block(False, additive.masked_fill_(~seen, float("-inf")),
                 None if bool(visible.all()) else visible)


def _fused(q: torch.Tensor) -> bool:
    return q.device.type == "cpu" and q.dtype in _FUSED_DTYPES


def _scores(q, k, block: Block, scale: float) -> torch.Tensor:
    """One block's scores in the accumulation dtype, masked (-inf where not visible)."""
    acc = accumulate_dtype(q.dtype)
    groups = q.size(1) // k.size(1)
    k = k.repeat_interleave(groups, dim=1) if groups > 1 else k
    s = torch.matmul(q.to(acc), k.to(acc).transpose(-1, -2)) * scale  # (matmul's own output
    # may be kept by selective activation checkpointing: not changed in place)
    if block.causal:
        upper = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu_(1)
        s.masked_fill_(upper, float("-inf"))
    if block.mask is not None:
        s = s + block.mask.to(acc)
    return s


def _kept(shape, dropout: tuple[float, int], device) -> torch.Tensor:
    """One block's dropout as a factor (0 or ``1 / (1 - p)``), drawn from the block's own seed:
    the forward and the backward draw the same."""
    p, seed = dropout
    gen = torch.Generator(device=device).manual_seed(seed)
    return (torch.rand(shape, generator=gen, device=device) >= p) / (1.0 - p)


def _math_forward(q, k, v, block: Block, scale: float, dropout=None):
    s = _scores(q, k, block, scale)
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - lse.masked_fill(lse.isinf(), 0.0)[..., None])
    if dropout is not None:  # (of the normalised weights: merged by lse as they are)
        p = p * _kept(p.shape, dropout, p.device)
    groups = q.size(1) // v.size(1)
    v = v.repeat_interleave(groups, dim=1) if groups > 1 else v
    return torch.matmul(p, v.to(p.dtype)).to(q.dtype), lse


def _math_backward(grad, q, k, v, out, lse, block: Block, scale: float, dropout=None):
    acc = accumulate_dtype(q.dtype)
    groups = q.size(1) // k.size(1)
    p = torch.exp(_scores(q, k, block, scale) - lse[..., None])
    vv = v.repeat_interleave(groups, dim=1) if groups > 1 else v
    kk = k.repeat_interleave(groups, dim=1) if groups > 1 else k
    grad = grad.to(acc)
    kept = _kept(p.shape, dropout, p.device) if dropout is not None else None
    dv = torch.matmul((p if kept is None else p * kept).transpose(-1, -2), grad)
    dp = torch.matmul(grad, vv.to(acc).transpose(-1, -2))
    if kept is not None:
        dp = dp * kept
    ds = p.mul_(dp.sub_((grad * out.to(acc)).sum(-1, keepdim=True))).mul_(scale)
    dq = torch.matmul(ds, kk.to(acc))
    dk = torch.matmul(ds.transpose(-1, -2), q.to(acc))
    if groups > 1:
        dk = dk.unflatten(1, (k.size(1), groups)).sum(2)
        dv = dv.unflatten(1, (v.size(1), groups)).sum(2)
    return dq, dk, dv


def forward_block(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block: Block,
                  scale: float, dropout: tuple[float, int] | None = None):
    """One block's output (``q``'s dtype) and log-sum-exp per row (accumulation dtype; -inf
    for a row that sees no key of the block). ``dropout``: (probability, the block's seed),
    computed by the plain-matmul kernel (the fused CPU kernel has none)."""
    if _fused(q) and dropout is None:
        out, lse = _FORWARD(q, k, v, 0.0, block.causal, attn_mask=block.mask, scale=scale)
        lse = lse.to(accumulate_dtype(q.dtype))
    else:
        out, lse = _math_forward(q, k, v, block, scale, dropout)
    if block.visible is not None:  # (the kernel says 0 for a row that sees nothing here)
        lse = lse.masked_fill(~block.visible, float("-inf"))
    return out, lse


def backward_block(grad, q, k, v, out, lse, block: Block, scale: float, dropout=None):
    """A block's share of the gradients of q, k, v, from the whole attention's (merged)
    ``out`` and ``lse`` over this block's rows (``dropout`` as the forward's)."""
    if _fused(q) and dropout is None:
        return _BACKWARD(grad, q, k, v, out, lse, 0.0, block.causal, attn_mask=block.mask,
                         scale=scale)
    return _math_backward(grad, q, k, v, out, lse, block, scale, dropout)


def merge_(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor,
           block_lse: torch.Tensor) -> None:
    """Fold one block's output and log-sum-exp into the running ``out`` and ``lse`` (views of
    the same rows), in place. ``block_out`` is left as it is (selective activation checkpointing
    may keep a kernel's output, and refuses one that changed)."""
    merged = torch.logaddexp(lse, block_lse)
    safe = merged.masked_fill(merged.isinf(), 0.0)
    before = torch.exp(lse - safe)[..., None].to(out.dtype)
    here = torch.exp(block_lse - safe)[..., None].to(out.dtype)
    out.mul_(before).addcmul_(block_out, here)
    lse.copy_(merged)


class _BlockAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, q_pieces, size, window, documents, scale, dropout_p):
        seed = draw_seed() if dropout_p else None
        acc = accumulate_dtype(q.dtype)
        out = torch.zeros(q.shape, dtype=acc, device=q.device)
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=acc, device=q.device)
        for kp, rows, qp, block in _all_blocks(q_pieces, k.size(-2) // size, size, window,
                                               documents, q):
            keys = slice(kp * size, (kp + 1) * size)
            o_b, l_b = forward_block(q[..., rows, :], k[..., keys, :], v[..., keys, :], block,
                                     scale, block_dropout(dropout_p, seed, qp, kp))
            merge_(out[..., rows, :], lse[..., rows], o_b, l_b)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse, documents)
        ctx.q_pieces, ctx.size, ctx.window, ctx.scale = q_pieces, size, window, scale
        ctx.dropout = dropout_p, seed
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, lse, documents = ctx.saved_tensors
        grad, size = grad.contiguous(), ctx.size
        acc = accumulate_dtype(q.dtype)
        dq, dk, dv = (torch.zeros(t.shape, dtype=acc, device=t.device) for t in (q, k, v))
        for kp, rows, qp, block in _all_blocks(ctx.q_pieces, k.size(-2) // size, size,
                                               ctx.window, documents, q):
            keys = slice(kp * size, (kp + 1) * size)
            g_q, g_k, g_v = backward_block(grad[..., rows, :], q[..., rows, :], k[..., keys, :],
                                           v[..., keys, :], out[..., rows, :], lse[..., rows],
                                           block, ctx.scale, block_dropout(*ctx.dropout, qp, kp))
            dq[..., rows, :] += g_q
            dk[..., keys, :] += g_k
            dv[..., keys, :] += g_v
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None, None


def _all_blocks(q_pieces, num_pieces, size, window, documents, q):
    """(key piece, rows, first query piece, Block) over every key piece (:func:`key_blocks`)."""
    for kp in range(num_pieces):
        for rows, qp, block in key_blocks(q_pieces, kp, size, window, documents, q):
            yield kp, rows, qp, block


def draw_seed() -> int:
    """A call's dropout seed, from torch's global generator (alike on the ranks of a cp group,
    whose blocks differ)."""
    return int(torch.randint(0, 2**62, ()))


def block_dropout(p: float, seed: int | None, q_piece: int, k_piece: int):
    """The ``dropout`` of the block (or run) from query piece ``q_piece`` over key piece
    ``k_piece``: its own seed, None without."""
    return None if not p else (p, seed + q_piece * (1 << 20) + k_piece)


def key_blocks(q_pieces: list[int], k_piece: int, size: int, window: int | None,
               documents: torch.Tensor | None, q: torch.Tensor):
    """(rows of ``q``, the rows' first sequence piece, Block) of every block of the query pieces
    ``q_pieces`` (``q``'s rows, in that order) over key piece ``k_piece`` that the mask does not
    hide entirely. Neighbouring pieces that see the whole key piece are one run, one kernel call
    (fewer, larger calls: less CPU time), of at most a quarter of the queries (a call's
    transient memory grows with its rows)."""
    longest = max(1, len(q_pieces) // 4)
    run = None  # (first local piece, its sequence piece, pieces in the run)
    for qi, qp in enumerate(q_pieces):
        block = plan(qp, k_piece, size, window, *piece_documents(documents, qp, k_piece, size),
                     q.dtype, q.device)
        whole = block is not None and not block.causal and block.mask is None
        if run is not None and whole and run[0] + run[2] == qi and run[2] < longest:
            run = (run[0], run[1], run[2] + 1)
            continue
        if run is not None:
            yield slice(run[0] * size, (run[0] + run[2]) * size), run[1], Block(False)
            run = None
        if whole:
            run = (qi, qp, 1)
        elif block is not None:
            yield slice(qi * size, (qi + 1) * size), qp, block
    if run is not None:
        yield slice(run[0] * size, (run[0] + run[2]) * size), run[1], Block(False)


def piece_documents(documents: torch.Tensor | None, q_piece: int, k_piece: int, size: int):
    """The document ids of a query piece's and a key piece's tokens (None, None without)."""
    if documents is None:
        return None, None
    return (documents[:, q_piece * size:(q_piece + 1) * size],
            documents[:, k_piece * size:(k_piece + 1) * size])


def block_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pieces: list[int],
                    size: int, *, window: int | None = None,
                    documents: torch.Tensor | None = None, scale: float | None = None,
                    dropout_p: float = 0.0) -> torch.Tensor:
    """The ring's blocks in one process, every key at hand: queries ``q`` ``(batch, heads,
    len(q_pieces) * size, dim)`` are the sequence pieces ``q_pieces`` (in that order), ``k``,
    ``v`` the whole sequence (as many heads, or fewer: grouped-query attention);
    ``documents``: ``(batch, seq_len)`` document ids of the whole sequence; ``dropout_p``: on
    the attention weights, each block's drawn from its own seed."""
    return _BlockAttention.apply(q.contiguous(), k.contiguous(), v.contiguous(), list(q_pieces),
                                 size, window, documents, default_scale(q, scale), dropout_p)
