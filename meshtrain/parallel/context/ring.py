"""Ring attention: context parallel's attention with keys and values passed around the cp group
piece by piece, so a rank holds its own share of the sequence and the pieces in flight.

Each rank holds two chunks of the zig-zag split (context_parallel.py: rank ``r`` chunks ``r``
and ``2 cp - 1 - r``); each chunk is cut into ``pieces`` pieces of ``size`` tokens
(:func:`pieces_per_chunk`), so rank ``r``'s ``2 pieces`` local pieces are sequence pieces
(blockwise.py numbering) ``r * pieces + i`` and ``(2 cp - 1 - r) * pieces + i``.

Forward: in turn for each ``i`` (a "slot"), every rank sends K/V of its ``i``-th piece of each
chunk (a pair: one piece of the sequence's first half, one of its second) to the next rank and
receives the previous rank's while it attends to the pair it holds (one asynchronous shift a
step, overlapped with the blocks: :class:`_Ring`), ``cp`` steps, so every query meets every key
piece once. Each (query piece, key piece) block the causal mask does not hide is computed by the
block kernel (blockwise.py; neighbouring query pieces that see all of a key piece in one call),
merged into the running output by log-sum-exp; blocks wholly above
the diagonal or outside the sliding window are skipped. The zig-zag split gives every rank the
same number of blocks in all, and the pairs the same at every step (a piece of the first half is
seen by the later ranks' first chunks, one of the second half by the earlier ranks' second
chunks), so no rank waits for another at a step's shift. Saved for the backward: this rank's
q, k, v, output and log-sum-exps, nothing of the other ranks'.

Backward: the same ring again. The K/V pairs travel as in the forward (recomputed transport,
not kept), and with each pair travels the sum of the K/V gradients the ranks it has visited
computed for it; after its ``cp``-th step it is back on the rank that owns it, complete. The
query gradients stay local. Per rank the extra memory is the pair in hand and the one arriving,
and in the backward their gradient sums (``16 * size`` rows of K/V width: as much as this rank's
own K at 8 pieces a chunk), against the whole sequence's K/V and gradients that gathering it
kept.

On gloo a CUDA tensor travels through host memory (a copy each way); NCCL sends device
tensors.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed._functional_collectives import AsyncCollectiveTensor, all_to_all_single

from meshtrain.parallel.context import blockwise
from meshtrain.parallel.context.blockwise import accumulate_dtype

#: a piece is at least this many tokens (the block kernels' efficiency: 256 took more CPU time
#: than 512 at 16k tokens, cp=4) ...
MIN_PIECE = 512
#: ... and a chunk is cut into at most this many pieces: what is in flight, 16 pieces of K/V
#: width, is 8 / pieces of a local tensor (q, k, ...)
MAX_PIECES = 8


def pieces_per_chunk(chunk: int) -> int:
    """How many pieces a chunk of ``chunk`` tokens travels in: the most (up to
    :data:`MAX_PIECES`) that divide it into pieces of at least :data:`MIN_PIECE` tokens."""
    for pieces in range(MAX_PIECES, 1, -1):
        if chunk % pieces == 0 and chunk // pieces >= MIN_PIECE:
            return pieces
    return 1


class _Ring:
    """Shifts a tensor one rank on around the cp group: each rank's goes to the next, the
    previous rank's comes in. One ``all_to_all_single`` (functional, so asynchronous until
    :meth:`finish`; torch's own context parallel rotates the same way) whose only non-empty
    parts go to the next rank and come from the previous one: a send and a receive, and a
    collective that shape-only runs on the meta device (the planner's probe) also see."""

    def __init__(self, group, rank: int, degree: int):
        self.group, self.degree = group, degree
        self.next, self.prev = (rank + 1) % degree, (rank - 1) % degree
        self.staged = dist.get_backend(group) == "gloo"

    def start(self, tensor: torch.Tensor):
        """Post this step's shift; returns what :meth:`finish` takes."""
        device, flat = tensor.device, tensor.reshape(-1)
        if self.staged and device.type not in ("cpu", "meta"):  # (gloo moves host tensors)
            flat = flat.cpu()
        sizes_out, sizes_in = [0] * self.degree, [0] * self.degree
        sizes_out[self.next] = sizes_in[self.prev] = flat.numel()
        received = all_to_all_single(flat, sizes_in, sizes_out, self.group)
        return received, tensor.shape, device

    @staticmethod
    def finish(pending) -> torch.Tensor:
        """Wait for the shift posted by :meth:`start`; the tensor received."""
        received, shape, device = pending
        if isinstance(received, AsyncCollectiveTensor):
            received = received.wait()
        return received.view(shape).to(device)

    def shift(self, tensor: torch.Tensor) -> torch.Tensor:
        """Send ``tensor`` on and receive the previous rank's (waits)."""
        return self.finish(self.start(tensor))


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, documents, group, rank, degree, pieces, window, scale, dropout_p):
        size = q.size(-2) // (2 * pieces)
        seed = blockwise.draw_seed() if dropout_p else None
        ring = _Ring(group, rank, degree)
        acc = accumulate_dtype(q.dtype)
        out = torch.zeros(q.shape, dtype=acc, device=q.device)
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=acc, device=q.device)
        mine = _local_pieces(rank, degree, pieces)
        for slot in range(pieces):
            hand = _pair(k, v, slot, pieces, size)
            for step in range(degree):
                pending = ring.start(hand) if step < degree - 1 else None
                for j, held in enumerate(_held(rank, step, degree, pieces, slot)):
                    for rows, qp, block in blockwise.key_blocks(mine, held, size, window,
                                                                documents, q):
                        o_b, l_b = blockwise.forward_block(
                            q[..., rows, :], hand[2 * j], hand[2 * j + 1], block, scale,
                            blockwise.block_dropout(dropout_p, seed, qp, held))
                        blockwise.merge_(out[..., rows, :], lse[..., rows], o_b, l_b)
                if pending is not None:
                    hand = ring.finish(pending)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse, documents)
        ctx.ring, ctx.rank, ctx.degree, ctx.pieces = ring, rank, degree, pieces
        ctx.window, ctx.scale, ctx.dropout = window, scale, (dropout_p, seed)
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, lse, documents = ctx.saved_tensors
        ring, rank, degree, pieces = ctx.ring, ctx.rank, ctx.degree, ctx.pieces
        size = q.size(-2) // (2 * pieces)
        grad = grad.contiguous()
        acc = accumulate_dtype(q.dtype)
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        dk, dv = torch.empty_like(k), torch.empty_like(v)
        mine = _local_pieces(rank, degree, pieces)
        for slot in range(pieces):
            hand = _pair(k, v, slot, pieces, size)
            sums = torch.zeros(hand.shape, dtype=acc, device=hand.device)
            for step in range(degree):
                pending = ring.start(hand) if step < degree - 1 else None
                for j, held in enumerate(_held(rank, step, degree, pieces, slot)):
                    for rows, qp, block in blockwise.key_blocks(mine, held, size, ctx.window,
                                                                documents, q):
                        g_q, g_k, g_v = blockwise.backward_block(
                            grad[..., rows, :], q[..., rows, :], hand[2 * j], hand[2 * j + 1],
                            out[..., rows, :], lse[..., rows], block, ctx.scale,
                            blockwise.block_dropout(*ctx.dropout, qp, held))
                        dq[..., rows, :] += g_q
                        sums[2 * j] += g_k
                        sums[2 * j + 1] += g_v
                if pending is not None:
                    hand = ring.finish(pending)
                sums = ring.shift(sums)  # on with its pieces; the last shift: home
            for j, local in enumerate((slot, pieces + slot)):
                dk[..., _rows(local, size), :] = sums[2 * j]
                dv[..., _rows(local, size), :] = sums[2 * j + 1]
        return dq.to(q.dtype), dk, dv, None, None, None, None, None, None, None, None


def _pair(k, v, slot: int, pieces: int, size: int) -> torch.Tensor:
    """What travels in a slot: K and V of this rank's piece ``slot`` of each chunk (one of the
    first, one of the second: every step then holds as many visible blocks on every rank)."""
    first, second = _rows(slot, size), _rows(pieces + slot, size)
    return torch.stack((k[..., first, :], v[..., first, :], k[..., second, :],
                        v[..., second, :]))


def _held(rank: int, step: int, degree: int, pieces: int, slot: int) -> tuple[int, int]:
    """The sequence pieces in hand at ``step`` of ``slot``: the previous ``step``-th rank's."""
    theirs = _local_pieces((rank - step) % degree, degree, pieces)
    return theirs[slot], theirs[pieces + slot]


def _rows(piece: int, size: int) -> slice:
    return slice(piece * size, (piece + 1) * size)


def _local_pieces(rank: int, degree: int, pieces: int) -> list[int]:
    """The sequence pieces rank ``rank`` holds, in local order."""
    return [chunk * pieces + i for chunk in (rank, 2 * degree - 1 - rank) for i in range(pieces)]


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cp_mesh, *,
                   scale: float | None = None, window: int | None = None,
                   documents: torch.Tensor | None = None, dropout_p: float = 0.0,
                   pieces: int | None = None) -> torch.Tensor:
    """Causal attention of this rank's queries over the whole sequence, K/V passed around the cp
    group (see the module's doc). ``q`` ``(batch, heads, local_len, dim)``, ``k``, ``v`` with as
    many heads or fewer (grouped-query attention: each K/V head serves ``heads / kv_heads``
    query heads; only the K/V heads travel), all of one head width, tokens in the zig-zag order;
    ``window``: a sliding window; ``documents``: ``(batch, seq_len)`` document ids of the whole
    sequence; ``dropout_p``: dropout of the attention weights (each block's drawn from its own
    seed; the plain-matmul kernel); ``pieces``: pieces per chunk (default
    :func:`pieces_per_chunk`)."""
    degree, rank = cp_mesh.size(), cp_mesh.get_local_rank()
    chunk = q.size(-2) // 2
    pieces = pieces_per_chunk(chunk) if pieces is None else pieces
    assert chunk * 2 == q.size(-2) and chunk % pieces == 0, (q.shape, pieces)
    assert q.size(-1) == k.size(-1) == v.size(-1) and q.size(1) % k.size(1) == 0
    return _RingAttention.apply(q.contiguous(), k.contiguous(), v.contiguous(), documents,
                                cp_mesh.get_group(), rank, degree, pieces, window,
                                blockwise.default_scale(q, scale), dropout_p)
